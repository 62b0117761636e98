"""What a rollout step measures: its counters, its in-flight timeline, and the metric dict of
``StepResult.metrics`` built from them at the end of a successful step.

Every metric is a float and every key is prefixed with ``april_slime.core.keys.METRIC_PREFIX``
(``april/``):

step_time_s, time_to_target_s (loop time until the target was met, before the abort drain),
generated_tokens (every token that came back this step, aborted partials included),
throughput_tokens_per_s (generated_tokens / step_time_s), aborted_tokens, engine_calls,
engine_errors, abort_calls, abort_errors, load_poll_errors, truncated_without_call,
stop_token_finishes (replies finished by their last token although the engine said abort or
length), resumed_groups (buffered groups opened), resumed_trajectories (submitted with a partial
response), filtered_groups, surplus_groups, surplus_discarded_groups, stale_restarted_groups,
stale_dropped_groups, recomputed_tokens (thrown away by staleness restarts), discarded_tokens
(filter rejections + discarded surplus + staleness drops + groups rejected by the engines),
rejected_calls, rejected_groups, drain_cancelled_calls (pending at the drain deadline),
stalled_engines, probe_failures, engines_excluded (out of dispatch at the end of the step),
carried_groups (unfinished groups put back), buffer_groups, buffer_trajectories,
buffer_partial_trajectories (unfinished with tokens), concurrency_limit (copris N' at the end; 0
otherwise), inflight_mean (time-weighted over the step), inflight_max, inflight_min_while_work,
returned_groups, returned_tokens, offpolicy_token_fraction (returned tokens whose version !=
current_version), staleness_mean, staleness_max, staleness_hist/<k> (returned trajectories whose
oldest token lags k versions), token_staleness_mean, token_staleness_max, token_staleness_hist/<k>
(returned tokens generated k versions ago).

Engine faults: engine_fault_lost_calls (calls whose output an engine fault lost: the engine died,
stalled, failed the call after the client's retries, sent an unusable reply, or left the abort
unanswered at the drain deadline), engine_fault_lost_call_s (the seconds the engines held those
calls: each from its send to its failure, the client's retry backoff left out), and the tokens
those calls had generated, which a non-streaming reply shows only when it arrives, so they are
known in two ways: engine_fault_lost_tokens_max (at most this: what the calls had been asked to
generate, or what an unusable reply held) and engine_fault_lost_tokens_est (an estimate: each
lost call's seconds times the step's tokens per call-second over its answered calls, at most its
budget; an unusable reply's tokens exactly; 0 when no call of the step was answered).

Staleness pacing and protection (``april_slime.core.pacing``): stale_fallback_groups and
stale_discarded_tokens (what the buffer's restart / drop fallback threw away this step; 0 when
pacing kept the bound), pacing_deferred_groups (passing groups held back until tighter ones fit),
pacing_held_opens (times a group was not opened because it could not be trained in time),
pacing_forced_accepts (deferred groups accepted with nothing else left to run), protected_groups,
suspended_groups (unfinished groups carried over at the target), interruptions_per_sample (mean
aborted calls of the returned trajectories), interruptions_max. The step deadline
(``april_slime.core.deadline``): deadline_failed_samples (samples of due groups unfinished when it
passed: masked, re-run or dropped), deadline_released_groups (due groups it let go unfinished, back
to the buffer past their bound).

The timeline (``RolloutScheduler.last_timeline``) has one ``TimelinePoint`` per instant at which
the step settled; ``in_flight`` counts model calls, whatever kind of work item made them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from april_slime.core.buffer import PartialBuffer
from april_slime.core.keys import METRIC_PREFIX
from april_slime.core.types import Group


@dataclass(frozen=True)
class LostCall:
    """A call whose output an engine fault lost: the seconds the engine held it, the tokens it had
    been asked for, and the tokens its reply held when the reply came but could not be used
    (None: no reply was seen)."""

    engine_s: float
    asked: int
    seen: int | None = None

    def tokens_est(self, tokens_per_call_s: float) -> float:
        if self.seen is not None:
            return float(self.seen)
        return min(float(self.asked), self.engine_s * tokens_per_call_s)


@dataclass
class StepCounters:
    engine_calls: int = 0
    engine_errors: int = 0
    abort_calls: int = 0
    abort_errors: int = 0
    generated_tokens: int = 0
    aborted_tokens: int = 0
    truncated_without_call: int = 0
    stop_token_finishes: int = 0
    resumed_groups: int = 0
    filtered_groups: int = 0
    filtered_tokens: int = 0
    surplus_groups: int = 0
    surplus_discarded_groups: int = 0
    surplus_discarded_tokens: int = 0
    rejected_calls: int = 0
    rejected_groups: int = 0
    rejected_tokens: int = 0
    episode_failed_groups: int = 0
    episode_failed_tokens: int = 0
    drain_cancelled_calls: int = 0
    stalled_engines: int = 0
    probe_failures: int = 0
    load_poll_errors: int = 0
    suspended_groups: int = 0  # unfinished groups carried to the next step at the target
    pacing_held_opens: int = 0  # times the staleness pacing refused to open a group
    pacing_forced_accepts: int = 0  # deferred groups accepted although they did not fit
    deadline_failed_samples: int = 0  # unfinished in a due group at the step deadline (core.deadline)
    deadline_released_groups: int = 0  # due groups the deadline let go, unfinished, to the buffer
    answered_call_s: float = 0.0  # seconds the calls whose replies were absorbed ran, for the rate
    lost_to_faults: list[LostCall] = field(default_factory=list)
    resumed_uids: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class TimelinePoint:
    """The scheduler's state after it settled (handled every ready reply and refilled)."""

    time: float  # seconds since the step started (loop time)
    in_flight: int
    limit: int | None  # copris: N' at that moment; None for sync / april
    work_remaining: bool  # the target is not reached and there is something left to submit


