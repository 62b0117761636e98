"""The groups of one rollout step: where they come from, how they complete, where they go.

Every change of a group's place goes through the step's ``GroupLedger`` (``april_slime.core.ledger``);
``StepGroups`` decides the moves, the step's executor decides when (it opens as many groups as the
policy asks for, and reports every group whose trajectories all finished).

Intake (resumption first): the step first takes the whole buffer (``PartialBuffer.take`` applies
the staleness bound and the resume priority; the groups it drops are counted as ``stale``) and
opens those groups before any new prompt. New prompts are fetched from the prompt source only once
the buffered groups are used up, and a fetched batch is checked as a whole before any of it enters
the step. Opening a group queues its work items that need a call (the work kind's ``open``); a
group opened complete is judged at once, and opening stops as soon as the target is met.

Completion: a group counts once all of its trajectories finished (COMPLETED or TRUNCATED);
finished members of unfinished groups stay with their group (CoPRIS eq. 7) and are never
regenerated. A completed group is rewarded (``reward_fn`` awaited, in its own task so refills do
not wait on it; its outcome comes back as a ``("rewarded", group, error)`` event), then
``group_filter`` decides whether it counts. Rejected groups are dropped and counted; passing groups
beyond the target are surplus. While the step recovers, completed groups are not judged.

Leftovers: at the end of a successful step unopened, unfinished and unjudged groups go back into
the buffer unchanged, then the surplus (or, without ``return_surplus``, it is dropped and counted).
A failed or cancelled step puts every group it holds back, accepted and surplus ones included.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

from april_slime.core.buffer import PartialBuffer
from april_slime.core.ledger import (
    DROP_EPISODE_FAILED,
    DROP_FILTERED,
    DROP_REJECTED,
    DROP_STALE,
    DROP_SURPLUS,
    GroupLedger,
    Place,
)
from april_slime.core.pacing import holds_tokens
from april_slime.core.step_context import GroupRewarded, StepContext
from april_slime.core.step_metrics import group_tokens
from april_slime.core.types import Group, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

# the places whose groups the staleness pacing counts (and RESUME, for a group that holds tokens)
_LIVE = frozenset({Place.ACTIVE, Place.REWARDING, Place.DEFERRED, Place.UNJUDGED})

# the counters (groups, tokens) of StepCounters that each counted reason of a drop adds to
_DROP_COUNTERS = {DROP_FILTERED: ("filtered_groups", "filtered_tokens"),
                  DROP_SURPLUS: ("surplus_discarded_groups", "surplus_discarded_tokens"),
                  DROP_REJECTED: ("rejected_groups", "rejected_tokens"),
                  DROP_EPISODE_FAILED: ("episode_failed_groups", "episode_failed_tokens")}


class PromptSource(Protocol):
    def next_groups(self, n: int, current_version: int) -> list[Group]:
        """Up to ``n`` fresh groups; fewer than asked means the dataset is exhausted."""


class StepGroups:
    """The groups of one ``run_step`` call, their ledger and their reward tasks."""

    def __init__(self, step: StepContext, *, buffer: PartialBuffer, prompt_source: PromptSource,
                 n_samples_per_prompt: int, reward_fn: Callable[[Group], Awaitable[None]] | None,
                 group_filter: Callable[[Group], bool] | None, return_surplus: bool):
        self.step = step
        self.buffer = buffer
        self.prompt_source = prompt_source
        self.n_samples_per_prompt = n_samples_per_prompt
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.return_surplus = return_surplus
        self.ledger = GroupLedger()
        self.rewards: dict[str, asyncio.Task] = {}  # group uid -> its reward task (while REWARDING)
        self.exhausted = False  # the prompt source gave fewer groups than asked
        self.stale_delta: dict[str, int] = {}
        self.carried_groups = 0

    @property
    def accepted(self) -> int:
        return self.ledger.count(Place.ACCEPTED)

    # ------------------------------------------------------------------ intake
    def take_buffer(self) -> None:
        buffer = self.buffer
        before_counters = buffer.counters()
        before = {g.uid: g for g in buffer.groups()}
        taken = buffer.take(len(buffer), self.step.current_version)
        taken = self.step.pacing.protect(taken, [g for g in taken if holds_tokens(g)])
        for group in taken:
            self._move(group, to=Place.RESUME)
        self.stale_delta = {k: buffer.counters()[k] - before_counters[k] for k in before_counters}
        still_there = {g.uid for g in buffer.groups()}
        for uid in before.keys() - still_there - {g.uid for g in taken}:
            self.ledger.note_dropped(uid, DROP_STALE)
            self.step.work.discard(before[uid])

    def live(self) -> list[Group]:
        """The groups the staleness pacing counts: opened or holding tokens, not accepted."""
        return [*self.ledger.groups(*_LIVE),
                *(g for g in self.ledger.groups(Place.RESUME) if holds_tokens(g))]

    def _move(self, group: Group, to: Place, *, reason: str | None = None) -> None:
        """Every change of place: the ledger's move, and the pacing told whether the group counts."""
        self.ledger.move(group, to=to, reason=reason)
        if self.step.pacing.active:
            self.step.pacing.track(group, live=to in _LIVE or (to is Place.RESUME and holds_tokens(group)))

    def tokens_changed(self, uid: str, item: Trajectory | None = None) -> None:
        """A reply brought group ``uid`` tokens (maybe of an older version): its slack is read again.
        ``item``: the work item the reply went to; when it is one of the group's members, only its
        versions are read (``StalenessPacing.tokens_added``), else the whole group's."""
        place = self.ledger.place_of(uid)
        if self.step.pacing.active and place in _LIVE:
            group = self.ledger.get(uid, place)
            members = group.trajectories
            i = -1 if item is None else item.index_in_group
            if 0 <= i < len(members) and members[i] is item:
                self.step.pacing.tokens_added(group, item.oldest_version())
            else:  # an episode's call (its member changes when the episode is suspended), the deadline
                self.step.pacing.track(group, live=True)

    def open(self, k: int) -> int:
        """Open up to ``k`` groups, buffered ones first; returns how many were opened. New prompts
        are fetched only once the buffered groups are used up, and opening stops as soon as the
        target is met (buffered complete groups count at once) or the staleness pacing refuses the
        next group."""
        opened = 0
        while opened < k and self.accepted < self.step.target:
            group = self.ledger.first(Place.RESUME)
            resumed = group is not None
            if group is None:
                if not self.ledger.count(Place.FRESH) and not self.exhausted:
                    self._fetch_fresh(k - opened)
                group = self.ledger.first(Place.FRESH)
                if group is None:
                    break
            if self.step.pacing.active and not self._pacing_may_open(group):
                self.step.counters.pacing_held_opens += 1
                break
            self._open(group, resumed=resumed)
            opened += 1
        return opened

    def _pacing_may_open(self, group: Group) -> bool:
        self._cross_check_pacing()
        return self.step.pacing.may_open(group, self.accepted)

    def _pacing_may_accept(self, group: Group) -> bool:
        self._cross_check_pacing()
        return self.step.pacing.may_accept(group, self.accepted)

    def _cross_check_pacing(self) -> None:
        # live() scans every group: only for the tests' self-check, never on a job's path
        if self.step.pacing.cross_check:
            self.step.pacing.check_tracking(self.live())

    def _fetch_fresh(self, k: int) -> None:
        """Ask the prompt source for ``k`` groups; the batch is checked as a whole before any of
        it is accepted, so a bad batch is refused without half of it entering the step."""
        groups = list(self.prompt_source.next_groups(k, self.step.current_version))
        if len(groups) > k:
            raise ValueError(f"prompt source returned {len(groups)} groups when asked for {k}")
        repeated = {uid for uid, count in Counter(g.uid for g in groups).items() if count > 1}
        n = self.n_samples_per_prompt
        for group in groups:
            if len(group.trajectories) != n:
                raise ValueError(f"prompt source gave group {group.uid} with {len(group.trajectories)} "
                                 f"trajectories, expected n_samples_per_prompt={n}")
            if group.uid in self.ledger or group.uid in self.buffer or group.uid in repeated:
                raise ValueError(f"prompt source gave group {group.uid} twice")
            if any(t.status is TrajectoryStatus.RUNNING for t in group.trajectories):
                raise ValueError(f"prompt source gave group {group.uid} with a running trajectory")
        if len(groups) < k:
            self.exhausted = True
        for group in groups:
            self._move(group, to=Place.FRESH)

    def _open(self, group: Group, resumed: bool) -> None:
        if resumed:
            self.step.counters.resumed_groups += 1
        self.step.queue.extend(self.step.work.open_group(group))
        if self.step.work.gave_up(group):
            self._move(group, to=Place.ACTIVE)
            self.drop(group, DROP_EPISODE_FAILED)
        elif group.complete:
            self.complete(group)
        else:
            self._move(group, to=Place.ACTIVE)

    # ------------------------------------------------------------------ completion
    def complete(self, group: Group) -> None:
        """All trajectories of ``group`` finished: reward it, or judge it at once."""
        if self.step.recovering:
            self._move(group, to=Place.UNJUDGED)
            return
        if self.reward_fn is not None and any(t.reward is None for t in group.trajectories):
            self._move(group, to=Place.REWARDING)
            self.rewards[group.uid] = self.step.loop.create_task(self._reward(group))
        else:
            self._judge(group)

    async def _reward(self, group: Group) -> None:
        try:
            await self.reward_fn(group)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.step.report(GroupRewarded(group, e))
        else:
            self.step.report(GroupRewarded(group, None))

    def on_rewarded(self, group: Group, error: Exception | None) -> Exception | None:
        """A reward task ended. Returns the reward function's error when it must end the step."""
        if self.ledger.place_of(group.uid) is not Place.REWARDING:
            return None  # its reward was cancelled; the group was settled then
        del self.rewards[group.uid]
        if error is not None:
            for t in group.trajectories:
                t.reward = None
            self._move(group, to=Place.UNJUDGED)
            if self.step.recovering:
                logger.warning("reward function failed on group %s while recovering: %s", group.uid, error)
                return None
            return error
        if self.step.recovering:
            self._move(group, to=Place.UNJUDGED)
            return None
        self._judge(group)
        return None

    def _judge(self, group: Group) -> None:
        try:
            keep = True if self.group_filter is None else bool(self.group_filter(group))
        except Exception:
            self._move(group, to=Place.UNJUDGED)
            raise
        if not keep:
            self.drop(group, DROP_FILTERED)
            self.promote_deferred()
        elif self.accepted >= self.step.target:
            self._move(group, to=Place.SURPLUS)
        elif not self.step.pacing.active or self._pacing_may_accept(group):
            self._move(group, to=Place.ACCEPTED)
            self.promote_deferred()
        else:
            self._move(group, to=Place.DEFERRED)
            self.step.pacing.deferrals += 1

    def promote_deferred(self, force: bool = False) -> None:
        """Accept the deferred groups that fit now, tightest slack first; ``force``: accept them
        whether they fit or not (nothing else is left to run: the step must not stall on them)."""
        for group in sorted(self.ledger.groups(Place.DEFERRED), key=self.step.pacing.order):
            if self.accepted >= self.step.target:
                return
            if force or self._pacing_may_accept(group):
                if force:
                    self.step.counters.pacing_forced_accepts += 1
                self._move(group, to=Place.ACCEPTED)

    def cancel_rewards(self) -> None:
        """Groups still being rewarded go back unjudged, their partial rewards cleared: the next
        step rewards them again from scratch."""
        for group in self.ledger.groups(Place.REWARDING):
            self.rewards.pop(group.uid).cancel()
            for t in group.trajectories:
                t.reward = None
            self._move(group, to=Place.UNJUDGED)

    def episode_done(self, member: Trajectory) -> None:
        """An episode of ``member``'s group finished, or was given up."""
        if self.ledger.place_of(member.group_uid) is not Place.ACTIVE:
            return  # not opened in this step: the step that opens it sees the member as it is
        self.tokens_changed(member.group_uid)  # an episode's tokens land on its member when it ends
        group = self.ledger.get(member.group_uid, Place.ACTIVE)
        if self.step.work.gave_up(group):
            self.drop(group, DROP_EPISODE_FAILED)
        elif group.complete:
            self.complete(group)

    def drop(self, group: Group, reason: str) -> None:
        """Discard ``group``, counted by its reason (its generated tokens count as discarded)."""
        had_work = self.ledger.place_of(group.uid) is Place.ACTIVE  # only an open group has queued calls
        self._move(group, to=Place.DROPPED, reason=reason)
        self.step.work.discard(group)
        if had_work and self.step.queue:  # in place: the step shares this queue
            kept = [q for q in self.step.queue if q.group_uid != group.uid]
            self.step.queue.clear()
            self.step.queue.extend(kept)
        groups, tokens = _DROP_COUNTERS[reason]
        setattr(self.step.counters, groups, getattr(self.step.counters, groups) + 1)
        setattr(self.step.counters, tokens, getattr(self.step.counters, tokens) + group_tokens(group))
        logger.info("group %s discarded: %s", group.uid, reason)

    # ------------------------------------------------------------------ leftovers
    def return_leftovers(self) -> None:
        """End of a successful step: unopened, unfinished and unjudged groups, then the surplus,
        go back into the buffer."""
        self.carried_groups = self.ledger.count(Place.RESUME, Place.FRESH, Place.ACTIVE)
        for group in self.ledger.groups(Place.ACTIVE):
            group.interruptions += 1  # suspended at the target with work left
            self.step.counters.suspended_groups += 1
        # deferred groups passed within the target: they go back whatever return_surplus says
        for group in self.ledger.groups(Place.RESUME, Place.FRESH, Place.ACTIVE, Place.UNJUDGED,
                                        Place.DEFERRED):
            self._buffer(group)
        self.step.counters.surplus_groups = self.ledger.count(Place.SURPLUS)
        for group in self.ledger.groups(Place.SURPLUS):
            if self.return_surplus:
                self._buffer(group)
            else:
                self.drop(group, DROP_SURPLUS)

    def return_all(self) -> None:
        """End of a failed or cancelled step: every group it holds goes back into the buffer (its
        rewards must have been cancelled and its calls settled)."""
        for group in self.ledger.groups(Place.ACCEPTED, Place.DEFERRED, Place.SURPLUS, Place.UNJUDGED,
                                        Place.RESUME, Place.FRESH, Place.ACTIVE):
            if group.uid not in self.buffer:
                self._buffer(group)

    def _buffer(self, group: Group) -> None:
        self.buffer.put(group)
        self._move(group, to=Place.BUFFERED)
