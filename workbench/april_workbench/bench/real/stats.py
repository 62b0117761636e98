"""A comparison's figures from its rounds: warm-up, speed-ups with their band, and per-arm means.

* Warm-up: every arm's buffer starts empty; a partial-rollout arm's first steps generate the cheap
  early tokens of long samples and park the rest, so they look faster than the steady state. The
  rounds left out are the largest of ``minimum`` and, per arm, the truncation point of its buffer's
  token count (MSER, as the emulator bench: ``steady.detect_warmup``).
* Speed-up of an arm against the baseline arm: the baseline's total step time over the arm's,
  over the counted rounds (a step can be served from buffered groups alone in no time, so single
  rounds make no ratio). Its band is a 95% bootstrap interval, the rounds resampled in pairs (the
  arms of a round ran back to back on the same machine) and in runs of consecutive rounds (a long
  step and the short one it leaves behind stay together); ``blocks`` is the min..max of the ratio
  over consecutive blocks of rounds, the older, coarser view. Two runs of one command agree when
  their bands overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..steady import detect_warmup
from .rounds import StepRecord

BOOTSTRAP_RESAMPLES = 4000


def warmup_rounds(runs: dict[str, list[StepRecord]], minimum: int) -> tuple[int, bool]:
    """(rounds to leave out, every arm's buffer stationary after them)."""
    rounds = min(len(r) for r in runs.values())
    leave, stationary = minimum, True
    for records in runs.values():
        if not records:
            continue
        d, ok = detect_warmup(records, minimum)
        leave, stationary = max(leave, d), stationary and ok
    return min(leave, max(0, rounds - 2)), stationary


def speedup(base: Sequence[float], arm: Sequence[float], block: int = 1, seed: int = 0) -> dict[str, float]:
    """``sum(base) / sum(arm)`` and its 95% paired moving-block bootstrap interval: rounds are
    resampled in runs of ``block`` consecutive rounds, because consecutive steps of one arm are not
    independent (a step that leaves more work in the buffer is followed by a longer one)."""
    b, a = np.asarray(base, float), np.asarray(arm, float)
    ratio = float(b.sum() / a.sum()) if a.sum() > 0 else math.nan
    n = len(b)
    if n < 2:
        return {"ratio": ratio, "low": math.nan, "high": math.nan}
    block = max(1, min(block, n))
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - block + 1, size=(BOOTSTRAP_RESAMPLES, math.ceil(n / block)))
    idx = (starts[:, :, None] + np.arange(block)).reshape(BOOTSTRAP_RESAMPLES, -1)[:, :n]
    ratios = b[idx].sum(axis=1) / np.maximum(a[idx].sum(axis=1), 1e-12)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {"ratio": ratio, "low": float(low), "high": float(high)}


def block_band(base: Sequence[float], arm: Sequence[float], block: int) -> tuple[float, float]:
    ratios = [sum(base[i:i + block]) / sum(arm[i:i + block]) for i in range(0, len(base) - block + 1, block)
              if sum(arm[i:i + block]) > 0]
    return (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)


def _mean(records: Sequence[StepRecord], key: str) -> float:
    values = [r.breakdown[key] for r in records if not math.isnan(r.breakdown.get(key, math.nan))]
    return statistics.fmean(values) if values else math.nan


def summarize(runs: dict[str, list[StepRecord]], baseline: str, warmup: int, block: int = 4) -> dict[str, Any]:
    """Per arm: step time, speed-up against ``baseline`` with its band, throughput, and the mean
    per-step breakdown, over the rounds after ``warmup``."""
    counted = {label: records[warmup:] for label, records in runs.items()}
    base = [r.step_s for r in counted[baseline]]
    out: dict[str, Any] = {}
    for label, records in counted.items():
        steps = [r.step_s for r in records]
        total = sum(steps)
        entry: dict[str, Any] = {
            "steps_counted": len(records),
            "step_s": statistics.fmean(steps) if steps else math.nan,
            "speedup": speedup(base, steps, block),
            "blocks": block_band(base, steps, block) if len(steps) >= block else (math.nan, math.nan),
            "generated_tokens_per_s": sum(r.generated_tokens for r in records) / total if total else 0.0,
            "trained_tokens_per_s": sum(r.returned_tokens for r in records) / total if total else 0.0,
            "buffer_tokens_mean": statistics.fmean(r.buffer_tokens for r in records) if records else 0.0,
            "offpolicy_token_fraction": statistics.fmean(
                r.metrics.get("april/offpolicy_token_fraction", 0.0) for r in records) if records else 0.0,
        }
        for key in ("target_s", "drain_s", "in_flight", "engine_idle_s", "free_slots",
                    "transit_ms", "calls", "client_cpu_s", "engine_cpu_s"):
            entry[key] = _mean(records, key)
        out[label] = entry
    return out