def record(timeline: list[TimelinePoint], point: TimelinePoint) -> None:
    if timeline and timeline[-1].time == point.time:
        timeline[-1] = point  # only the settled state of an instant matters
    else:
        timeline.append(point)


def group_tokens(group: Group) -> int:
    return sum(t.response_length for t in group.trajectories)


def step_metrics(*, clock: Callable[[], float], t0: float, t_target: float | None, counters: StepCounters,
                 stale_delta: dict[str, int], engines_excluded: int, carried_groups: int,
                 buffer: PartialBuffer, concurrency_limit: int | None, timeline: list[TimelinePoint],
                 returned: list[Group], current_version: int, protected_groups: int = 0,
                 deferred_groups: int = 0,
                 episodes: dict[str, float] | None = None) -> dict[str, float]:
    """The step's metrics, named with the metric prefix; ``episodes``: what the job's episodes did
    during the step (``core.episodes.EpisodeCounters`` differences), for agent-function jobs."""
    c = counters
    step_time = clock() - t0
    m: dict[str, float] = {
        "step_time_s": step_time,
        "time_to_target_s": t_target,
        "generated_tokens": c.generated_tokens,
        "throughput_tokens_per_s": c.generated_tokens / step_time if step_time > 0 else 0.0,
        "aborted_tokens": c.aborted_tokens,
        "engine_calls": c.engine_calls,
        "engine_errors": c.engine_errors,
        "abort_calls": c.abort_calls,
        "abort_errors": c.abort_errors,
        "load_poll_errors": c.load_poll_errors,
        "truncated_without_call": c.truncated_without_call,
        "stop_token_finishes": c.stop_token_finishes,
        "resumed_groups": c.resumed_groups,
        "resumed_trajectories": len(c.resumed_uids),
        "filtered_groups": c.filtered_groups,
        "surplus_groups": c.surplus_groups,
        "surplus_discarded_groups": c.surplus_discarded_groups,
        "stale_restarted_groups": stale_delta["restarted_groups"],
        "stale_dropped_groups": stale_delta["dropped_groups"],
        "recomputed_tokens": stale_delta["restarted_tokens"],
        "discarded_tokens": c.filtered_tokens + c.surplus_discarded_tokens + c.rejected_tokens
        + c.episode_failed_tokens + stale_delta["dropped_tokens"],
        "rejected_calls": c.rejected_calls,
        "rejected_groups": c.rejected_groups,
        "drain_cancelled_calls": c.drain_cancelled_calls,
        "stalled_engines": c.stalled_engines,
        "probe_failures": c.probe_failures,
        "engines_excluded": engines_excluded,
        "carried_groups": carried_groups,
        "buffer_groups": len(buffer),
        "buffer_trajectories": buffer.num_trajectories(),
        "buffer_partial_trajectories": buffer.num_partial_trajectories(),
        "concurrency_limit": 0 if concurrency_limit is None else concurrency_limit,
        "stale_fallback_groups": stale_delta["restarted_groups"] + stale_delta["dropped_groups"],
        "stale_discarded_tokens": stale_delta["restarted_tokens"] + stale_delta["dropped_tokens"],
        "pacing_deferred_groups": deferred_groups,
        "pacing_held_opens": c.pacing_held_opens,
        "pacing_forced_accepts": c.pacing_forced_accepts,
        "protected_groups": protected_groups,
        "suspended_groups": c.suspended_groups,
        "deadline_failed_samples": c.deadline_failed_samples,
        "deadline_released_groups": c.deadline_released_groups,
        **engine_fault_losses(c),
    }
    if episodes is not None:
        m.update({f"episodes/{k}": v for k, v in episodes.items()})
        m["episodes/failed_groups"] = c.episode_failed_groups
    m.update(_in_flight_stats(timeline, clock() - t0))
    trajectories = [t for g in returned for t in g.trajectories]
    tokens = sum(t.response_length for t in trajectories)
    m["returned_groups"] = len(returned)
    m["returned_tokens"] = tokens
    m["offpolicy_token_fraction"] = (
        sum(t.offpolicy_tokens(current_version) for t in trajectories) / tokens if tokens else 0.0)
    staleness = [t.staleness(current_version) for t in trajectories]
    m["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
    m["staleness_max"] = max(staleness, default=0)
    for k in sorted(set(staleness)):
        m[f"staleness_hist/{k}"] = staleness.count(k)
    m["interruptions_per_sample"] = (sum(t.num_aborts for t in trajectories) / len(trajectories)
                                     if trajectories else 0.0)
    m["interruptions_max"] = max((t.num_aborts for t in trajectories), default=0)
    m.update(token_staleness(trajectories, current_version))
    return {METRIC_PREFIX + k: float(v) for k, v in m.items()}


def engine_fault_losses(c: StepCounters) -> dict[str, float]:
    """What engine faults cost the step in calls, engine seconds and tokens (module docstring)."""
    rate = c.generated_tokens / c.answered_call_s if c.answered_call_s > 0 else 0.0
    lost = c.lost_to_faults
    return {"engine_fault_lost_calls": len(lost),
            "engine_fault_lost_call_s": sum(x.engine_s for x in lost),
            "engine_fault_lost_tokens_max": sum(x.asked if x.seen is None else x.seen for x in lost),
            "engine_fault_lost_tokens_est": sum(x.tokens_est(rate) for x in lost)}


def token_staleness(trajectories, current_version: int) -> dict[str, float]:
    """Mean, max and histogram of the version lag of every token of ``trajectories``."""
    hist: dict[int, int] = {}
    for t in trajectories:
        for version, count in t.version_runs:
            lag = current_version - version
            hist[lag] = hist.get(lag, 0) + count
    total = sum(hist.values())
    out = {"token_staleness_mean": sum(k * n for k, n in hist.items()) / total if total else 0.0,
           "token_staleness_max": max(hist, default=0)}
    out.update({f"token_staleness_hist/{k}": n for k, n in sorted(hist.items())})
    return out


def _in_flight_stats(points: list[TimelinePoint], end: float) -> dict[str, float]:
    weighted = 0.0
    for p, nxt in zip(points, points[1:] + [None]):
        weighted += p.in_flight * ((nxt.time if nxt else end) - p.time)
    working = [p.in_flight for p in points if p.work_remaining]
    return {
        "inflight_mean": weighted / end if end > 0 else (points[-1].in_flight if points else 0),
        "inflight_max": max((p.in_flight for p in points), default=0),
        "inflight_min_while_work": min(working, default=0),
    }
