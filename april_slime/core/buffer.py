"""The partial-rollout buffer: every group that a rollout step left unfinished, or finished beyond
its target, waits here until a later step takes it.

A buffered group keeps all of its trajectories together (CoPRIS eq. 7): the unfinished ones carry
their partial response, per-token log-probs and per-token policy versions; the finished ones stay
unchanged until their siblings finish, so a group is never regenerated piecemeal.

Two rules are applied on ``take``:

* staleness bound: the staleness of a group is the policy lag of its oldest token
  (``current_version - oldest version``). A group past ``max_staleness`` is either restarted from
  its prompt (every trajectory is reset, ``Group.restarts`` grows, its tokens are counted as
  ``restarted_tokens``) or dropped (counted in ``dropped_groups`` / ``dropped_tokens``).
* resumption priority: ``verl`` sorts ascending by (unfinished trajectories, mean response length of
  the finished ones or 1e9, -staleness), so groups closest to completion go first; ``fifo`` takes
  the oldest groups first (by ``created_version``, then by arrival); ``stalest`` takes the highest
  staleness first. Ties always keep arrival order.

The buffer is plain data: ``state_dict`` gives its groups and counters as JSON-ready values (or,
for a snapshot, sharing the groups' immutable token columns) and
``load_state_dict`` validates such a state before replacing anything. It has no files of its own:
it is persisted only inside the data source's checkpoint file, written and read in the order that
``april_slime.core.checkpoint`` owns (atomic, so a restarted job resumes every partial).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from april_slime.core.config import RESUME_PRIORITIES, STALE_ACTIONS
from april_slime.core.types import Group, TrajectoryStatus

STATE_FORMAT = 1
TRAJECTORY_COLUMNS = "trajectory_columns"  # the key of a columnar state's trajectories (load_state_dict)
_RESPONSE_IDS, _LOGPROBS = operator.attrgetter("response_ids"), operator.attrgetter("logprobs")
_RUN_TOTAL = operator.attrgetter("version_runs.total")
_FINISHED = frozenset(s for s in TrajectoryStatus if s.finished)
_COUNTERS = ("restarted_groups", "restarted_tokens", "dropped_groups", "dropped_trajectories",
             "dropped_tokens")


class PartialBuffer:
    """Owns every buffered group; nothing else holds a reference to a group while it is here."""

    def __init__(self, priority: str = "verl", max_staleness: int | None = None,
                 stale_action: str = "restart"):
        if priority not in RESUME_PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(RESUME_PRIORITIES)}; got {priority!r}")
        if stale_action not in STALE_ACTIONS:
            raise ValueError(f"stale_action must be one of {', '.join(STALE_ACTIONS)}; got {stale_action!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None; got {max_staleness}")
        self.priority = priority
        self.max_staleness = max_staleness
        self.stale_action = stale_action
        # uid -> (arrival number, group); the arrival number breaks priority ties and orders fifo
        self._groups: dict[str, tuple[int, Group]] = {}
        self._next_arrival = 0
        # cumulative over the buffer's whole life (saved with it, never reset)
        self.restarted_groups = 0
        self.restarted_tokens = 0
        self.dropped_groups = 0
        self.dropped_trajectories = 0
        self.dropped_tokens = 0

    @classmethod
    def from_config(cls, config) -> PartialBuffer:
        return cls(priority=config.resume_priority, max_staleness=config.max_staleness,
                   stale_action=config.stale_action)

    # ------------------------------------------------------------------ contents
    @property
    def discarded_tokens(self) -> int:
        """Generated tokens thrown away by the staleness bound (restarts and drops)."""
        return self.restarted_tokens + self.dropped_tokens

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_uid: str) -> bool:
        return group_uid in self._groups

    def groups(self) -> list[Group]:
        """The buffered groups in arrival order (read-only view; use ``take`` to remove)."""
        return [g for _, g in self._groups.values()]

    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for _, g in self._groups.values())

    def num_partial_trajectories(self) -> int:
        """Unfinished trajectories that already hold generated tokens (work carried over)."""
        return sum(1 for _, g in self._groups.values() for t in g.trajectories
                   if t.status not in _FINISHED and t.response_ids)

    def num_complete_groups(self) -> int:
        return sum(1 for _, g in self._groups.values() if g.complete)

    def counters(self) -> dict[str, int]:
        out = {name: getattr(self, name) for name in _COUNTERS}
        out["discarded_tokens"] = self.discarded_tokens
        return out

    # ------------------------------------------------------------------ put / take
    def put(self, group: Group) -> None:
        """Add a partial or completed-surplus group. A group already here, or one with a trajectory
        still marked running (its reply would be lost), is refused."""
        if group.uid in self._groups:
            raise ValueError(f"group {group.uid} is already in the buffer")
        for t in group.trajectories:
            if t.status is TrajectoryStatus.RUNNING:
                raise ValueError(f"group {group.uid}: trajectory {t.uid} is still running; "
                                 "wait for its reply before buffering it")
            _check_aligned(t)
        self._groups[group.uid] = (self._next_arrival, group)
        self._next_arrival += 1

    def take(self, n: int, current_version: int) -> list[Group]:
        """Apply the staleness bound to every buffered group, then remove and return up to ``n``
        groups in priority order."""
        if n < 0:
            raise ValueError(f"take: n must be >= 0, got {n}")
        self.enforce_staleness(current_version)
        if n == 0 or not self._groups:
            return []
        order = sorted(self._groups.values(), key=self._sort_key(current_version))
        taken = [group for _, group in order[:n]]
        for group in taken:
            del self._groups[group.uid]
        return taken

    def enforce_staleness(self, current_version: int) -> None:
        if self.max_staleness is None:
            return
        for uid, (_arrival, group) in list(self._groups.items()):
            if group.staleness(current_version) <= self.max_staleness:
                continue
            tokens = sum(t.response_length for t in group.trajectories)
            if self.stale_action == "drop":
                del self._groups[uid]
                self.dropped_groups += 1
                self.dropped_trajectories += len(group.trajectories)
                self.dropped_tokens += tokens
            else:
                for t in group.trajectories:
                    t.reset()
                group.restarts += 1
                group.interruptions = 0
                self.restarted_groups += 1
                self.restarted_tokens += tokens

    def _sort_key(self, current_version: int) -> Callable[[tuple[int, Group]], Any]:
        if self.priority == "fifo":
            return lambda item: (item[1].created_version, item[0])
        if self.priority == "stalest":
            return lambda item: (-item[1].staleness(current_version), item[0])

        def verl_key(item: tuple[int, Group]):
            arrival, group = item
            finished = group.finished()
            mean_finished = (sum(t.response_length for t in finished) / len(finished)
                             if finished else 1e9)
            return (len(group.unfinished()), mean_finished, -group.staleness(current_version), arrival)

        return verl_key

    # ------------------------------------------------------------------ state (saved by core.checkpoint)
    def state_dict(self, *, shared: bool = False) -> dict[str, Any]:
        """Groups in arrival order plus the counters, as plain data; with ``shared``, the groups'
        token columns and replay pieces themselves (immutable: a snapshot's, see
        ``Group.to_dict``). The priority / staleness settings are not saved: they belong to the
        job's configuration, which may change across a restart."""
        return {
            "format": STATE_FORMAT,
            "groups": [g.to_dict(shared=shared) for _, g in self._groups.values()],
            "counters": {name: getattr(self, name) for name in _COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a saved state (validated before anything is replaced): the
        ``state_dict`` form, or the columnar form a state file is read in, where each group's
        ``"trajectories"`` is its number of trajectories and ``state[TRAJECTORY_COLUMNS]`` maps each
        field of a trajectory to its values over all of them, in the groups' order. The state is
        left as it is (a restored checkpoint keeps it as the snapshot of its rollout)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"buffer state has format {state.get('format')!r}, expected {STATE_FORMAT}")
        columns = state.get(TRAJECTORY_COLUMNS)
        groups = ([Group.from_dict(g) for g in state["groups"]] if columns is None
                  else Group.from_columns(state["groups"], columns))
        seen: set[str] = set()
        for group in groups:
            if group.uid in seen:
                raise ValueError(f"buffer state holds group {group.uid} twice")
            seen.add(group.uid)
        trajectories = [t for group in groups for t in group.trajectories]
        _check_all_aligned(trajectories)
        for t in trajectories:
            if t.status is TrajectoryStatus.RUNNING:
                # a save taken while a reply was pending: the tokens saved are all we have
                t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        counters = state.get("counters", {})
        # what ``put`` checks was checked above, for every group before any was kept
        self._groups = {group.uid: (arrival, group) for arrival, group in enumerate(groups)}
        self._next_arrival = len(groups)
        for name in _COUNTERS:
            setattr(self, name, int(counters.get(name, 0)))


def _check_all_aligned(trajectories: list) -> None:
    """``_check_aligned`` of every one of ``trajectories``, its lengths read in C (a restore checks
    thousands)."""
    tokens = list(map(len, map(_RESPONSE_IDS, trajectories)))
    if tokens != list(map(len, map(_LOGPROBS, trajectories))) or tokens != list(map(_RUN_TOTAL, trajectories)):
        for t in trajectories:
            _check_aligned(t)


def _check_aligned(t) -> None:
    """Tokens, log-probs and versions must describe the same positions, or IS math goes wrong."""
    run_total = t.version_runs.total
    if not (len(t.response_ids) == len(t.logprobs) == run_total):
        raise ValueError(f"trajectory {t.uid}: {len(t.response_ids)} tokens, {len(t.logprobs)} "
                         f"log-probs and {run_total} versioned positions do not match")
