"""The ledger of one rollout step's groups: where every group the step holds is, and nothing else.

A group is in exactly one place at any moment:

* ``RESUME``: taken from the buffer at the start of the step, not opened yet;
* ``FRESH``: given by the prompt source, not opened yet;
* ``ACTIVE``: opened, some trajectory unfinished (its calls are queued or in flight);
* ``REWARDING``: complete, the reward function runs on it;
* ``ACCEPTED``: rewarded and passed the filter within the target (the step returns these);
* ``DEFERRED``: passed the filter within the target, held back by the staleness pacing until the
  groups with less slack fit (``april_slime.core.pacing``); accepted later, or buffered complete;
* ``SURPLUS``: passed the filter beyond the target;
* ``UNJUDGED``: complete but not judged (completed while recovering, its reward failed, or the
  drain deadline cut its reward off);
* ``BUFFERED``: put back into the buffer at the end of the step;
* ``DROPPED``: discarded, with its reason (``DROP_*``).

Groups enter in ``RESUME`` or ``FRESH``; ``BUFFERED`` and ``DROPPED`` are final. Every change of
place is one ``move``, which refuses (``LedgerError``, naming the group and both places) whatever
would put a group in two places, move a group the step does not hold, or take one out of a final
place. Within a place groups keep the order they arrived in, so the first of ``RESUME`` is the
next buffered group to open and ``ACCEPTED`` is in the order the groups were accepted.

``dropped`` (uid -> reason) also lists the groups the buffer discarded for staleness when the
step took it (``note_dropped``): the step never held them, but they are part of its account
(``StepResult.dropped``, ``RolloutScheduler.last_dropped``).

The ledger holds groups of any kind of work item: a coming multi-turn episode belongs to its
sample's group like a trajectory does, so the places and the invariant do not change with it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from april_slime.core.types import Group

# reasons a group is discarded, as they appear in StepResult.dropped / RolloutScheduler.last_dropped
DROP_FILTERED = "filtered"
DROP_SURPLUS = "surplus_discarded"
DROP_STALE = "stale"
DROP_REJECTED = "rejected_by_engine"
DROP_EPISODE_FAILED = "episode_failed"  # an episode failed past its re-runs (core.episodes)


class Place(enum.Enum):
    RESUME = "resume"
    FRESH = "fresh"
    ACTIVE = "active"
    REWARDING = "rewarding"
    ACCEPTED = "accepted"
    DEFERRED = "deferred"
    SURPLUS = "surplus"
    UNJUDGED = "unjudged"
    BUFFERED = "buffered"
    DROPPED = "dropped"


ENTRIES = frozenset({Place.RESUME, Place.FRESH})
FINAL = frozenset({Place.BUFFERED, Place.DROPPED})


class LedgerError(RuntimeError):
    """A move that would break "every group is in exactly one place": a bug in the scheduler."""


class GroupLedger:
    def __init__(self) -> None:
        self._places: dict[Place, dict[str, Group]] = {p: {} for p in Place}
        self._where: dict[str, Place] = {}
        self.dropped: dict[str, str] = {}  # uid -> reason, in the order the groups were dropped

    def move(self, group: Group, to: Place, *, reason: str | None = None) -> None:
        """Put ``group`` in ``to``: a group the step does not hold yet enters (``RESUME`` or ``FRESH``
        only); a held one leaves its place. ``reason`` is given for ``DROPPED`` and only for it."""
        uid = group.uid
        here = self._where.get(uid)
        if here is None:
            if to not in ENTRIES:
                raise LedgerError(f"group {uid} is not in this step; it cannot be moved to {to.value} "
                                  f"(groups enter in {Place.RESUME.value} or {Place.FRESH.value})")
        elif here is to or here in FINAL or to in ENTRIES:
            raise LedgerError(f"group {uid} is in {here.value}; it cannot also be in {to.value}")
        elif self._places[here][uid] is not group:
            raise LedgerError(f"group {uid} in {here.value} is another object than the group moved "
                              f"to {to.value} (two groups with one uid)")
        if (to is Place.DROPPED) != (reason is not None):
            raise LedgerError(f"group {uid}: a reason is given exactly for a move to {Place.DROPPED.value}")
        if here is not None:
            del self._places[here][uid]
        self._places[to][uid] = group
        self._where[uid] = to
        if reason is not None:
            self.dropped[uid] = reason

    def note_dropped(self, uid: str, reason: str) -> None:
        """A group discarded before the step held it (the buffer's staleness drop)."""
        if uid in self._where:
            raise LedgerError(f"group {uid} is in {self._where[uid].value}; it cannot also be in "
                              f"{Place.DROPPED.value} without being moved there")
        self.dropped[uid] = reason

    # ------------------------------------------------------------------ reading
    def __contains__(self, uid: str) -> bool:
        """Whether the step holds (or held) the group, in any place."""
        return uid in self._where

    def place_of(self, uid: str) -> Place | None:
        return self._where.get(uid)

    def get(self, uid: str, place: Place) -> Group:
        """The group ``uid``, which must be in ``place``."""
        here = self._where.get(uid)
        if here is not place:
            raise LedgerError(f"group {uid} is in {here.value if here else 'no place of this step'}, "
                              f"not in {place.value}")
        return self._places[place][uid]

    def count(self, *places: Place) -> int:
        return sum(len(self._places[p]) for p in places)

    def first(self, place: Place) -> Group | None:
        return next(iter(self._places[place].values()), None)

    def groups(self, *places: Place) -> list[Group]:
        """The groups of ``places`` (a copy, in this order of places, each in arrival order)."""
        return [g for p in places for g in self._places[p].values()]

    def __iter__(self) -> Iterator[tuple[Group, Place]]:
        for place, groups in self._places.items():
            for group in groups.values():
                yield group, place

    def check_settled(self) -> None:
        """After a successful step every group is returned, buffered or dropped."""
        left = [f"{g.uid} ({p.value})" for g, p in self
                if p not in (Place.ACCEPTED, Place.BUFFERED, Place.DROPPED)]
        if left:
            raise LedgerError(f"groups left in an open place at the end of the step: {', '.join(left)}")
