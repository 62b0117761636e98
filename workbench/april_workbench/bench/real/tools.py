"""The multi-turn workload's tools on the real stack: a bounded pool of worker processes.

A tool call is a job on one of ``workers`` processes (a sandbox pool): it holds its worker for its
latency (a sleep in the worker: the engines' CPU is not taken by it, as a remote sandbox's is not),
then returns. Calls beyond the pool wait for a free worker, first come first served; the bench's
agent (``multiturn.BenchAgent``) holds that queue, so the same agent runs the emulated twin with
its tools sleeping on the virtual clock instead.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def _work(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class ToolProcessPool:
    """``workers`` processes (spawned, so nothing of the event loop or its sockets is inherited);
    ``run(seconds)`` holds one of them that long."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a tool pool needs >= 1 worker, got {workers}")
        self.workers = workers
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        self.calls = 0
        # start every worker now, not at the first tool call of a measured step
        list(self._pool.map(_work, [0.0] * workers))

    def pids(self) -> list[int]:
        return list(self._pool._processes)  # the executor's own record of its workers

    async def run(self, seconds: float) -> None:
        self.calls += 1
        await asyncio.get_running_loop().run_in_executor(self._pool, _work, seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ToolProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
