"""Online tuning of the CoPRIS concurrency N' (requests held in flight across all engines).

Why it exists: more requests in flight raise decode throughput only while every running request's
KV cache fits on the engines. Past that point SGLang retracts running requests (frees their KV and
recomputes it later) and queues new ones, so extra concurrency costs recomputation and only adds
stale, partially generated samples to the buffer (CoPRIS table 2). The right N' depends on the
model, the GPU memory and the response-length mix, which change from job to job and during a job.

The controller reads what the engines already report (``/v1/loads``) and runs an AIMD loop around
a target KV-cache utilisation (``target_kv_utilization``):

* pool at the target and either more than ``queue_tolerance`` of the running requests queued (they
  do not fit; retracted requests queue too) or a retraction burst above
  ``retraction_rate_tolerance`` (per running request per second; at the KV limit a few retractions
  are the price of a full pool) -> decrease: N' becomes what runs plus ``queue_headroom`` for a
  queue, ``decrease_factor`` x what runs for a burst (what runs at that moment is what fits now,
  and it keeps growing). Then N' is held for ``cooldown_s``: requests already admitted keep
  growing their KV for a while, and what they cause in that time is the echo of the old N', not
  news about the new one (decreasing on every echo collapses N' to its floor);
* pool below ``grow_below`` x the target, its KV share no longer rising over ``settle_s`` (young
  requests still growing into the pool would make today's KV per request an underestimate), while
  the scheduler really keeps N' requests busy (a
  value below 1 adds a hysteresis band: at a fixed N' the pool keeps filling as requests age) ->
  increase by ``gain``
  x the relative KV headroom, at least ``min_step`` and at most ``max_growth`` per observation, and
  never past what today's requests would need to fill the pool to the target. KV use lags N' (a new
  request starts with its prompt and grows for its whole life), so the increase is deliberately
  gradual: a one-shot jump to ``target / current KV`` overshoots by the factor by which young
  requests will still grow, and the partial trajectories an overshoot leaves in the buffer are
  resumed (with their large KV) for several steps;
* otherwise hold.

Retractions are only acted on while the pool is at the target: counted with the pool below it, they
happened before this picture (the scheduler polls only while a step runs, so the first poll of a step
sees the retractions of the previous one). For the same reason, observations more than
``stale_gap_factor`` polling intervals apart restart the retraction baselines. Growth is gated on
demand: when fewer than ``saturation`` * N' requests are running or waiting (the end of a step, a
slow prompt source) the measured KV use says nothing about N', and increasing it would only wind the
target up.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported for annotations only: the controller reads loads by attribute
    from april_slime.core.config import AprilConfig
    from april_slime.core.sglang_protocol import EngineLoad


@dataclass
class AdaptiveConcurrencyController:
    """Implements the scheduler's ``ConcurrencyController`` protocol (``initial`` / ``observe``)."""

    initial_concurrency: int
    min_concurrency: int = 1
    max_concurrency: int | None = None  # None: 4 * initial_concurrency
    target_kv_utilization: float = 0.90
    decrease_factor: float = 0.9
    gain: float = 0.25
    max_growth: float = 1.03  # per observation
    min_step: int = 1  # smallest increase; set to n_samples_per_prompt to add whole groups
    cooldown_s: float = 20.0  # hold after a decrease
    settle_s: float = 20.0  # grow only if the KV use did not rise over this window
    settle_tolerance: float = 0.01  # rise of the KV share that still counts as settled
    stale_gap_factor: float = 2.5  # a gap this many polling intervals long restarts the baselines
    saturation: float = 0.9
    grow_below: float = 1.0  # grow only below this share of the target (< 1: hysteresis band)
    queue_headroom: float = 0.05
    queue_tolerance: float = 0.10  # queued / running tolerated at a full pool
    # Retractions per running request per second that are tolerated: at the KV limit a few are
    # the price of a full pool (each costs one recompute, ~ a few decode steps of one engine).
    retraction_rate_tolerance: float = 0.03
    # ------------------------------------------------------------------ state (not arguments)
    _current: int = field(init=False, default=0)
    _last_retractions: dict[str, int] = field(init=False, default_factory=dict)
    _hold_until: float = field(init=False, default=-math.inf)
    _last_observed_at: float | None = field(init=False, default=None)
    _poll_interval: float | None = field(init=False, default=None)
    _kv_history: deque = field(init=False, default_factory=deque)  # (time, KV share)
    history: list[tuple[float, int, str]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.max_concurrency is None:
            self.max_concurrency = 4 * self.initial_concurrency
        if self.min_concurrency < 1:
            raise ValueError(f"min_concurrency must be >= 1, got {self.min_concurrency}")
        if self.max_concurrency < self.min_concurrency:
            raise ValueError(f"max_concurrency ({self.max_concurrency}) < min_concurrency "
                             f"({self.min_concurrency})")
        if not 0.0 < self.target_kv_utilization <= 1.0:
            raise ValueError(f"target_kv_utilization must be in (0, 1], got {self.target_kv_utilization}")
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        if not 0.0 < self.grow_below <= 1.0:
            raise ValueError(f"grow_below must be in (0, 1], got {self.grow_below}")
        if not self.gain > 0.0:
            raise ValueError(f"gain must be > 0, got {self.gain}")
        if not self.max_growth > 1.0:
            raise ValueError(f"max_growth must be > 1, got {self.max_growth}")
        if self.min_step < 1:
            raise ValueError(f"min_step must be >= 1, got {self.min_step}")
        self._current = self._clamp(self.initial_concurrency)

    @classmethod
    def from_config(cls, config: AprilConfig, rollout_batch_size: int, n_samples_per_prompt: int,
                    **overrides) -> AdaptiveConcurrencyController:
        """Start from the configured N' (default: one batch worth of samples) and its bounds."""
        initial = config.resolved_concurrency(rollout_batch_size, n_samples_per_prompt)
        kwargs = dict(
            initial_concurrency=initial,
            min_concurrency=max(config.min_concurrency, 1),
            max_concurrency=config.max_concurrency or 4 * initial,
            min_step=n_samples_per_prompt,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------------ protocol
    def initial(self) -> int:
        return self._current

    @property
    def current(self) -> int:
        return self._current

    def observe(self, loads: Sequence[EngineLoad], now: float) -> int:
        if not loads:
            return self._current
        capacity = sum(max(load.capacity_tokens, 0) for load in loads)
        used = sum(max(load.used_tokens, 0) for load in loads)
        running = sum(max(load.num_running, 0) for load in loads)
        waiting = sum(max(load.num_waiting, 0) for load in loads)
        gap = None if self._last_observed_at is None else now - self._last_observed_at
        self._last_observed_at = now
        if gap is not None and gap > 0:
            self._poll_interval = gap if self._poll_interval is None else min(self._poll_interval, gap)
        new_retractions = self._retractions_since_last(loads)
        if gap is not None and gap > self.stale_gap_factor * (self._poll_interval or gap):
            # Nobody was steering meanwhile (between rollout steps, during training): what the
            # counters did then is not a response to the current N'.
            new_retractions = 0
        if capacity <= 0:
            return self._current  # an engine that reports no KV pool tells us nothing
        kv_util = used / capacity
        in_flight = running + waiting
        self._kv_history.append((now, kv_util))
        while len(self._kv_history) > 1 and self._kv_history[1][0] <= now - self.settle_s:
            self._kv_history.popleft()
        oldest_t, oldest_kv = self._kv_history[0]
        # KV use still rising: the requests in flight are still growing into the pool, so today's
        # KV per request understates what N' requests will need.
        rising = oldest_t > now - self.settle_s or kv_util > oldest_kv + self.settle_tolerance

        # Retractions only happen with a full pool; counted while the pool is below the target,
        # they happened before this observation's picture (e.g. at the end of the previous step).
        full = kv_util >= self.target_kv_utilization
        tolerated = self.retraction_rate_tolerance * running * (gap or self._poll_interval or 0.0)
        retracting = new_retractions > tolerated and full
        # A queue at a full pool: the queued requests do not fit (retracted ones included).
        queued = waiting > self.queue_tolerance * running and full
        if retracting or queued:
            if now < self._hold_until:
                return self._current  # the echo of a decrease already made
            self._hold_until = now + self.cooldown_s
            if retracting:
                # What is running at the moment of a retraction is what fits right now; those
                # requests keep growing, so keep a margin below it.
                target = math.floor(min(self._current, running) * self.decrease_factor)
                why = f"{new_retractions} retractions at kv={kv_util:.2f}"
            else:
                target = math.ceil(running * (1.0 + self.queue_headroom))
                why = f"{waiting} queued at kv={kv_util:.2f}"
            return self._set(min(target, self._current), now, why)
        if now < self._hold_until or kv_util >= self.grow_below * self.target_kv_utilization:
            return self._current
        if in_flight < self.saturation * self._current or running == 0:
            return self._current  # N' is not the limit right now; its KV reading is not about N'
        if waiting > self.queue_tolerance * running:
            return self._current  # the pool is still taking in what is queued (re-prefill)
        if rising and self.settle_s > 0:
            return self._current
        headroom = (self.target_kv_utilization - kv_util) / self.target_kv_utilization
        growth = min(self.max_growth - 1.0, self.gain * headroom)
        target = self._current + max(self.min_step, math.floor(self._current * growth))
        # The pool holds target/now-KV times today's requests; young requests still grow, so this
        # is an upper bound on what fits, never a reason to grow faster.
        fits = math.floor(self.target_kv_utilization * capacity * running / used) if used > 0 else target
        target = min(target, fits)
        if target <= self._current:
            return self._current
        return self._set(target, now, f"kv={kv_util:.2f} < {self.target_kv_utilization:.2f}")

    # ------------------------------------------------------------------ helpers
    def _retractions_since_last(self, loads: Sequence[EngineLoad]) -> int:
        """Sum of per-engine increases of the cumulative retraction counters.

        A counter that went down means the engine restarted; its new value becomes the baseline.
        An engine seen for the first time sets its baseline and counts nothing.
        """
        total = 0
        for load in loads:
            count = max(load.retractions, 0)
            previous = self._last_retractions.get(load.url)
            if previous is not None and count > previous:
                total += count - previous
            self._last_retractions[load.url] = count
        return total

    def _clamp(self, value: int) -> int:
        return max(self.min_concurrency, min(int(value), int(self.max_concurrency)))

    def _set(self, value: int, now: float, why: str) -> int:
        value = self._clamp(value)
        if value != self._current:
            self.history.append((now, value, why))
            self._current = value
        return self._current
