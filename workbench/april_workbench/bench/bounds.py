"""What a staleness bound did in a bench run: the lag of the trained tokens and what was thrown
away, from the scheduler's per-step metrics (``april_slime.core.step_metrics``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def staleness_summary(metrics: Sequence[dict[str, float]]) -> dict[str, Any]:
    """What a staleness bound did over the steady-state steps: the version lag of the trained
    tokens (token-weighted mean, max, histogram), the tokens the buffer's restart / drop fallback
    threw away (``stale_discarded_tokens``; pacing itself discards nothing), what pacing and
    protection did per step. Totals are over the measured steps, as ``discarded_tokens``."""
    tokens = sum(x["april/returned_tokens"] for x in metrics)
    hist: dict[int, float] = {}
    for x in metrics:
        for key, value in x.items():
            if key.startswith("april/token_staleness_hist/"):
                k = int(key.rsplit("/", 1)[1])
                hist[k] = hist.get(k, 0.0) + value
    n = len(metrics)
    samples = sum(x["april/returned_groups"] for x in metrics)  # groups; weights the per-sample mean

    def per_step(key: str) -> float:
        return sum(x.get(f"april/{key}", 0.0) for x in metrics) / n

    return {
        "token_staleness_mean": (sum(x["april/token_staleness_mean"] * x["april/returned_tokens"] for x in metrics)
                                 / tokens if tokens else 0.0),
        "token_staleness_max": int(max((x["april/token_staleness_max"] for x in metrics), default=0)),
        "token_staleness_hist": {str(k): hist[k] / tokens for k in sorted(hist)} if tokens else {},
        "stale_discarded_tokens": int(sum(x.get("april/stale_discarded_tokens", 0.0) for x in metrics)),
        "stale_fallback_groups": int(sum(x.get("april/stale_fallback_groups", 0.0) for x in metrics)),
        "pacing_deferred_per_step": per_step("pacing_deferred_groups"),
        "pacing_held_opens_per_step": per_step("pacing_held_opens"),
        "protected_groups_per_step": per_step("protected_groups"),
        "interruptions_per_sample": (sum(x.get("april/interruptions_per_sample", 0.0) * x["april/returned_groups"]
                                         for x in metrics) / samples if samples else 0.0),
    }
