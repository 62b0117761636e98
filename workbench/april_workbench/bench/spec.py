"""Engine specs: hardware + model -> the emulator's per-step time model and KV capacity.

Derived from first principles (HBM bandwidth, weight and KV bytes per decode step, FLOPs per token)
with efficiency factors calibrated against public measurements (docs/bench.md lists them), or loaded
from a JSON spec that ``april-slime calibrate`` measured on a live engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from april_workbench.emulator import EngineConfig, TimeModel

# ============================================================================ engine time model
ENGINE_KINDS = ("sglang", "vllm")


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine (``gpus_per_engine`` GPUs in tensor parallel) and the training phase.

    The emulator's step-cost model is derived from it (``time_model``):

    * decode step = ``step_overhead_s`` (+ ``tp_overhead_s`` when tensor parallel)
      + weight bytes / effective bandwidth                       -> ``decode_t0``
      + per running request ``per_request_overhead_s``           -> ``decode_per_request``
      + the dense matmuls, 2 * params FLOPs per request at ``decode_flops_efficiency``, beyond the
        weight-read time they overlap with (roofline)           -> ``decode_flops_per_request``
      + per KV token in use: KV bytes per token / effective bandwidth -> ``decode_per_kv_token``
      + ``eager_step_extra_s`` when the batch exceeds the CUDA-graph limit (``cuda_graph_max_bs``;
        SGLang's default on 80 GB GPUs: 256 below TP 4, 512 from TP 4), or on every step with
        ``enforce_eager`` (veRL's vLLM rollout default in 2025)
    * prefill (also recompute after retraction, re-prefill of a resumed partial)
      = ``prefill_overhead_s`` + weight bytes / bandwidth        -> ``prefill_t0``
      + per token: 2 * params / (FLOPs * ``prefill_flops_efficiency``) -> ``prefill_per_token``
      + per query-key pair: 4 * layers * heads * head_dim FLOPs at the same efficiency
                                                                 -> ``prefill_per_token_pair``
    * KV capacity = (GPU memory * ``mem_fraction_static`` - weight bytes) / KV bytes per token,
      summed over the engine's GPUs (tensor parallel splits both weights and KV heads).
    * scheduling: ``engine="sglang"`` admits with SGLang's decaying new-token ratio and retracts
      the request with the fewest output tokens to the back of the queue; ``"vllm"`` admits what
      fits now and preempts the newest request to the front (recompute), as vLLM does.
    * training phase per step (``train_time``): ``train_fixed_s`` + ``train_s_per_token`` x trained
      tokens (prompt + response), the latter derived unless pinned: the update's
      ``train_flops_per_token_param`` x params at ``train_mfu`` plus the log-prob forward's
      ``logprob_flops_per_token_param`` x params at ``logprob_mfu``, over all GPUs of the job; and,
      where the trainer recomputes log-probs of the partials it buffers (``logprob_buffered``:
      CoPRIS' veRL trainer; slime and this plugin compute them for the trained batch only),
      ``logprob_s_per_token`` x the response tokens the buffer holds, a cost that grows with N'.

    Any derived value can be pinned directly (``decode_t0`` ... ``kv_capacity_tokens``) when it was
    measured on the target hardware (``april-slime calibrate`` writes such a spec).
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
    num_attention_heads: int = 32
    kv_dtype_bytes: int = 2
    # ---- serving engine
    engine: str = "sglang"
    mem_fraction_static: float = 0.7
    max_running_requests: int = 1024
    bandwidth_efficiency: float = 0.75
    decode_flops_efficiency: float = 0.7
    prefill_flops_efficiency: float = 0.51
    step_overhead_s: float = 1.0e-3
    tp_overhead_s: float = 0.4e-3
    per_request_overhead_s: float = 2e-6
    prefill_overhead_s: float = 5e-3
    cuda_graph_max_bs: int | None = None  # None: 256 below TP 4, else 512
    eager_step_extra_s: float = 2e-3
    enforce_eager: bool = False  # no CUDA graphs at all: every decode step pays eager_step_extra_s
    abort_latency_s: float = 0.02
    # a generate's round trip outside the engine's own time (HTTP, the engine's front end), which
    # the emulated transport adds (half each way) where a spec measured it; 0 in the derived presets
    transit_s: float = 0.0
    # ---- training phase (colocated: the engines are idle meanwhile)
    train_s_per_token: float | None = None  # pinned: update + log-probs per trained token
    train_flops_per_token_param: float = 6.0  # the update: forward + backward
    train_mfu: float = 0.35
    logprob_flops_per_token_param: float = 2.0  # one forward for the old log-probs
    logprob_mfu: float | None = None  # None: train_mfu
    logprob_s_per_token: float | None = None  # pinned: log-prob forward per token
    logprob_buffered: bool = False  # log-probs also recomputed for the buffered partials every step
    train_fixed_s: float = 8.0
    # ---- measured values that replace the derived ones (None: derive)
    decode_t0: float | None = None
    decode_per_request: float | None = None
    decode_per_kv_token: float | None = None
    prefill_t0: float | None = None
    prefill_per_token: float | None = None
    prefill_per_token_pair: float | None = None
    prefill_per_request: float | None = None  # measured only (calibrate): 0 in the derived presets

    kv_capacity_tokens: int | None = None
    source: str = ""  # where a measured spec came from (``april-slime calibrate``)
    gpu: str = ""  # the GPU's name, for the record

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or f.name in ("name", "model", "engine", "source", "gpu"):
                if f.name in ("name", "model", "engine", "source", "gpu") and not isinstance(value, str):
                    raise ValueError(f"engine spec {f.name} must be a string, got {value!r}")
                continue
            if value is None:
                continue
            if not isinstance(value, (int, float)):
                raise ValueError(f"engine spec {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"engine spec {f.name} must be a finite value >= 0, got {value}")
        for name in ("num_engines", "gpus_per_engine", "num_layers", "num_kv_heads", "head_dim",
                     "num_attention_heads", "kv_dtype_bytes", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine spec {name} must be >= 1, got {getattr(self, name)}")
        for name in ("hbm_bandwidth_bytes_per_s", "bf16_flops", "params", "weight_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine spec {name} must be > 0")
        for name in ("mem_fraction_static", "bandwidth_efficiency", "decode_flops_efficiency",
                     "prefill_flops_efficiency", "train_mfu", "logprob_mfu"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"engine spec {name} must be in (0, 1], got {getattr(self, name)}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine spec engine must be one of {ENGINE_KINDS}, got {self.engine!r}")
        if self.kv_capacity() < 2:
            raise ValueError(
                f"engine spec {self.name}: no KV capacity left: {self.gpus_per_engine} x "
                f"{self.gpu_memory_bytes / 1e9:.1f} GB x {self.mem_fraction_static} does not hold "
                f"{self.weight_bytes / 1e9:.1f} GB of weights plus a KV cache")

    # ---- derived quantities
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.gpus_per_engine

    def kv_capacity(self) -> int:
        if self.kv_capacity_tokens is not None:
            return int(self.kv_capacity_tokens)
        free = self.gpus_per_engine * self.gpu_memory_bytes * self.mem_fraction_static - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def graph_max_batch(self) -> int:
        if self.cuda_graph_max_bs is not None:
            return int(self.cuda_graph_max_bs)
        return 256 if self.gpus_per_engine < 4 else 512

    def time_model(self) -> TimeModel:
        bandwidth = self.gpus_per_engine * self.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency
        flops = self.gpus_per_engine * self.bf16_flops
        tp = self.tp_overhead_s if self.gpus_per_engine > 1 else 0.0
        weight_read = self.weight_bytes / bandwidth
        attention_flops_per_pair = 4.0 * self.num_layers * self.num_attention_heads * self.head_dim
        eager = self.eager_step_extra_s if self.enforce_eager else 0.0
        derived = {
            "decode_t0": self.step_overhead_s + tp + weight_read + eager,
            "decode_per_request": self.per_request_overhead_s,
            "decode_per_kv_token": self.kv_bytes_per_token / bandwidth,
            "prefill_t0": self.prefill_overhead_s + tp + weight_read,
            "prefill_per_token": 2 * self.params / (flops * self.prefill_flops_efficiency),
        }
        for key in derived:
            pinned = getattr(self, key)
            if pinned is not None:
                derived[key] = float(pinned)
        measured = self.decode_t0 is not None or self.decode_per_request is not None
        return TimeModel(
            **derived,
            # a measured decode cost already contains the matmuls: no roofline term on top
            decode_flops_per_request=0.0 if measured else 2 * self.params / (flops * self.decode_flops_efficiency),
            decode_overlap_s=0.0 if measured else weight_read,
            prefill_per_token_pair=(float(self.prefill_per_token_pair) if self.prefill_per_token_pair is not None
                                    else attention_flops_per_pair / (flops * self.prefill_flops_efficiency)),
            prefill_per_request=float(self.prefill_per_request or 0.0),

            graph_max_batch=float(self.graph_max_batch()),
            eager_step_extra_s=self.eager_step_extra_s,
        )

    def engine_config(self, time_scale: float = 1.0) -> EngineConfig:
        if self.engine == "sglang":
            # SGLang 0.5 defaults: SGLANG_INIT_NEW_TOKEN_RATIO 0.7, MIN_NEW_TOKEN_RATIO_FACTOR
            # 0.14, NEW_TOKEN_RATIO_DECAY_STEPS 600, RETRACT_DECODE_STEPS 20, clip 4096.
            scheduling = dict(admission_new_token_ratio=0.7, min_new_token_ratio=0.7 * 0.14,
                              new_token_ratio_decay=(0.7 - 0.7 * 0.14) / 600,
                              retract_decode_steps=20, admission_clip_new_tokens=4096,
                              retraction="sglang")
        else:
            scheduling = dict(admission_new_token_ratio=0.0, retraction="newest-front")
        return EngineConfig(time=self.time_model(), kv_capacity_tokens=self.kv_capacity(),
                            max_running_requests=self.max_running_requests, time_scale=time_scale,
                            abort_latency_s=self.abort_latency_s, **scheduling)

    def logprob_seconds_per_token(self) -> float:
        """One log-prob forward per token, over every GPU of the job."""
        if self.logprob_s_per_token is not None:
            return float(self.logprob_s_per_token)
        mfu = self.logprob_mfu if self.logprob_mfu is not None else self.train_mfu
        return self.logprob_flops_per_token_param * self.params / (self.num_gpus * self.bf16_flops * mfu)

    def train_seconds_per_token(self) -> float:
        """Update and log-prob forward per trained token."""
        if self.train_s_per_token is not None:
            return float(self.train_s_per_token)
        update = self.train_flops_per_token_param * self.params / (
            self.num_gpus * self.bf16_flops * self.train_mfu)
        return update + self.logprob_seconds_per_token()

    def train_parts(self, trained_tokens: int, buffered_tokens: int = 0) -> dict[str, float]:
        """The training phase of one step: ``fixed``, ``trained`` (update and log-probs of the
        trained batch) and ``buffered`` (log-probs of the buffer's partials, ``logprob_buffered``)."""
        return {"fixed": self.train_fixed_s, "trained": self.train_seconds_per_token() * trained_tokens,
                "buffered": (self.logprob_seconds_per_token() * buffered_tokens if self.logprob_buffered else 0.0)}

    def train_time(self, trained_tokens: int, buffered_tokens: int = 0) -> float:
        return sum(self.train_parts(trained_tokens, buffered_tokens).values())

    def describe(self) -> dict[str, Any]:
        tm = self.time_model()
        return {
            "preset": self.name, "model": self.model, "num_engines": self.num_engines,
            "gpus_per_engine": self.gpus_per_engine, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity(), "time_model": asdict(tm),
            "single_stream_tokens_per_s": 1.0 / tm.decode_step(1, 1000),
            "train_s_per_token": self.train_seconds_per_token(), "train_fixed_s": self.train_fixed_s,
            "logprob_s_per_buffered_token": self.logprob_seconds_per_token() if self.logprob_buffered else 0.0,
            "spec": asdict(self),
        }

    # ---- measured specs
    @classmethod
    def from_dict(cls, data: dict[str, Any], base: EngineSpec | None = None) -> EngineSpec:
        """A spec from JSON data: ``{"base_preset": name?, <EngineSpec fields>...}``; fields not
        given come from ``base_preset`` (or ``base``). Unknown keys are an error, not ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"engine spec must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        preset = data.pop("base_preset", None)
        data.pop("measurements", None)  # what calibrate measured, kept for the record
        if preset is not None:
            if preset not in ENGINE_PRESETS:
                raise ValueError(f"engine spec base_preset {preset!r} unknown; known: {sorted(ENGINE_PRESETS)}")
            base = ENGINE_PRESETS[preset]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"engine spec: unknown keys {unknown}")
        if base is None:
            return cls(**data)
        return replace(base, **data)

    @classmethod
    def load(cls, path: str, base: EngineSpec | None = None) -> EngineSpec:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"engine spec {path}: {exc}") from exc
        return cls.from_dict(data, base)


def _gpu(memory_gb: float, bandwidth_tb_s: float, bf16_tflops: float) -> dict[str, float]:
    return dict(gpu_memory_bytes=memory_gb * 1e9, hbm_bandwidth_bytes_per_s=bandwidth_tb_s * 1e12,
                bf16_flops=bf16_tflops * 1e12)


# Data sheets: H100 SXM / H800 SXM 80 GB, 3.35 TB/s, 989 dense BF16 TFLOP/s; A800 SXM 80 GB,
# 2.04 TB/s, 312 TFLOP/s; H20 96 GB, 4.0 TB/s, 148 TFLOP/s; MI300X 192 GB, 5.3 TB/s, 1307 TFLOP/s.
GPUS = {"H100": _gpu(80, 3.35, 989), "H800": _gpu(80, 3.35, 989), "A800": _gpu(80, 2.039, 312),
        "H20": _gpu(96, 4.0, 148), "MI300X": _gpu(192, 5.3, 1307)}

# Model shapes from each model's config.json.
MODELS = {
    # 4.02B parameters (tied embeddings), 36 layers, 32 query / 8 KV heads of 128.
    "Qwen3-4B": dict(params=4.02e9, weight_bytes=8.05e9, num_layers=36, num_kv_heads=8, head_dim=128,
                     num_attention_heads=32),
    # 8.19B parameters (untied embeddings), 36 layers, 32 query / 8 KV heads of 128.
    "Qwen3-8B": dict(params=8.19e9, weight_bytes=16.4e9, num_layers=36, num_kv_heads=8, head_dim=128,
                     num_attention_heads=32),
    # Qwen2 shapes: 1.78B (untied 151,936 x 1,536 embeddings), 28 layers, 12 query / 2 KV heads.
    "DeepSeek-R1-Distill-Qwen-1.5B": dict(params=1.78e9, weight_bytes=3.55e9, num_layers=28,
                                          num_kv_heads=2, head_dim=128, num_attention_heads=12),
    # 7.62B, 28 layers, 28 query / 4 KV heads of 128.
    "DeepSeek-R1-Distill-Qwen-7B": dict(params=7.62e9, weight_bytes=15.2e9, num_layers=28,
                                        num_kv_heads=4, head_dim=128, num_attention_heads=28),
}


# veRL's synchronous vLLM rollout in 2025 (verl/trainer/config/ppo_trainer.yaml: rollout mode
# sync, gpu_memory_utilization 0.5, enforce_eager True); its baseline dispatch is ``sync-split``.
VERL_ROLLOUT: dict[str, Any] = dict(engine="vllm", mem_fraction_static=0.5, enforce_eager=True)
# veRL's training phase per step, from CoPRIS tab. 2 (Distill-Qwen-1.5B, 16 A800, N' = 1024: Cal
# logprob 22.15 s, the rest of the step beside the rollout 25.54 s) on the tokens the emulated run
# trains and buffers at that point (``april-slime bench reproduce --fit``; docs/results/calibration/fit.json):
# an MFU for the update and one for the log-prob forward; no fixed part (the rest is per token).
VERL_TRAINING: dict[str, Any] = dict(train_mfu=0.3321, logprob_mfu=0.3623, train_fixed_s=0.0)


def _preset(name: str, gpu: str, model: str, num_engines: int, gpus_per_engine: int,
            **kw: Any) -> EngineSpec:
    return EngineSpec(name=name, model=model, num_engines=num_engines, gpu=gpu,
                      gpus_per_engine=gpus_per_engine, **GPUS[gpu], **MODELS[model], **kw)


ENGINE_PRESETS: dict[str, EngineSpec] = {p.name: p for p in (
    # slime's Qwen3-4B example on one 8 x H100 node: colocated, TP2 engines (4 of them),
    # --sglang-mem-fraction-static 0.7 (APRIL's setup). slime publishes no split of its step: the
    # training phase is the one measured split of a colocated step, veRL's (CoPRIS tab. 2), with
    # log-probs for the trained batch only (slime's, and this plugin's); the headline's band spans
    # it x0.5 to x1.5.
    _preset("h100-qwen3-4b", "H100", "Qwen3-4B", 4, 2, **VERL_TRAINING),
    _preset("h100-qwen3-8b", "H100", "Qwen3-8B", 4, 2, **VERL_TRAINING),
    # APRIL's figures are mostly from 8 x MI300X (§3.1); same layout, slime + SGLang.
    _preset("mi300x-qwen3-4b", "MI300X", "Qwen3-4B", 4, 2, **VERL_TRAINING),
    _preset("mi300x-qwen3-8b", "MI300X", "Qwen3-8B", 4, 2, **VERL_TRAINING),
    # CoPRIS (§5.1, A.2): veRL (main, August 2025) + vLLM 0.8.4, colocated FSDP. Emulated as an
    # 8-GPU slice of the 32 (16) GPU jobs with the per-GPU load kept (see bench/reproduce.py); TP2
    # for 7-8B, TP1 for 1.5B; veRL's 2025 rollout defaults (ppo_trainer.yaml): vLLM at
    # gpu_memory_utilization 0.5 with enforce_eager. Training as CoPRIS tab. 2 measured it
    # (VERL_TRAINING), with the log-probs of the buffered partials recomputed every step.
    _preset("h800-qwen3-8b-vllm", "H800", "Qwen3-8B", 4, 2, **VERL_ROLLOUT, **VERL_TRAINING, logprob_buffered=True),
    _preset("h800-r1-distill-7b-vllm", "H800", "DeepSeek-R1-Distill-Qwen-7B", 4, 2, **VERL_ROLLOUT,
            **VERL_TRAINING, logprob_buffered=True),
    _preset("a800-r1-distill-1.5b-vllm", "A800", "DeepSeek-R1-Distill-Qwen-1.5B", 8, 1, **VERL_ROLLOUT,
            **VERL_TRAINING, logprob_buffered=True),
    # The verl partial-rollout recipe: 2 x 8 H20, Qwen3-4B, vLLM in veRL's agent loop (January
    # 2026; slice of 8 GPUs, TP2); its rollout settings are not stated: veRL's memory default,
    # CUDA graphs; training as CoPRIS measured veRL's (the recipe keeps the rollout log-probs of
    # its partials, so nothing is recomputed for the buffer).
    _preset("h20-qwen3-4b-vllm", "H20", "Qwen3-4B", 4, 2, engine="vllm", mem_fraction_static=0.5,
            **VERL_TRAINING),
)}
