"""The continuous batch on the event loop's clock: one scheduling task per engine.

The task plans the batch's next (macro) step, sleeps until it ends on the emulated clock, and
commits it; an arrival, an abort or a weight-version bump wakes it early (``_poke``), and the
engine's client side (``batching.EmulatedEngine``) cuts the step in progress where step-by-step
execution would have changed course. What a committed step finished is handed to ``_finish``,
which the client side defines (it replies). A failure of the task stops the engine
(``EngineStopped``), and ``_loop_failed`` tells the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod

from .batch import ContinuousBatch, _Plan
from .config import EngineConfig
from .cputime import CpuMeter, metered
from .model import SyntheticLM
from .request import _Request


class EngineStopped(RuntimeError):
    """The engine is not running (stopped, or its scheduling loop failed): HTTP 503."""


class ClockedBatch(ContinuousBatch, ABC):
    """A ``ContinuousBatch`` stepped by a task of the running event loop; the engine's client side
    says what a finished request and a failed loop mean for its clients. All calls run on the
    loop's thread."""

    def __init__(self, model: SyntheticLM, config: EngineConfig | None = None, name: str = "engine"):
        super().__init__(model, config, name)
        self._task: asyncio.Task | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False
        self.cpu = CpuMeter()  # the batching loop's own CPU (a benchmark tells it from the client's)

    # ------------------------------------------------------------------ what the client side defines
    @abstractmethod
    def _finish(self, req: _Request, reason: str) -> None:
        """``req`` ended (``reason``: stop, length or abort): reply to its client."""

    @abstractmethod
    def _loop_failed(self, error: EngineStopped) -> None:
        """The scheduling task failed: every client still waiting gets ``error``."""

    # ------------------------------------------------------------------ lifecycle
    def start(self, origin: float | None = None) -> None:
        """Start the scheduling task on the running loop; ``origin`` is loop time of emulated 0."""
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time() if origin is None else origin
        self._t = self.now()
        self._task = self._loop.create_task(self._scheduling(), name=f"emulator-{self.name}")
        self._task.add_done_callback(self._on_loop_exit)

    async def _scheduling(self) -> None:
        # the loop's coroutine is made when the task first runs: a task stopped before that (an
        # engine stopped at once) leaves no coroutine behind that was never awaited
        await metered(self._run(), self.cpu)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the scheduling loop must not leave clients waiting forever: fail them loudly.
        self._closed = True
        self._loop_failed(EngineStopped(f"{self.name}: scheduling loop failed: {task.exception()!r}"))

    async def _stop_loop(self) -> None:
        """Stop scheduling, the steps of the plan in progress that completed credited."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Re-raises a failure of the loop (its clients were already failed by _on_loop_exit).
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._settle_plan_for_abort(self.now())

    def _poke(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def _settle_plan_for_abort(self, now: float) -> None:
        """On shutdown: credit the steps of the plan in progress that completed before ``now``."""
        plan = self._plan
        if plan is None:
            return
        if plan.kind == "decode":
            j = plan.steps_done(now)
            if j >= plan.k:
                self._commit(plan)
                return
            for req in plan.batch:
                req.generated += j
                self.decoded_tokens += j
        self._plan = None

    # ------------------------------------------------------------------ the scheduling loop
    async def _run(self) -> None:
        while True:
            plan = self._plan
            if plan is None:
                plan = self._next_plan()
                if plan is None:
                    await self._sleep_until(None)  # idle until an arrival
                    # The idle gap is not work: the next step starts now. While busy, steps
                    # follow each other back to back on the emulated clock, whatever the lag
                    # of the real loop behind it (up to max_lag_s, when set).
                    self._t = max(self._t, self.now())
                    continue
            self._bound_lag()
            while self._plan is plan:
                end = plan.end
                fired = await self._sleep_until(end)
                if self._plan is not plan:
                    break
                if fired and plan.end == end or plan.end <= self.now():
                    self._commit(plan)

    def _bound_lag(self) -> None:
        """With ``max_lag_s``: the time the loop lost beyond it is a pause of this engine's clock."""
        max_lag = self.config.max_lag_s
        if max_lag is None:
            return
        lag = self.now() - self._t
        if lag > max_lag:
            self._origin += (lag - max_lag) / self.config.time_scale

    async def _sleep_until(self, emulated: float | None) -> bool:
        """Sleep until the emulated time (True) or a poke (False)."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        handle = None
        if emulated is not None:
            handle = self._loop.call_at(self._loop_time(emulated), set_if_pending, waiter, True)
        try:
            return await waiter
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    def _commit(self, plan: _Plan) -> None:
        """The plan's steps have all elapsed: apply them and reply to the requests they finished."""
        for req, reason in self._apply(plan):
            self._finish(req, reason)


def set_if_pending(fut: asyncio.Future, value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
