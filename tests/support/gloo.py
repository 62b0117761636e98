"""Run a function on several gloo ranks, each its own spawned process, and collect what each
returns: the data-parallel and tensor-parallel tests on CPU.

No time limit of its own: a loaded machine only makes the ranks slower. A rank that raises fails
the call with its traceback (``torch.multiprocessing``), and gloo's own timeout (ten minutes)
ends a collective that one rank never joins."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_TIMEOUT = datetime.timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable[..., Any], world: int, port: int, results, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        results[rank] = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks of one gloo group (the default group); returns
    the ranks' return values in rank order. ``fn`` and its arguments and results must pickle
    (a module-level function of a test module)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(fn, world, _free_port(), results, args), nprocs=world,
                           join=True, start_method="spawn")
        return [results[rank] for rank in range(world)]
