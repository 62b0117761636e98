"""What one policy run measured: a record per rollout + training step, and the run as a whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The emulator's per-engine counters a run reads at every step boundary (summed over the cluster).
STAT_KEYS = ("busy_s", "generated_tokens", "decoded_tokens", "prefill_tokens", "recomputed_tokens",
             "retractions", "finished_requests", "aborted_requests")


@dataclass
class StepRecord:
    index: int
    version: int
    rollout_start: float  # emulated seconds since the cluster started
    rollout_s: float
    train_s: float
    metrics: dict[str, float]  # the scheduler's april/* metrics of the step
    tracked_tokens: int = 0  # tokens generated in the step, counted per trajectory
    context_token_sum: float = 0.0  # sum over those tokens of the context they were decoded at
    # The buffer after the step (before the weight update): response tokens it holds and their
    # token-weighted mean age in weight versions once the next version is live. Its stationarity
    # is what ends the warm-up (``steady.detect_warmup``).
    buffer_tokens: int = 0
    buffer_age_mean: float = 0.0
    buffered_logprob_s: float = 0.0  # the part of train_s spent on the buffer's partials
    train_tokens: int = 0  # prompt + response tokens of the trained batch
    # Trained response tokens that a sample generated before an abort and resumed later (APRIL
    # §3.2.3's "tokens carried over from truncated instances"); returned tokens in ``metrics``.
    carried_tokens: int = 0
    tool_wait_s: float = 0.0  # multi-turn: emulated seconds tool calls waited for a free worker


@dataclass
class PolicyRun:
    """Everything measured while one policy ran ``workload.steps`` steps on a fresh cluster."""

    label: str
    policy: str
    settings: dict[str, Any]
    steps: list[StepRecord]
    timeline: dict[str, list[float]]  # sampled loads: t, running, waiting, kv_used (cluster sums)
    capacity_tokens: int  # cluster KV capacity
    num_engines: int
    counters: list[dict[str, float]]  # emulator counter totals at the start of every step, and at the end
    warmup_steps: int  # steps left out of the summary (detected; at least workload.warmup_steps)
    concurrency_history: list[tuple[float, int, str]]
    wall_s: float
    stationary: bool = True  # False: the buffer was still filling at the end of the run

    @property
    def steady_stats(self) -> dict[str, float]:
        """Emulator counters over the steady-state steps."""
        a, b = self.counters[self.warmup_steps], self.counters[-1]
        return {k: b[k] - a[k] for k in STAT_KEYS}
