"""The step deadline: how long a rollout step waits for the groups it must train.

Under a staleness bound (or protection) some groups are due: trained in this step or never
(``april_slime.core.pacing``), so the step's target is met only once each is accepted. One sample
of a due group that never ends (a tool that never returns, with no ``april_episode_tool_timeout_s``;
an engine call that hangs on an engine that answers everything else) would hold the step for good.
``april_step_deadline_s`` after the step's start, each unfinished sample of a due group still open
in the step fails, once:

* its calls in flight are cancelled (and aborted on their engines, best effort), its queued calls
  taken out of the queue: it keeps what it had before them;
* an episode's sample is masked with ``april_mask_failed_samples`` (its group then trains with its
  other members, or is dropped when fewer than two are left), otherwise it fails as any episode
  fault does: re-run from its prompt, or past ``april_max_episode_failures`` given up with its group
  dropped (``core.episodes``); a plain trajectory counts one failed call, as a stalled engine's do
  (``core.faults``): resubmitted, or past ``max_failures_per_trajectory`` the step fails with its
  groups back in the buffer;
* a group left with an unfinished sample (re-run or resubmitted) is released: it no longer holds
  the step, whose target the other groups meet, and goes back to the buffer past its bound, where
  the buffer's restart / drop fallback takes it (counted in ``stale_fallback_groups``).

Counted in the step's ``deadline_failed_samples`` and ``deadline_released_groups``. Without a
staleness bound or protection no group is due and the deadline does nothing; ``0`` turns it off.
The drain after the target has its own deadline (``drain_timeout_s``).
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass, field

from april_slime.core.calls import EngineCalls
from april_slime.core.faults import CallFaults
from april_slime.core.groups import StepGroups
from april_slime.core.ledger import Place
from april_slime.core.step_context import StepContext

logger = logging.getLogger(__name__)

# A timer may fire a rounding error before its time (asyncio runs timers within its clock
# resolution): the deadline counts as passed this close to it, so no wait is left for a sliver.
EARLY_S = 1e-3


def sooner(a: float | None, b: float | None) -> float | None:
    """The shorter of two waits (None: no limit)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


@dataclass(eq=False)
class StepDeadline:
    """One step's deadline for its due groups; fires at most once."""

    step: StepContext
    _: KW_ONLY
    groups: StepGroups
    calls: EngineCalls
    faults: CallFaults
    seconds: float
    at: float | None = field(init=False)  # loop time of the deadline (None: none this step)
    fired: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # only a bound or protection makes a group due: otherwise there is nothing to wait for
        active = self.seconds > 0 and self.step.pacing.active
        self.at = self.step.loop.time() + self.seconds if active else None

    def left(self) -> float | None:
        """Seconds until the deadline (None: none, or it has fired)."""
        if self.at is None or self.fired:
            return None
        return max(self.at - self.step.loop.time(), 0.0)

    def check(self) -> bool:
        """Fail the due groups' unfinished samples once the deadline has passed; whether it fired
        now (the episodes it ended reported their end on the step's queue)."""
        if self.at is None or self.fired or self.step.loop.time() < self.at - EARLY_S:
            return False
        self.fired = True
        why = f"unfinished at the step deadline (april_step_deadline_s={self.seconds:g}) with its group due"
        pacing, work, counters = self.step.pacing, self.step.work, self.step.counters
        for group in self.groups.ledger.groups(Place.ACTIVE):
            if not pacing.must_finish(group):
                continue
            for member in group.unfinished():
                counters.deadline_failed_samples += 1
                self._cancel(work.items_of(member))
                if not work.fail_at_deadline(member, why):
                    self.faults.count_failure(member, f"{member.uid}: {why}")
            # (a group whose episode was given up is dropped when its end is handled)
            if group.unfinished() and not work.gave_up(group):
                counters.deadline_released_groups += 1
                logger.warning("group %s: %s; it goes on without holding the step", group.uid, why)
                pacing.release(group)
                self.groups.tokens_changed(group.uid)  # counted again, with no deadline now
        self.groups.promote_deferred()  # what waited for the due groups to fit may fit now
        return True

    def _cancel(self, uids: set[str]) -> None:
        """Take the calls of ``uids`` out of flight (aborted on their engines) and out of the queue."""
        for call in list(self.calls.in_flight.values()):
            if call.item.uid in uids:
                self.faults.forget_call(call)
                self.calls.abort_later(call.engine_url, call.rid)
        queue = self.step.queue
        if any(item.uid in uids for item in queue):
            kept = [item for item in queue if item.uid not in uids]
            queue.clear()
            queue.extend(kept)
