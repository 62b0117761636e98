"""Staleness pacing and protection of one rollout step: which groups may open, which may count
towards the target now, and which must finish in this step.

Slack. With ``max_staleness: k``, a group's slack at the step of version ``v`` is
``k - staleness(v)`` (staleness: the policy lag of its oldest token, 0 before it has any): the
number of later steps it may still be trained in. Slack 0 means due: trained in this step or never.
A protected group also has slack 0. Without a bound an unprotected group has no deadline (slack
``None``) and pacing leaves it alone.

The bound by construction. Every step accepts exactly ``T = rollout_batch_size`` groups, so the
groups still to be trained can all be trained in time iff, for every ``j``, the live groups (opened
or holding tokens, not accepted) with slack ``<= j`` number at most ``(T - accepted) + j * T``
(earliest deadline first on one machine of ``T`` slots a step). Three rules keep that true:

* open: a group that holds no token yet (a new prompt) enters with slack ``k`` and is opened only
  if the inequality still holds with it;
* accept: a passing group is accepted only if the groups with less slack than its own still fit in
  the slots left after it (for ``j < slack``); otherwise it is deferred (``Place.DEFERRED``) and
  accepted as soon as they do, or goes back to the buffer, complete, at the end of the step. A due
  group is always accepted;
* finish: the step's target is therefore met only once every due group is accepted (or was
  rejected by the filter): no due group is ever aborted at the target. Groups are resumed tightest
  slack first, and a due group's calls go first in the queue.

At the next step the versions advance by one, every slack by one less, and the inequality at
``j`` becomes the one at ``j - 1``: it holds again. What pacing cannot prevent (an engine that
stalls past the drain, versions jumping by more than one a step, a saved buffer from a job with a
looser bound, a due group still unfinished at the step deadline: ``release``) is left to the
buffer's restart / drop fallback, counted as before.

Protection (``max_interruptions: m``): a group suspended at the target ``m`` times (aborted with
work left and carried to the next step, ``Group.interruptions``) is protected when its next step
takes it: it gets slack 0, so it is resumed first and runs to completion in that step instead of
being aborted again. A group is protected only while the inequality holds with it, so protection
never makes a due group miss its step; one left unprotected is protected at a later step.

Cost. The rules read counts of live groups per slack, never the groups themselves: the step tells
the pacing when a group starts or stops counting (``track``, at every change of place) and when a
reply added tokens to a member (``tokens_added``: they may be of an older version), each group's
slack is computed then and kept, and a check costs O(max_staleness) whatever the number of live
groups. A reply costs O(1) (the kept slack against the member's oldest version); a step of N'
requests costs O(N') slack computations (``slack_computations``), not O(accepts x live groups).
"""

from __future__ import annotations

from collections import Counter

from april_slime.core.types import Group


