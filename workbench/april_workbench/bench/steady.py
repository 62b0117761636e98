"""A policy run's steady state: where its warm-up ends (``detect_warmup``), and the summary of the
steps after it (``summarize``) against the ideal throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .bounds import staleness_summary
from .multiturn import episode_summary
from .records import PolicyRun, StepRecord
from .spec import EngineSpec


def detect_warmup(steps: Sequence[StepRecord], minimum: int = 1) -> tuple[int, bool]:
    """Steps to leave out before the buffer's age distribution is stationary.

    MSER (White's marginal standard error rule, the usual truncation rule for simulation output):
    for each series x - the tokens the buffer holds after a step, and their mean age - the
    truncation point d minimises the standard error of the mean of what is left,
    sum_{j >= d} (x_j - mean_{>= d})^2 / (n - d)^2, searched over d <= n / 2. The warm-up is the
    larger of the two, and at least ``minimum``. Returns (warm-up, stationary): not stationary
    when a series still trends over the second half: its last two quarters differ by more than
    twice the standard error of that difference *and* by a material amount (10% of the tokens, 0.5
    versions of age), i.e. the run is too short to measure a steady state.
    """
    n = len(steps)
    if n <= minimum + 1:
        return min(minimum, max(0, n - 1)), False
    warmup = minimum
    stationary = True
    for series, tolerance in (([s.buffer_tokens for s in steps], None),
                              ([s.buffer_age_mean for s in steps], 0.5)):
        x = np.asarray(series, dtype=float)
        best: float | None = None
        best_d = minimum
        for d in range(minimum, max(minimum, n // 2) + 1):
            tail = x[d:]
            if tail.size < 2:
                break
            score = float(((tail - tail.mean()) ** 2).sum()) / tail.size ** 2
            if best is None or score < best * (1.0 - 1e-9):
                best, best_d = score, d
        warmup = max(warmup, best_d)
        half = x[n // 2:]
        if half.size < 4:
            stationary = False  # too short to tell a steady state from a trend
        else:
            a, b = half[: half.size // 2], half[half.size // 2:]
            diff = abs(b.mean() - a.mean())
            noise = 2.0 * math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
            scale = max(abs(a.mean()), abs(b.mean()))
            material = diff > tolerance if tolerance is not None else diff > 0.1 * scale
            if material and diff > noise:
                stationary = False
    return min(warmup, n - 1), stationary


def mix_ideal_throughput(spec: EngineSpec, mean_context: float) -> float:
    """Ideal cluster tokens/s for tokens decoded at ``mean_context`` on average: the pool full of
    such requests, every step (no prefill). Used to check the workload-level ideal against the mix
    of tokens a finite run actually generated (a policy can defer expensive late-position tokens
    into its buffer; over a short window that can beat the distribution-level ideal)."""
    tm = spec.time_model()
    if mean_context <= 0:
        return 0.0
    batch = min(float(spec.max_running_requests), spec.kv_capacity() / mean_context)
    step = tm.decode_fixed(batch) + tm.decode_per_kv_token * batch * mean_context
    return spec.num_engines * batch / step


def _steady(run: PolicyRun) -> list[StepRecord]:
    """The steps after the warm-up (the emulator counters are read at the same boundary)."""
    return run.steps[run.warmup_steps:]


def _time_average(times: Sequence[float], values: Sequence[float],
                  windows: Sequence[tuple[float, float]]) -> float:
    """Average of a sampled step function over the union of ``windows``."""
    if not times:
        return 0.0
    t = np.asarray(times)
    v = np.asarray(values, dtype=float)
    total = 0.0
    length = 0.0
    for a, b in windows:
        if b <= a:
            continue
        edges = np.concatenate(([a], t[(t > a) & (t < b)], [b]))
        idx = np.clip(np.searchsorted(t, edges[:-1], side="right") - 1, 0, len(t) - 1)
        total += float(np.sum(v[idx] * np.diff(edges)))
        length += b - a
    return total / length if length > 0 else 0.0


def summarize(run: PolicyRun, ideal_tokens_per_s: float, spec: EngineSpec | None = None) -> dict[str, Any]:
    steps = _steady(run)
    rollout_s = sum(s.rollout_s for s in steps)
    m = [s.metrics for s in steps]
    generated = sum(x["april/generated_tokens"] for x in m)
    returned = sum(x["april/returned_tokens"] for x in m)
    offpolicy = sum(x["april/offpolicy_token_fraction"] * x["april/returned_tokens"] for x in m)
    trajectories = sum(x["april/returned_groups"] for x in m)
    staleness_sum = sum(x["april/staleness_mean"] * x["april/returned_groups"] for x in m)
    windows = [(s.rollout_start, s.rollout_start + s.rollout_s) for s in steps]
    kv_mean = _time_average(run.timeline["t"], run.timeline["kv_used"], windows)
    running_mean = _time_average(run.timeline["t"], run.timeline["running"], windows)
    throughput = generated / rollout_s if rollout_s > 0 else 0.0
    step_s = sum(s.rollout_s + s.train_s for s in steps) / len(steps)
    stats = run.steady_stats
    discarded = sum(x["april/discarded_tokens"] + x["april/recomputed_tokens"] for x in m)
    tracked = sum(s.tracked_tokens for s in steps)
    mean_context = sum(s.context_token_sum for s in steps) / tracked if tracked else 0.0
    mix_ideal = mix_ideal_throughput(spec, mean_context) if spec is not None else 0.0
    episodes = episode_summary(m) if "april/episodes/calls" in m[0] else {}
    if episodes:
        episodes["tool_wait_s_per_step"] = sum(s.tool_wait_s for s in steps) / len(steps)
        episodes["tool_busy_max"] = run.settings.get("tool_busy_max")
    return {
        **episodes,
        **staleness_summary(m),
        "bound": run.settings.get("max_staleness"),
        "warmup_steps": run.warmup_steps,
        "stationary": run.stationary,
        "throughput_tokens_per_s": throughput,
        "utilization": throughput / ideal_tokens_per_s if ideal_tokens_per_s > 0 else 0.0,
        "offpolicy_token_fraction": offpolicy / returned if returned else 0.0,
        "carried_token_fraction": sum(s.carried_tokens for s in steps) / returned if returned else 0.0,
        "max_staleness": int(max((x["april/staleness_max"] for x in m), default=0)),
        "recomputed_tokens": int(stats["recomputed_tokens"]),
        "discarded_tokens": int(discarded),
        "mean_staleness": staleness_sum / trajectories if trajectories else 0.0,
        "steps_per_hour": 3600.0 / step_s if step_s > 0 else 0.0,
        # from the cold start, every step counted (CoPRIS fig. 3a averages its first 50 steps)
        "steps_per_hour_all": 3600.0 * len(run.steps) / sum(s.rollout_s + s.train_s for s in run.steps),
        "rollout_s_per_step": rollout_s / len(steps),
        "train_s_per_step": sum(s.train_s for s in steps) / len(steps),
        "buffered_logprob_s_per_step": sum(s.buffered_logprob_s for s in steps) / len(steps),
        "buffer_tokens_mean": sum(s.buffer_tokens for s in steps) / len(steps),
        "train_tokens_per_step": sum(s.train_tokens for s in steps) / len(steps),
        "step_s": step_s,
        "effective_throughput_tokens_per_s": returned / rollout_s if rollout_s > 0 else 0.0,
        "ideal_tokens_per_s": ideal_tokens_per_s,
        "mean_decode_context": mean_context,
        "utilization_token_mix": throughput / mix_ideal if mix_ideal > 0 else 0.0,
        "bubble_fraction": 1.0 - kv_mean / run.capacity_tokens,
        "idle_fraction": max(0.0, 1.0 - stats["busy_s"] / (run.num_engines * rollout_s))
        if rollout_s > 0 else 0.0,
        "mean_running_requests": running_mean,
        "retractions": int(stats["retractions"]),
        "prefill_tokens": int(stats["prefill_tokens"]),
        "generated_tokens": int(generated),
        "trained_tokens": int(returned),
        "concurrency": run.settings["concurrency"],
        "concurrency_final": int(m[-1]["april/concurrency_limit"]) if run.policy.startswith("copris") else None,
        "concurrency_mean": (sum(x["april/concurrency_limit"] for x in m) / len(m))
        if run.policy.startswith("copris") else None,
        "max_response_len": run.settings["max_response_len"],
        "over_sampling_factor": run.settings["over_sampling_factor"] if run.policy == "april" else None,
        "steps_measured": len(steps),
        "wall_s": run.wall_s,
    }
