"""The model calls of one rollout step: starting them, their replies, cancelling and aborting them.

A call is one ``generate`` request for one work item, sent to the engine ``EngineWatch.pick``
chooses. Its rid is ``f"{item.uid}#{item.num_calls}"`` and ``num_calls`` never decreases (it is
saved with the buffer), so rids are unique for the job. Every reply, or the error in its place,
comes back as a ``("reply", call, result, error)`` event on the step's queue; the step alone reads
it. A call taken out of flight (``forget``) is cancelled and its reply, if any still comes, is
ignored.

Aborts are best-effort and never awaited by the step: ``abort_later`` sends one in the background
(short ``abort_timeout_s``, no retries; ``rid=None`` aborts everything the engine runs), at most one
at a time per (engine, rid). ``abort_detached`` is for a cancelled step: the abort must outlive it.

The seam for a second kind of work item: ``EngineCalls`` knows a work item only as a ``CallItem``
(uid, group uid, call count, sampling seed) and takes the request (input ids and token budget)
ready-made, so a multi-turn episode's model call is started, counted, dispatched, aborted and
cancelled exactly like a trajectory's; what a reply means for its item is the work kind's business
(``april_slime.core.work``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from april_slime.core.engine import EngineClient
from april_slime.core.health import EngineWatch
from april_slime.core.step_context import CallReplied, StepContext

logger = logging.getLogger(__name__)


class CallItem(Protocol):
    """What a model call is made for (a ``Trajectory`` today)."""

    uid: str
    group_uid: str
    num_calls: int
    sampling_seed: int


@dataclass(slots=True)
class Call:
    item: CallItem
    engine_url: str
    rid: str
    max_new_tokens: int = 0  # what the engine was asked to generate
    sent_at: float = 0.0  # loop time the call started
    task: asyncio.Task | None = None

    def running_s(self, now: float) -> float:
        return max(now - self.sent_at, 0.0)


class EngineCalls:
    """The step's calls in flight (rid -> ``Call``) and its pending aborts."""

    def __init__(self, step: StepContext, client: EngineClient, engines: EngineWatch, *, sampling_params: dict,
                 abort_timeout_s: float):
        self.step = step
        self.client = client
        self.engines = engines
        self.sampling_params = sampling_params
        self.abort_timeout_s = abort_timeout_s
        self.in_flight: dict[str, Call] = {}
        self.aborts: dict[tuple[str, str | None], asyncio.Task] = {}

    def __len__(self) -> int:
        return len(self.in_flight)

    def start(self, item: CallItem, input_ids: list[int], max_new_tokens: int) -> Call:
        url = self.engines.pick()
        rid = f"{item.uid}#{item.num_calls}"
        item.num_calls += 1
        call = Call(item, url, rid, max_new_tokens, self.step.loop.time())
        self.in_flight[rid] = call
        self.engines.call_started(url)
        self.step.counters.engine_calls += 1
        call.task = self.step.loop.create_task(self._generate(call, input_ids, max_new_tokens))
        return call

    async def _generate(self, call: Call, input_ids: list[int], max_new_tokens: int) -> None:
        try:
            result = await self.client.generate(
                call.engine_url, input_ids, max_new_tokens=max_new_tokens, rid=call.rid,
                sampling_params=getattr(call.item, "sampling_params", None) or self.sampling_params,
                sampling_seed=call.item.sampling_seed, replay_rows=getattr(call.item, "replay_rows", 0))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # classified by the step, its queue's only consumer
            self.step.report(CallReplied(call.rid, None, e))
        else:
            self.step.report(CallReplied(call.rid, result, None))

    def settle(self, rid: str) -> Call | None:
        """A reply (or error) arrived for ``rid``: take its call out of flight. None when it was
        already settled (cancelled by the drain deadline, a stalled engine or a dropped group)."""
        call = self.in_flight.pop(rid, None)
        if call is not None:
            self.engines.call_ended(call.engine_url, answered=True)
        return call

    def forget(self, call: Call) -> bool:
        """Take a call out of flight without its reply (which is ignored if it comes). False when
        the call was already settled."""
        if self.in_flight.pop(call.rid, None) is None:
            return False
        self.engines.call_ended(call.engine_url, answered=False)
        if call.task is not None and not call.task.done():
            call.task.cancel()
        return True

    # ------------------------------------------------------------------ aborts
    def abort_later(self, url: str, rid: str | None) -> None:
        """Send a best-effort abort in the background (never awaited by the drain)."""
        key = (url, rid)
        pending = self.aborts.get(key)
        if pending is not None and not pending.done():
            return
        self.aborts[key] = self.step.loop.create_task(self._abort(url, rid))

    async def _abort(self, url: str, rid: str | None) -> None:
        self.step.counters.abort_calls += 1
        try:
            await self.client.abort(url, rid=rid, abort_all=rid is None,
                                    timeout_s=self.abort_timeout_s, max_retries=0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # the request's own reply (or the drain deadline) still settles the trajectory
            self.step.counters.abort_errors += 1
            logger.warning("abort on %s failed: %s", url, e)

    def abort_detached(self, url: str) -> None:
        """Abort everything ``url`` runs, from a step that is being cancelled (the engine would
        otherwise keep generating replies nobody reads)."""
        _detach(self.step.loop, self.client.abort(url, abort_all=True, timeout_s=self.abort_timeout_s,
                                              max_retries=0))

    def stop(self) -> None:
        for task in self.aborts.values():
            task.cancel()
        self.aborts.clear()


# Aborts sent by a cancelled step must outlive it; holding them here keeps them from being
# garbage-collected before they run. Each is bounded by its own short timeout.
_DETACHED: set[asyncio.Task] = set()


def _detach(loop: asyncio.AbstractEventLoop, coro: Awaitable) -> None:
    async def best_effort() -> None:
        try:
            await coro
        except Exception as e:
            logger.warning("abort after a cancelled step failed: %s", e)

    task = loop.create_task(best_effort())
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)
