"""What one emulated engine costs and holds: the time model of its steps, and its capacity,
batching limits and clock.

Time: a decode step costs ``t0 + c_req * num_running + c_kv * kv_tokens_in_use`` emulated seconds,
a prefill ``prefill_t0 + prefill_per_request * requests + prefill_per_token * tokens`` (+ attention pairs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TimeModel:
    """Per-step costs in emulated seconds (defaults loosely: a 4B model, one H100, SGLang)."""

    decode_t0: float = 0.010  # floor of one decode step (weights read, kernel launches)
    decode_per_request: float = 4e-5  # per running request per step
    decode_per_kv_token: float = 3e-8  # per KV token in use (attention reads): 3 ms per 100k
    prefill_t0: float = 0.005  # floor of one prefill step
    prefill_per_token: float = 2e-5  # per prefilled (or recomputed) token: 50k tokens/s
    # Attention of a prefill grows with the context: a request prefilling n tokens from scratch
    # (no prefix cache survives a weight update) pays for n (n + 1) / 2 query-key pairs. This is
    # what makes re-prefilling a resumed 30K-token partial cost more than 30K x prefill_per_token.
    prefill_per_token_pair: float = 0.0
    # What each request admitted costs beyond its tokens: on a real engine its way in and out
    # (the HTTP front end, the tokenizer manager, the detokenizer, building its reply) runs in
    # processes that, on a machine whose cores the engines share (the local CPU stack), take
    # those cores from the scheduler; 0 where that work runs beside the GPU for free.
    prefill_per_request: float = 0.0
    # CUDA graphs are captured up to this batch (0: every batch); a larger decode batch runs
    # eagerly and pays ``eager_step_extra_s`` of kernel-launch overhead per step.
    graph_max_batch: float = 0.0
    eager_step_extra_s: float = 0.0
    # Roofline of the dense layers: a decode step reads the weights (part of ``decode_t0``) while
    # it computes ``decode_flops_per_request`` seconds of matmuls per request; the two overlap, so
    # the compute only adds time once it exceeds ``decode_overlap_s`` (the weight-read time).
    decode_flops_per_request: float = 0.0
    decode_overlap_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"TimeModel.{name} must be a finite value >= 0, got {value}")
        if self.decode_t0 <= 0.0 and self.decode_per_request <= 0.0:
            raise ValueError("TimeModel: a decode step must cost time (decode_t0 or decode_per_request > 0)")

    def decode_fixed(self, num_running: int) -> float:
        """The part of a decode step that does not depend on the KV in use."""
        eager = (self.eager_step_extra_s
                 if self.graph_max_batch > 0 and num_running > self.graph_max_batch else 0.0)
        compute = max(0.0, self.decode_flops_per_request * num_running - self.decode_overlap_s)
        return self.decode_t0 + eager + self.decode_per_request * num_running + compute

    def decode_step(self, num_running: int, kv_tokens: int) -> float:
        return self.decode_fixed(num_running) + self.decode_per_kv_token * kv_tokens

    def prefill_step(self, tokens: int, token_pairs: float = 0.0, requests: int = 1) -> float:
        """A prefill of ``requests`` requests, ``tokens`` tokens whose attention covers
        ``token_pairs`` query-key pairs."""
        return (self.prefill_t0 + self.prefill_per_request * requests + self.prefill_per_token * tokens
                + self.prefill_per_token_pair * token_pairs)


@dataclass(frozen=True)
class EngineConfig:
    """Capacity, batching limits and clock of one emulated engine."""

    time: TimeModel = field(default_factory=TimeModel)
    # KV budget in tokens; ~Qwen3-4B (144 KiB per token in bf16) on an 80 GB H100 at 0.8 memory fraction.
    kv_capacity_tokens: int = 350_000
    max_running_requests: int = 1024
    max_prefill_tokens: int = 16384  # tokens admitted per prefill step (one larger request still goes alone)
    admission_reserve_tokens: int = 1024  # KV kept free at admission for the running requests' growth
    # SGLang-style conservative admission: also keep free this fraction of every running request's
    # remaining budget (clipped to admission_clip_new_tokens). 0 = admit whatever fits now.
    admission_new_token_ratio: float = 0.0
    admission_clip_new_tokens: int = 4096
    # SGLang's NewTokenRatioTracker: the ratio above decays by this much per decode step down to
    # ``min_new_token_ratio`` (SGLang: 0.7 -> 0.098 over 600 steps), and after a retraction jumps
    # to (decoded + retract_decode_steps x running) / max_new_tokens of what still runs.
    # 0 = a fixed ratio.
    new_token_ratio_decay: float = 0.0
    min_new_token_ratio: float = 0.0
    retract_decode_steps: int = 20
    # Which running request a KV overflow retracts, and where it waits: "newest-front" (the most
    # recently admitted, back to the head of the queue: vLLM-like) or "sglang" (SGLang 0.5's
    # ScheduleBatch.retract_decode: fewest output tokens first, ties to the longest input, queued
    # at the back).
    retraction: str = "newest-front"
    # Seconds between an abort and its reply (the scheduler frees the request at its next step
    # and the tokenizer manager sends the reply); the engine goes on meanwhile.
    abort_latency_s: float = 0.0
    max_macro_steps: int = 32  # decode steps advanced at once when nothing happens in between
    time_scale: float = 1.0  # emulated seconds per loop second (real clock); 1 under the virtual clock
    # Real clock only. None: an engine whose loop fell behind its schedule (a starved process) runs
    # its steps back to back until it has caught up, so its clients see the lost time as a burst of
    # finished requests. A number: the engine falls at most this many emulated seconds behind and
    # counts the rest as a pause of its own, as a separate engine process on the same starved
    # machine would; tests use it so that a loaded machine does not change what the plugin sees.
    max_lag_s: float | None = None
    timeline_max_points: int = 4096

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {self.kv_capacity_tokens}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 <= self.admission_reserve_tokens < self.kv_capacity_tokens:
            raise ValueError("admission_reserve_tokens must be in [0, kv_capacity_tokens)")
        if not 0.0 <= self.admission_new_token_ratio <= 1.0:
            raise ValueError("admission_new_token_ratio must be in [0, 1]")
        if self.admission_clip_new_tokens < 0:
            raise ValueError("admission_clip_new_tokens must be >= 0")
        if not 0.0 <= self.min_new_token_ratio <= 1.0 or not self.new_token_ratio_decay >= 0.0:
            raise ValueError("min_new_token_ratio must be in [0, 1] and new_token_ratio_decay >= 0")
        if self.retract_decode_steps < 0:
            raise ValueError("retract_decode_steps must be >= 0")
        if self.retraction not in ("newest-front", "sglang"):
            raise ValueError(f"retraction must be 'newest-front' or 'sglang', got {self.retraction!r}")
        if not (self.abort_latency_s >= 0.0 and math.isfinite(self.abort_latency_s)):
            raise ValueError(f"abort_latency_s must be a finite value >= 0, got {self.abort_latency_s}")
        if self.max_macro_steps < 1:
            raise ValueError(f"max_macro_steps must be >= 1, got {self.max_macro_steps}")
        if not (self.time_scale > 0.0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_lag_s is not None and not (self.max_lag_s >= 0.0 and math.isfinite(self.max_lag_s)):
            raise ValueError(f"max_lag_s must be a finite value >= 0 or None, got {self.max_lag_s}")
        if self.timeline_max_points < 2:
            raise ValueError("timeline_max_points must be >= 2")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
