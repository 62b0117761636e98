"""Engine specs: hardware + model -> the emulator's per-step time model and KV capacity.

Derived from first principles (HBM bandwidth, weight and KV bytes per decode step, FLOPs per token)
with efficiency factors calibrated against public measurements (docs/bench.md lists them), or loaded
from a JSON spec that ``april-slime calibrate`` measured on a live engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from april_slime.emulator import EngineConfig, TimeModel


# ============================================================================ engine time model
@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine (``gpus_per_engine`` GPUs in tensor parallel) and the training phase.

    The emulator's linear step-cost model is derived from it (``time_model``):

    * decode step = ``step_overhead_s`` (+ ``tp_overhead_s`` when tensor parallel)
      + weight bytes / effective bandwidth                       -> ``decode_t0``
      + per running request: 2 * params FLOPs / effective FLOPs + ``per_request_overhead_s``
                                                                 -> ``decode_per_request``
      + per KV token in use: KV bytes per token / effective bandwidth -> ``decode_per_kv_token``
    * prefill (also recompute after retraction, re-prefill of a resumed partial)
      = ``prefill_overhead_s`` + weight bytes / bandwidth        -> ``prefill_t0``
      + per token: 2 * params / (FLOPs * ``prefill_flops_efficiency``) -> ``prefill_per_token``
    * KV capacity = (GPU memory * ``mem_fraction_static`` - weight bytes) / KV bytes per token,
      summed over the engine's GPUs (tensor parallel splits both weights and KV heads).

    Any derived value can be pinned directly (``decode_t0`` ... ``kv_capacity_tokens``) when it was
    measured on the target hardware; see docs/bench.md for how.
    """

    name: str
    model: str
    # ---- cluster layout
    num_engines: int
    gpus_per_engine: int
    # ---- GPU (per device)
    gpu_memory_bytes: float
    hbm_bandwidth_bytes_per_s: float
    bf16_flops: float
    # ---- model
    params: float
    weight_bytes: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    # ---- serving engine
    mem_fraction_static: float = 0.7
    max_running_requests: int = 1024
    bandwidth_efficiency: float = 0.75
    decode_flops_efficiency: float = 0.7
    prefill_flops_efficiency: float = 0.45
    step_overhead_s: float = 1.5e-3
    tp_overhead_s: float = 0.5e-3
    per_request_overhead_s: float = 5e-6
    prefill_overhead_s: float = 5e-3
    # ---- training phase (colocated: the engines are idle meanwhile)
    train_s_per_token: float = 1.2e-5
    train_fixed_s: float = 8.0
    # ---- measured values that replace the derived ones (None: derive)
    decode_t0: float | None = None
    decode_per_request: float | None = None
    decode_per_kv_token: float | None = None
    prefill_t0: float | None = None
    prefill_per_token: float | None = None
    kv_capacity_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"engine spec {f.name} must be a finite value >= 0, got {value}")
        for name in ("num_engines", "gpus_per_engine", "num_layers", "num_kv_heads", "head_dim",
                     "kv_dtype_bytes", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine spec {name} must be >= 1, got {getattr(self, name)}")
        for name in ("hbm_bandwidth_bytes_per_s", "bf16_flops", "params", "weight_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine spec {name} must be > 0")
        for name in ("mem_fraction_static", "bandwidth_efficiency", "decode_flops_efficiency",
                     "prefill_flops_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"engine spec {name} must be in (0, 1], got {getattr(self, name)}")
        if self.kv_capacity() < 2:
            raise ValueError(
                f"engine spec {self.name}: no KV capacity left: {self.gpus_per_engine} x "
                f"{self.gpu_memory_bytes / 1e9:.1f} GB x {self.mem_fraction_static} does not hold "
                f"{self.weight_bytes / 1e9:.1f} GB of weights plus a KV cache")

    # ---- derived quantities
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_capacity(self) -> int:
        if self.kv_capacity_tokens is not None:
            return int(self.kv_capacity_tokens)
        free = self.gpus_per_engine * self.gpu_memory_bytes * self.mem_fraction_static - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def time_model(self) -> TimeModel:
        bandwidth = self.gpus_per_engine * self.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency
        flops = self.gpus_per_engine * self.bf16_flops
        tp = self.tp_overhead_s if self.gpus_per_engine > 1 else 0.0
        derived = {
            "decode_t0": self.step_overhead_s + tp + self.weight_bytes / bandwidth,
            "decode_per_request": 2 * self.params / (flops * self.decode_flops_efficiency)
            + self.per_request_overhead_s,
            "decode_per_kv_token": self.kv_bytes_per_token / bandwidth,
            "prefill_t0": self.prefill_overhead_s + tp + self.weight_bytes / bandwidth,
            "prefill_per_token": 2 * self.params / (flops * self.prefill_flops_efficiency),
        }
        for key in derived:
            pinned = getattr(self, key)
            if pinned is not None:
                derived[key] = float(pinned)
        return TimeModel(**derived)

    def engine_config(self, time_scale: float = 1.0) -> EngineConfig:
        return EngineConfig(time=self.time_model(), kv_capacity_tokens=self.kv_capacity(),
                            max_running_requests=self.max_running_requests, time_scale=time_scale)

    def train_time(self, trained_tokens: int) -> float:
        return self.train_fixed_s + self.train_s_per_token * trained_tokens

    def describe(self) -> dict[str, Any]:
        tm = self.time_model()
        return {
            "preset": self.name, "model": self.model, "num_engines": self.num_engines,
            "gpus_per_engine": self.gpus_per_engine, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity(), "time_model": asdict(tm),
            "single_stream_tokens_per_s": 1.0 / tm.decode_step(1, 1000),
            "train_s_per_token": self.train_s_per_token, "train_fixed_s": self.train_fixed_s,
            "spec": asdict(self),
        }


_H100 = dict(gpu_memory_bytes=80e9, hbm_bandwidth_bytes_per_s=3.35e12, bf16_flops=989e12)

ENGINE_PRESETS: dict[str, EngineSpec] = {
    # slime's Qwen3-4B example on one 8xH100 node: colocated, TP2 engines (4 of them),
    # --sglang-mem-fraction-static 0.7. Qwen3-4B: 4.02B parameters (tied embeddings), 36 layers,
    # 8 KV heads of dim 128 -> 144 KiB of bf16 KV per token.
    "h100-qwen3-4b": EngineSpec(
        name="h100-qwen3-4b", model="Qwen3-4B", num_engines=4, gpus_per_engine=2, **_H100,
        params=4.02e9, weight_bytes=8.05e9, num_layers=36, num_kv_heads=8, head_dim=128,
        train_s_per_token=1.2e-5, train_fixed_s=8.0),
    # Qwen3-8B: 8.19B parameters (untied embeddings), 36 layers, 8 KV heads of dim 128.
    "h100-qwen3-8b": EngineSpec(
        name="h100-qwen3-8b", model="Qwen3-8B", num_engines=4, gpus_per_engine=2, **_H100,
        params=8.19e9, weight_bytes=16.4e9, num_layers=36, num_kv_heads=8, head_dim=128,
        train_s_per_token=2.4e-5, train_fixed_s=12.0),
}

