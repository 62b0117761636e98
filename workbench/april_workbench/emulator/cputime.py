"""The emulator's own CPU time, so that a benchmark running it in process (virtual mode) can tell
the plugin's cost from the emulator's: each engine adds what its batching loop computes, and the
in-process transport what its handlers compute for each request (``metered``: the CPU of a
coroutine's own steps, not of whatever the loop runs while it waits)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Coroutine
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
    """Awaits ``coro``, adding the CPU of each of its steps (between two suspensions) to ``meter``.
    Its own iterator (``send``/``throw``/``close`` pass through to ``coro``), so awaiting it adds no
    generator to what a request in flight holds."""

    __slots__ = ("coro", "meter")

    def __init__(self, coro: Coroutine, meter: CpuMeter) -> None:
        self.coro, self.meter = coro, meter

    def __await__(self) -> _Timed:
        return self

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        start = time.thread_time()
        try:
            return self.coro.send(value)
        finally:
            self.meter.seconds += time.thread_time() - start

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        # what an awaiting coroutine passes on (the (type, value, traceback) form of 3.11)
        error = val if val is not None else typ
        if isinstance(error, type):
            error = error()
        if tb is not None:
            error = error.with_traceback(tb)
        start = time.thread_time()
        try:
            return self.coro.throw(error)
        finally:
            self.meter.seconds += time.thread_time() - start

    def close(self) -> None:
        self.coro.close()


def metered(coro: Coroutine, meter: CpuMeter) -> Awaitable[Any]:
    """``await metered(coro, meter)`` is ``await coro`` with its CPU added to ``meter``, and no
    coroutine of its own around it: a request in flight holds one object less (what every full
    collection walks, thousands of times over in ``bench scale``)."""
    return _Timed(coro, meter)

