"""VCPO's per-sample norms and second buffer with Megatron's real tensor-parallel layers
(VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear), TP 2 on gloo, with and
without sequence parallelism, against one unsharded process computing every sample's gradient
by its own backward: the layer hooks on a packed micro-batch, and the norm a one-sample
micro-batch reads off its gradient buffer (sequence-parallel replicated parameters summed over
the TP group first)."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from april_slime.training.baseline import OpobAccumulator, OpobOptions, opob_policy_loss
from april_slime.training.grad_norms import PerSampleGradNorms, reduce_per_sample_sq_norms
from april_slime.training.offpolicy import Packing

pytestmark = pytest.mark.real

VOCAB, D, H = 16, 8, 12
LENGTHS = [5, 3, 6, 2]  # 16 tokens: divisible by TP 2
RESPONSE = [3, 2, 4, 1]
SINGLE = [2, 3]  # samples run alone as well (even lengths: a sequence-parallel split needs them)
PAPER = OpobOptions(scope="global", weights="paper", length_norm=False, high=2.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (sum(LENGTHS),), generator=g)
    rollout = [-torch.rand(r, generator=g) * 2 - 0.5 for r in RESPONSE]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    return tokens, rollout, rewards


def full_weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(VOCAB, D, generator=g), "norm_w": 1 + 0.1 * torch.randn(D, generator=g),
            "norm_b": 0.1 * torch.randn(D, generator=g), "up": torch.randn(H, D, generator=g) / 3,
            "up_b": 0.1 * torch.randn(H, generator=g), "down": torch.randn(D, H, generator=g) / 3,
            "down_b": 0.1 * torch.randn(D, generator=g), "head": torch.randn(VOCAB, D, generator=g) / 3}


def response_log_probs(logits, tokens):
    """log p of every response token: the position before predicts it; samples back to back."""
    out, start = [], 0
    lp = torch.log_softmax(logits, -1)
    for n, r in zip(LENGTHS, RESPONSE):
        pos = torch.arange(start + n - r - 1, start + n - 1)
        out.append(lp[pos, tokens[pos + 1]])
        start += n
    return out


def reference():
    """Per-sample gradients of w_i * nll_i, one backward per sample, on the unsharded model."""
    w = {k: v.clone().requires_grad_(True) for k, v in full_weights().items()}
    tokens, rollout, rewards = batch()

    def forward():
        x = w["embed"][tokens]
        x = nn.functional.layer_norm(x, (D,), w["norm_w"], w["norm_b"])
        h = nn.functional.gelu(x @ w["up"].t() + w["up_b"])
        y = h @ w["down"].t() + w["down_b"]
        return response_log_probs(y @ w["head"].t(), tokens)

    with torch.no_grad():
        lps = forward()
        log_w = torch.stack([(lp - r).sum() for lp, r in zip(lps, rollout)]).double()
        weights = log_w.exp().clamp(max=2.0)
    sq, q = torch.zeros(len(LENGTHS), dtype=torch.float64), {k: torch.zeros_like(v) for k, v in w.items()}
    for i in range(len(LENGTHS)):
        lps = forward()
        grads = torch.autograd.grad(-weights[i].float() * lps[i].sum(), list(w.values()))
        for (k, _), g in zip(w.items(), grads):
            sq[i] += g.double().pow(2).sum()
            q[k] += rewards[i].float() * g
    return sq, q


MODES = {"tp2": False, "tp2-sp": True}


def worker(rank, world, port, queue):
    """Both layouts in one pair of processes (importing Megatron is the slow part)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for mode, sequence_parallel in MODES.items():
            queue.put((mode, rank, *_worker(rank, world, sequence_parallel)))
    except BaseException:  # the parent reports it instead of waiting for a result
        import traceback
        queue.put(("error", rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _worker(rank, world, sequence_parallel):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        gather_from_tensor_model_parallel_region,
    )

    from tests.support.training.megatron_cpu import megatron_on_cpu

    parallel_state.initialize_model_parallel(world, 1)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    init = nn.init.zeros_
    full = full_weights()
    rows_v, rows_h = VOCAB // world, H // world

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = VocabParallelEmbedding(VOCAB, D, init_method=init, config=cfg,
                                                reduce_scatter_embeddings=sequence_parallel)
            self.norm = nn.LayerNorm(D)
            self.up = ColumnParallelLinear(D, H, config=cfg, init_method=init, bias=True, gather_output=False)
            self.down = RowParallelLinear(H, D, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                          skip_bias_add=False)
            self.head = ColumnParallelLinear(D, VOCAB, config=cfg, init_method=init, bias=False,
                                             gather_output=False)
            for p in self.norm.parameters():
                p.sequence_parallel = sequence_parallel  # as Megatron marks its norms

        def forward(self, tokens):
            x = self.embed(tokens[None])
            if not sequence_parallel:  # [1, s, D] -> Megatron's [s, 1, D] (SP's reduce-scatter does it)
                x = x.transpose(0, 1).contiguous()
            x = self.norm(x)
            h, _ = self.up(x)
            y, _ = self.down(nn.functional.gelu(h))
            logits, _ = self.head(y)
            return gather_from_tensor_model_parallel_region(logits)[:, 0]

    with megatron_on_cpu():
        model = Model()
        with torch.no_grad():
            model.embed.weight.copy_(full["embed"][rank * rows_v:(rank + 1) * rows_v])
            model.norm.weight.copy_(full["norm_w"])
            model.norm.bias.copy_(full["norm_b"])
            model.up.weight.copy_(full["up"][rank * rows_h:(rank + 1) * rows_h])
            model.up.bias.copy_(full["up_b"][rank * rows_h:(rank + 1) * rows_h])
            model.down.weight.copy_(full["down"][:, rank * rows_h:(rank + 1) * rows_h])
            model.down.bias.copy_(full["down_b"])
            model.head.weight.copy_(full["head"][rank * rows_v:(rank + 1) * rows_v])
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tracker = PerSampleGradNorms(model, weighted=True, tp_rank=rank, tp_size=world, tp_group=tp_group)
        tokens, rollout, rewards = batch()
        lps = response_log_probs(model(tokens), tokens)
        segments = Packing.from_lengths(LENGTHS).packed_segment_ids(sum(LENGTHS))
        tracker.set_microbatch(segments, len(LENGTHS), rewards)
        out = opob_policy_loss(lps, rollout, [torch.ones(r) for r in RESPONSE], rewards, segments, options=PAPER)
        out.loss.backward()
        per_sample = reduce_per_sample_sq_norms(tracker.last_sq_norms.clone().double(), tp_group)
        q = {name: tracker.weighted_grads[p].clone() for name, p in model.named_parameters()}

        # the same samples' norms read off the gradient buffer, one sample per micro-batch
        model.zero_grad(set_to_none=True)
        acc = OpobAccumulator(tracker, list(model.parameters()), PAPER)
        acc.begin_step()
        starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
        for i in SINGLE:
            own = tokens[starts[i]:starts[i] + LENGTHS[i]]
            lp = torch.log_softmax(model(own), -1)
            pos = torch.arange(LENGTHS[i] - RESPONSE[i] - 1, LENGTHS[i] - 1)
            one = opob_policy_loss([lp[pos, own[pos + 1]]], [rollout[i]], [torch.ones(RESPONSE[i])], rewards[i:i + 1],
                                   torch.zeros(LENGTHS[i], dtype=torch.long), accumulator=acc, options=PAPER)
            one.loss.backward()
        single_baseline = acc.finish()
    sums = [float((rewards * per_sample).sum()), float(per_sample.sum()), single_baseline]
    # Megatron sums the gradients of sequence-parallel replicated parameters over the TP group
    for name in ("norm.weight", "norm.bias", "down.bias"):
        if sequence_parallel:
            dist.all_reduce(q[name])
    parallel_state.destroy_model_parallel()
    return sums, q


@pytest.fixture(scope="module")
def sharded_results():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(len(procs) * len(MODES)):
        mode, rank, sums, q = queue.get(timeout=300)
        assert sums is not None, f"rank {rank} failed:\n{q}"
        results.setdefault(mode, {})[rank] = (sums, q)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("mode", list(MODES))
def test_norms_and_second_buffer_match_unsharded_per_sample_gradients(sharded_results, mode):
    sq, q_ref = reference()
    rewards = batch()[2]
    num, den, single_baseline = sharded_results[mode][0][0]
    assert den == pytest.approx(float(sq.sum()), rel=1e-5)
    assert num == pytest.approx(float((rewards * sq).sum()), rel=1e-5)
    alone = torch.tensor(SINGLE)
    assert single_baseline == pytest.approx(float((rewards[alone] * sq[alone]).sum() / sq[alone].sum()), rel=1e-5)
    rows_v, rows_h = VOCAB // 2, H // 2
    for rank, (_, q) in sharded_results[mode].items():
        torch.testing.assert_close(q["embed.weight"], q_ref["embed"][rank * rows_v:(rank + 1) * rows_v])
        torch.testing.assert_close(q["up.weight"], q_ref["up"][rank * rows_h:(rank + 1) * rows_h])
        torch.testing.assert_close(q["up.bias"], q_ref["up_b"][rank * rows_h:(rank + 1) * rows_h])
        torch.testing.assert_close(q["down.weight"], q_ref["down"][:, rank * rows_h:(rank + 1) * rows_h])
        torch.testing.assert_close(q["head.weight"], q_ref["head"][rank * rows_v:(rank + 1) * rows_v])
        torch.testing.assert_close(q["down.bias"], q_ref["down_b"])
        torch.testing.assert_close(q["norm.weight"], q_ref["norm_w"])
        torch.testing.assert_close(q["norm.bias"], q_ref["norm_b"])
