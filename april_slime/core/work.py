"""What a work item of a rollout step is, and how it turns model calls into progress.

A work item is what the step queues and makes model calls for. There is one kind today, the
``Trajectory`` (``TrajectoryWork``): one sample, one response, resumed across calls and steps. The
step uses a kind through four methods; besides them it reads only an item's ``uid`` and
``group_uid``, whether it is finished (``status.finished``), and counts refused calls in its
``rejected_calls``:

* ``open(item) -> bool``: when its group is opened; whether the item needs a call at all.
* ``begin_call(item) -> (input_ids, max_new_tokens)``: the request of its next call (the step then
  starts it with ``EngineCalls.start``; that pair is the only way work reaches an engine).
* ``absorb(item, reply, draining) -> error | None``: a reply; the item is finished, or wants its
  next call, or the reply was unusable (the error; nothing was applied).
* ``unanswered(item)``: its call ended without a usable reply; the item keeps exactly what it had.

Trajectories: a finished trajectory (COMPLETED or TRUNCATED) needs no call. A reply whose last
token is EOS or a stop token id is finished whatever its finish_reason says (SGLang can answer
"abort" or "length" for a request whose last sampled token was EOS; resuming it would run past
the stop). An unfinished trajectory is (re)submitted with ``input_ids = prompt + partial
response`` and ``max_new_tokens`` reduced by what it already has; the reply's tokens and log-probs
are appended with their per-token policy versions (SGLang's ``weight_versions`` spans when the
weights changed during the call, else the reply's ``weight_version``). A trajectory with no budget
left is marked TRUNCATED without a call. An aborted reply's partial tokens are appended; one that
raced the abort and finished counts as finished (ending in a stop token: "stop"; filling the budget:
"length", so no reply the plugin builds ever says "abort" for a finished call).

The seam for multi-turn episodes (slime's custom generate functions: an agent coroutine per
sample that makes several model calls with tool calls between them) is a second kind with the same
four methods: ``open`` starts or resumes the sample's coroutine from its saved state; the episode
is queued only while its coroutine waits on a model call, and ``begin_call`` hands out that
pending request; ``absorb`` appends the reply and resumes the coroutine, which either asks for its
next call (the step queues the episode again once it does) or returns (the sample is finished);
``unanswered`` keeps the pending request for a later call. At target the pending call is aborted
like a trajectory's, its partial kept, and the episode goes to the buffer with its group, to be
resumed next step. Policies count its calls against the concurrency like any other
(``april_slime.core.policies``), and the ledger holds its group like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from april_slime.core.sglang_protocol import EngineError, EngineReplyError, GenerateResult
from april_slime.core.step_metrics import StepCounters
from april_slime.core.types import Group, Trajectory, TrajectoryStatus


class TrajectoryWork:
    """Trajectories as work items of one step (its stop tokens and counters)."""

    def __init__(self, stop_token_ids: frozenset[int], counters: StepCounters):
        self.stop_token_ids = stop_token_ids
        self.counters = counters

    def open(self, t: Trajectory) -> bool:
        if t.status.finished:
            return False
        if t.response_ids and t.response_ids[-1] in self.stop_token_ids:
            # buffered by an older version that resumed past a stop: it is finished
            t.status, t.finish_reason = TrajectoryStatus.COMPLETED, "stop"
            self.counters.stop_token_finishes += 1
            return False
        if t.remaining_tokens <= 0:
            t.status, t.finish_reason = TrajectoryStatus.TRUNCATED, "length"
            self.counters.truncated_without_call += 1
            return False
        return True

    # the step's side of a work kind beyond one item (episodes.EpisodeWork has more to do)
    def open_group(self, group: Group) -> list[Trajectory]:
        """The items of a just opened group that need a call now."""
        return [t for t in group.trajectories if self.open(t)]

    def gave_up(self, group: Group) -> bool:
        return False

    def busy(self, groups: list[Group]) -> bool:
        """Whether any of ``groups`` will make progress without a call of the step."""
        return False

    live_episodes = 0

    def items_of(self, member: Trajectory) -> set[str]:
        """The uids of the work items that make ``member``'s calls."""
        return {member.uid}

    def fail_at_deadline(self, member: Trajectory, why: str) -> bool:
        """The step deadline passed with ``member`` unfinished in a due group (its call, if any, was
        cancelled). Whether the work kind dealt with it; a trajectory does not: the step counts a
        failed call (``faults.CallFaults.count_failure``)."""
        return False

    def discard(self, group: Group) -> None:
        """The step discards ``group`` (dropped)."""

    def settle(self, group: Group) -> None:
        """``group`` leaves the job (returned for training)."""

    def begin_call(self, t: Trajectory) -> tuple[Sequence[int], int]:
        if t.response_ids:
            self.counters.resumed_uids.add(t.uid)
        t.status = TrajectoryStatus.RUNNING
        return t.input_array(), t.remaining_tokens

    def unanswered(self, t: Trajectory) -> None:
        if t.status is TrajectoryStatus.RUNNING:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING

    def absorb(self, t: Trajectory, result: GenerateResult, draining: bool) -> EngineError | None:
        """Append one reply to its trajectory; returns an error (and appends nothing) if the reply
        cannot be used."""
        finish = result.finish_reason
        if finish not in ("stop", "length", "abort"):
            return EngineReplyError(f"{result.engine_url}: unknown finish reason {finish!r} for {t.uid}")
        if len(result.output_ids) > t.remaining_tokens:
            return EngineReplyError(f"{result.engine_url}: {len(result.output_ids)} tokens for {t.uid} "
                                    f"exceed its remaining budget {t.remaining_tokens}")
        if finish == "abort" and not len(result.output_ids) and not draining:
            return EngineReplyError(f"{result.engine_url}: request of {t.uid} aborted by the engine "
                                    "without any token")
        try:
            t.append(result.output_ids, result.logprobs, int(result.weight_version), result.version_runs, result.replay)
        except (ValueError, TypeError) as e:
            return EngineReplyError(f"{result.engine_url}: {e}")
        tokens = len(result.output_ids)
        self.counters.generated_tokens += tokens
        if finish != "stop" and tokens and int(result.output_ids[-1]) in self.stop_token_ids:
            # the abort (or the budget) raced a sampled stop token: the response is complete
            self.counters.stop_token_finishes += 1
            if finish == "abort":
                t.num_aborts += 1
                self.counters.aborted_tokens += tokens
            finish = "stop"
        if finish == "abort" and t.remaining_tokens <= 0:
            # the abort came after the last token the budget allows: the response is truncated, and
            # a generate function must read "length" here, never an abort the plugin caused
            finish = "length"
        t.finish_reason = finish
        if finish == "stop":
            t.status = TrajectoryStatus.COMPLETED
        elif finish == "length":
            t.status = TrajectoryStatus.TRUNCATED
        else:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
            t.num_aborts += 1
            self.counters.aborted_tokens += tokens
        return None
