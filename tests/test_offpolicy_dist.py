"""Cross-rank ESS reduction with torch.distributed (gloo, 2 processes)."""

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from april_slime.training import offpolicy as op

WORLD = 2
# rank 1 holds the dominant weight, so a rank-local ESS would differ from the global one
LOG_WEIGHTS = {0: [0.1, -0.3, 0.2], 1: [-0.5, 40.0, 0.0, 0.3]}
VALID = {0: [True, True, False], 1: [True, True, True, True]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=__import__("datetime").timedelta(seconds=15))
        lw = torch.tensor(LOG_WEIGHTS[rank], dtype=torch.float32)
        valid = torch.tensor(VALID[rank])
        default = op.effective_sample_size(lw, valid=valid)
        group = dist.new_group([0, 1])
        grouped = op.effective_sample_size(lw, valid=valid, group=group)
        local = op.effective_sample_size(lw, valid=valid, reduce=False)
        results[rank] = (default.ess, default.ess_ratio, default.num_samples, grouped.ess, local.num_samples)
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which fails the test
        results[rank] = repr(exc)


def test_ess_is_reduced_across_ranks():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(rank, port, results)) for rank in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=30)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, "distributed workers timed out"
        results = dict(results)

    weights = [math.exp(x) for r in range(WORLD) for x, v in zip(LOG_WEIGHTS[r], VALID[r]) if v]
    expected = sum(weights) ** 2 / sum(w * w for w in weights)
    for rank in range(WORLD):
        got = results[rank]
        assert not isinstance(got, str), got
        ess, ratio, n, grouped_ess, local_n = got
        assert n == len(weights) == 6
        assert ess == pytest.approx(expected, rel=1e-6)
        assert ratio == pytest.approx(expected / 6, rel=1e-6)
        assert grouped_ess == pytest.approx(expected, rel=1e-6)
        assert local_n == sum(VALID[rank])
