"""A virtual-time asyncio event loop for in-process emulation.

``loop.time()`` is a virtual clock. Whenever no callback is ready and no I/O is pending, the clock
jumps to the next scheduled timer instead of sleeping, so a workload that spans hours of emulated
engine time finishes as fast as the Python code runs. I/O is still polled (without waiting) on every
iteration, and when nothing at all is scheduled the loop blocks on real I/O as usual (e.g. for a
thread finishing an executor job), so only sockets-free, in-process workloads should run on it.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _VirtualSelector:
    """Wraps the real selector: poll without blocking, and turn a timed wait into a clock jump."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualEventLoop):
        self._real = real
        self._loop = loop

    def select(self, timeout: float | None = None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            return self._real.select(None)
        self._loop._jump(timeout)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` advances only by jumps to the next timer."""

    def __init__(self, start_time: float = 0.0):
        super().__init__()
        self._virtual_now = float(start_time)
        self._selector = _VirtualSelector(self._selector, self)

    def time(self) -> float:
        return self._virtual_now

    def _jump(self, timeout: float) -> None:
        # Land exactly on the earliest timer, so it is due when the loop checks it.
        scheduled = self._scheduled
        target = scheduled[0]._when if scheduled else self._virtual_now + timeout
        self._virtual_now = max(self._virtual_now, target)


def run_virtual(coro: Coroutine[Any, Any, T], *, start_time: float = 0.0, debug: bool | None = None) -> T:
    """Run ``coro`` to completion on a fresh ``VirtualEventLoop`` (like ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=lambda: VirtualEventLoop(start_time), debug=debug) as runner:
        return runner.run(coro)