class StalenessPacing:
    """The pacing decisions of one step; the step's ledger stays the owner of the groups' places."""

    # A self-check for the tests: every decision also recomputed from the groups (``cross_check``),
    # which costs O(live groups) a check again.
    cross_check: bool = False

    def __init__(self, *, max_staleness: int | None, max_interruptions: int | None, current_version: int,
                 target: int):
        self.max_staleness = max_staleness
        self.max_interruptions = max_interruptions
        self.current_version = current_version
        self.target = target
        self.protected: set[str] = set()  # uids of the groups protected in this step
        # uids of the due groups the step deadline let go (``release``): no deadline in this step
        self.released: set[str] = set()
        self.deferrals = 0  # times a passing group was deferred
        self.slack_computations = 0  # the work the rules did (tests hold it linear)
        self._counted: dict[str, tuple[Group, int | None]] = {}  # live groups: uid -> (group, its slack)
        self._by_slack: Counter[int] = Counter()  # live groups with a bounded slack, per slack

    @property
    def active(self) -> bool:
        return self.max_staleness is not None or self.max_interruptions is not None

    def slack(self, group: Group) -> int | None:
        """``group``'s slack now (the one kept for it, where it counts)."""
        counted = self._counted.get(group.uid)
        if counted is not None and counted[0] is group:
            return counted[1]
        return self._compute_slack(group)

    def _compute_slack(self, group: Group) -> int | None:
        self.slack_computations += 1
        if group.uid in self.released:
            return None
        if group.uid in self.protected:
            return 0
        if self.max_staleness is None:
            return None
        return self._slack_at(group.staleness(self.current_version))

    def _slack_at(self, staleness: int) -> int:
        """Versions a group whose oldest token is ``staleness`` versions old may still wait."""
        return self.max_staleness - max(0, staleness)

    def must_finish(self, group: Group) -> bool:
        return self.slack(group) == 0

    def release(self, group: Group) -> None:
        """The step deadline passed with ``group`` due and unfinished: it no longer holds the step
        (the caller tracks it again). It goes back to the buffer past its bound, where the buffer's
        restart / drop fallback takes it, counted."""
        self.released.add(group.uid)
        self.protected.discard(group.uid)

    def order(self, group: Group) -> float:
        """Sort key: tightest slack first, no deadline last."""
        slack = self.slack(group)
        return float("inf") if slack is None else slack

    # ------------------------------------------------------------------ the live groups
    def track(self, group: Group, live: bool) -> None:
        """``group`` counts (opened or holding tokens, not accepted) or no longer does; a counted
        group's slack is computed again (a reply may have brought tokens of an older version)."""
        self._uncount(group.uid)
        if live:
            slack = self._compute_slack(group)
            self._counted[group.uid] = (group, slack)
            if slack is not None:
                self._by_slack[slack] += 1

    def tokens_added(self, group: Group, member_oldest: int | None) -> None:
        """A reply appended tokens to one member of the counted ``group``; ``member_oldest``: that
        member's oldest version now. Tokens are only ever added, so the group's oldest version can
        only fall to the member's: its slack is the lower of the kept one and the member's, in
        O(1) instead of a pass over every member's versions (``track``). A group not counted as
        this object is tracked afresh."""
        counted = self._counted.get(group.uid)
        if counted is None or counted[0] is not group:
            self.track(group, live=True)
            return
        kept = counted[1]
        if kept is None or member_oldest is None or group.uid in self.protected:
            return  # released or unbounded: no deadline whatever its tokens; protected: slack 0 stays
        slack = self._slack_at(self.current_version - member_oldest)
        if slack < kept:
            self._uncount(group.uid)
            self._counted[group.uid] = (group, slack)
            self._by_slack[slack] += 1

    def _uncount(self, uid: str) -> None:
        counted = self._counted.pop(uid, None)
        if counted is not None and counted[1] is not None:
            self._by_slack[counted[1]] -= 1
            if not self._by_slack[counted[1]]:
                del self._by_slack[counted[1]]

    def check_tracking(self, live: list[Group]) -> None:
        """The kept slacks are those of ``live`` computed now (``cross_check``)."""
        kept = {uid: slack for uid, (_, slack) in self._counted.items()}
        now = {g.uid: self._compute_slack(g) for g in live}
        if kept != now:
            raise AssertionError(f"staleness pacing: kept slacks {kept} are not the live groups' {now}")

    # ------------------------------------------------------------------ the rules
    def protect(self, taken: list[Group], live: list[Group]) -> list[Group]:
        """At the start of the step: protect the groups of ``taken`` (the buffer's, in its priority
        order) suspended ``max_interruptions`` times, as far as they fit; returns ``taken`` in the
        order to resume them (tightest slack first, the buffer's order within a slack). ``live``:
        the groups of ``taken`` that count (they hold tokens)."""
        if self.max_interruptions is not None:
            slacks = {g.uid: self._compute_slack(g) for g in live}
            by_slack = Counter(s for s in slacks.values() if s is not None)
            for group in taken:
                if group.interruptions < self.max_interruptions or group.complete:
                    continue
                before = slacks[group.uid] if group.uid in slacks else self._compute_slack(group)
                if before == 0:
                    continue
                others = by_slack.copy()
                if group.uid in slacks and before is not None:
                    others[before] -= 1
                others[0] += 1
                if self._fits(others, accepted=0):
                    self.protected.add(group.uid)
                    if group.uid in slacks:
                        slacks[group.uid] = 0
                        by_slack = others
        return sorted(taken, key=self.order)

    def may_open(self, group: Group, accepted: int) -> bool:
        """Whether ``group`` may be opened now."""
        if group.uid in self._counted:
            return True  # already counted (it holds tokens): opening it changes nothing
        slack = self._compute_slack(group)
        if slack is None:
            return True
        return self._fits(self._by_slack + Counter({slack: 1}), accepted)

    def may_accept(self, group: Group, accepted: int) -> bool:
        """Whether the passing ``group`` (a live one) may count towards the target now."""
        slack = self.slack(group)
        if slack == 0:
            return True
        others = self._by_slack.copy()
        if slack is not None and group.uid in self._counted:
            others[slack] -= 1
        others = +others  # drop the slacks no group has
        limit = max(others, default=-1) if slack is None else slack - 1
        return self._fits(others, accepted + 1, up_to=limit)

    def _fits(self, by_slack: Counter[int], accepted: int, up_to: int | None = None) -> bool:
        """``count(slack <= j) <= (T - accepted) + j * T`` for every ``j`` (up to ``up_to``), the
        groups given as counts per slack."""
        slacks = sorted(s for s, n in by_slack.items() if n > 0)
        top = slacks[-1] if slacks else -1
        if up_to is not None:
            top = min(top, up_to)
        below, i = 0, 0
        for j in range(0, top + 1):
            while i < len(slacks) and slacks[i] <= j:
                below += by_slack[slacks[i]]
                i += 1
            if below > self.target - accepted + j * self.target:
                return False
        return True


def holds_tokens(group: Group) -> bool:
    return any(t.response_length for t in group.trajectories) or any(
        t.episode_oldest_version is not None for t in group.trajectories)
