"""The emulator's own CPU time, so that a benchmark running it in process (virtual mode) can tell
the plugin's cost from the emulator's: each engine adds what its batching loop computes, and the
in-process transport what its handlers compute for each request (``timed``: the CPU of a
coroutine's own steps, not of whatever the loop runs while it waits)."""

from __future__ import annotations

import time
from collections.abc import Coroutine, Generator
from typing import Any


class CpuMeter:
    """Thread CPU seconds spent inside what it measures."""

    __slots__ = ("seconds", "_start")

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> CpuMeter:
        self._start = time.thread_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.thread_time() - self._start


class _Timed:
    """Awaits ``coro``, adding the CPU of each of its steps (between two suspensions) to ``meter``."""

    def __init__(self, coro: Coroutine, meter: CpuMeter) -> None:
        self.coro, self.meter = coro, meter

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, meter = self.coro, self.meter
        value: Any = None
        error: BaseException | None = None
        while True:
            start = time.thread_time()
            try:
                yielded = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as done:
                meter.seconds += time.thread_time() - start
                return done.value
            except BaseException:
                meter.seconds += time.thread_time() - start
                raise
            meter.seconds += time.thread_time() - start
            try:
                value, error = (yield yielded), None
            except BaseException as e:  # noqa: BLE001  (passed on into the coroutine, as await does)
                value, error = None, e


async def timed(coro: Coroutine, meter: CpuMeter) -> Any:
    return await _Timed(coro, meter)
