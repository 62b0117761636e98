"""What a failed, refused or stranded model call does to its work item and its group.

* A call that failed (``EngineError``: the client already retried what was safe to retry) leaves
  its item exactly as it was and puts it at the front of the queue; its engine is taken out of
  dispatch until a health probe answers. An item may fail ``max_failures`` calls within one step;
  one more ends the step (``RolloutStepError``), whose groups all go back to the buffer.
* A call the engine refuses as invalid (HTTP 4xx, or ids refused by the client before sending) is
  no engine failure: it counts in the item's ``rejected_calls`` (saved with the buffer), and an item
  refused ``max_rejected_calls`` times is dropped with its group, counted. A step that has dropped
  more than ``max(16, 4 * target)`` groups so and accepted none stops with ``RolloutStepError``:
  then every request is refused, and going on would drop the whole dataset.
* The calls of a stalled engine are cancelled and their items resubmitted elsewhere, each counted as
  a failure, so a wedged engine cannot loop forever.
* What an engine fault cost is counted per lost call (``count_lost``: the seconds the engine held
  it, its token budget, the tokens of an unusable reply), for the step's ``engine_fault_*``
  metrics (``april_slime.core.step_metrics``).
During a drain nothing is resubmitted and no failure ends the step: the item stays with its group.
"""

from __future__ import annotations

import logging

from april_slime.core.calls import Call, EngineCalls
from april_slime.core.groups import StepGroups
from april_slime.core.health import EngineHealth, EngineWatch
from april_slime.core.ledger import DROP_REJECTED, Place
from april_slime.core.sglang_protocol import EngineError, RequestRejected
from april_slime.core.step_context import StepContext
from april_slime.core.step_metrics import LostCall
from april_slime.core.types import Trajectory

logger = logging.getLogger(__name__)

# groups a step may drop for refused calls before, with none accepted, it stops (the bound is
# at least four times the target)
REFUSED_GROUPS_FLOOR = 16


class RolloutStepError(RuntimeError):
    """A rollout step could not finish. Every group of the step was put back into the buffer
    (except those discarded with a counted reason, listed in ``RolloutScheduler.last_dropped``)."""


class CallFaults:
    """One step's failed calls, per item (``failures``), and what each fault does."""

    def __init__(self, step: StepContext, *, health: EngineHealth, engines: EngineWatch, calls: EngineCalls,
                 groups: StepGroups, max_failures: int, max_rejected_calls: int):
        self.step = step
        self.health = health
        self.engines = engines
        self.calls = calls
        self.groups = groups
        self.ledger = groups.ledger
        self.max_failures = max_failures
        self.max_rejected_calls = max_rejected_calls
        self.failures: dict[str, int] = {}  # item uid -> failed calls in this step

    def forget_call(self, call: Call) -> None:
        """Take a call out of flight; its trajectory keeps exactly what it had before the call."""
        if self.calls.forget(call):
            self.step.work.unanswered(call.item)

    def count_lost(self, call: Call, engine_s: float | None = None, seen: int | None = None) -> None:
        """``call`` ended without a usable reply through an engine fault: whatever the engine
        generated for it is gone. ``engine_s``: how long the engine held it (the client's measure;
        else the call's time in flight); ``seen``: the tokens of a reply that came but was unusable."""
        held = call.running_s(self.step.loop.time()) if engine_s is None else engine_s
        self.step.counters.lost_to_faults.append(LostCall(held, call.max_new_tokens, seen))

    def call_failed(self, call: Call, error: EngineError, seen: int | None = None) -> None:
        """``seen``: the tokens of the reply, when the call was answered but its reply unusable."""
        self.step.counters.engine_errors += 1
        self.count_lost(call, error.engine_s, seen)
        self.health.exclude(call.engine_url, f"generate {call.rid} failed: {error}")
        self.engines.start_probe(call.engine_url)
        self.count_failure(call.item, f"generate {call.rid} on {call.engine_url} failed: {error}")

    def count_failure(self, t: Trajectory, what: str) -> None:
        """One failed call of ``t``; past the limit the step ends (during a drain the trajectory
        just stays with its group)."""
        self.failures[t.uid] = self.failures.get(t.uid, 0) + 1
        logger.warning("%s (%d/%d)", what, self.failures[t.uid], self.max_failures + 1)
        if self.step.draining:
            return
        if self.failures[t.uid] > self.max_failures:
            raise RolloutStepError(f"trajectory {t.uid} failed {self.failures[t.uid]} engine calls in "
                                   f"one step (last: {what}); all groups of the step are back in "
                                   "the buffer")
        self.step.queue.appendleft(t)

    def rejected(self, call: Call, error: RequestRejected) -> None:
        t = call.item
        t.rejected_calls += 1
        self.step.counters.rejected_calls += 1
        logger.warning("generate %s refused as invalid (%d/%d): %s", call.rid, t.rejected_calls,
                       self.max_rejected_calls, error)
        if t.rejected_calls >= self.max_rejected_calls:
            group = self.ledger.get(t.group_uid, Place.ACTIVE)
            self.groups.drop(group, DROP_REJECTED)
            for other in list(self.calls.in_flight.values()):
                if other.item.group_uid == group.uid:
                    self.forget_call(other)
                    self.calls.abort_later(other.engine_url, other.rid)
            bound = max(REFUSED_GROUPS_FLOOR, 4 * self.step.target)
            if not self.groups.accepted and self.step.counters.rejected_groups > bound and not self.step.draining:
                # every request refused: the engines (or the job's requests) are wrong, not a sample;
                # dropping prompt after prompt would run through the dataset without end
                raise RolloutStepError(f"{self.step.counters.rejected_groups} groups refused by the engines and none "
                                       f"accepted in this step; last refusal: {error}")
        elif not self.step.draining:
            self.step.queue.appendleft(t)

    def evacuate(self, url: str) -> None:
        """Move every call of a stalled engine elsewhere; the engine is asked to abort them."""
        calls = [c for c in self.calls.in_flight.values() if c.engine_url == url]
        if calls:
            self.calls.abort_later(url, None)
        for call in calls:
            self.count_lost(call)
            self.forget_call(call)
        for call in calls:
            self.count_failure(call.item, f"generate {call.rid} cancelled: engine {url} stalled")
