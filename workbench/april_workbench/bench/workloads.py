"""What a benchmark run does (``Workload``), its prompts, and the length/ideal-throughput maths."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_slime.core.columns import token_column
from april_slime.core.types import Group, Trajectory
from april_workbench.emulator import LengthModel, SyntheticLM
from april_workbench.emulator.model import prompt_key

from .spec import EngineSpec

# ``sync-oversample``: slime's baseline under a dynamic-sampling filter (APRIL's DAPO arm):
# over-sample, abort at the target, discard the partials. ``sync-split``: veRL's synchronous
# baseline, the batch split in equal chunks per engine up front (``dispatch.py``).
POLICIES = ("sync", "april", "copris", "copris-adaptive", "sync-oversample", "sync-split")
MODES = ("virtual", "http")
MAX_TURNS = 64  # an episode's turn k draws its length with sampling seed sample_seed * MAX_TURNS + k


# ============================================================================ workloads
@dataclass(frozen=True)
class Workload:
    """What one benchmark run does. ``sweep`` picks the variable: none, context, concurrency,
    oversampling; its points are ``sweep_values``."""

    name: str
    preset: str = "h100-qwen3-4b"
    length: str = "dapo-math-qwen3-4b-16k"  # emulator length preset (with optional overrides)
    max_response_len: int = 16384
    prompt_len: int = 256
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    steps: int = 6
    # The fewest steps left out of the summary (the first starts from an empty buffer). The
    # warm-up actually used is detected per run: until the buffer's age distribution is
    # stationary (``steady.detect_warmup``) a partial-rollout policy has generated the cheap early
    # tokens of long responses and parked the expensive late ones, and looks better than it is.
    warmup_steps: int = 1
    policies: tuple[str, ...] = ("sync", "april", "copris", "copris-adaptive")
    concurrency: int | None = None  # copris N'; None: 2 x rollout_batch_size x n_samples_per_prompt
    over_sampling_factor: float = 2.0
    refill_batch: int | None = None  # copris: april_refill_batch (None: the plugin's default)
    max_staleness: int | None = None
    # Each partial-rollout policy is also run at these bounds of april_max_staleness (None:
    # unbounded), labelled ``policy@s<k>`` (``run_labels``); empty: only at ``max_staleness``.
    staleness_bounds: tuple[int | None, ...] = ()
    sweep: str = "none"
    sweep_values: tuple[float, ...] = ()
    seed: int = 0
    # DAPO's dynamic sampling: share of groups with mixed rewards (the rest are filtered out and
    # replaced); 1 = no filter (GRPO).
    filter_keep_fraction: float = 1.0
    load_poll_interval_s: float = 2.0  # emulated seconds between /v1/loads reads (controller)
    timeline_interval_s: float = 1.0  # emulated seconds between load samples for the figure
    # Multi-turn episodes (``multiturn.py``); turns_max 0: single turn, plain trajectories. An
    # episode makes turns_min..turns_max model calls (uniform); each call's tokens follow ``length``
    # under ``max_response_len`` (the per-turn budget); between two calls a tool of lognormal
    # latency runs, and its result (``tool_tokens``, masked out of training) joins the context.
    turns_min: int = 0
    turns_max: int = 0
    tool_median_s: float = 2.0  # emulated seconds
    tool_sigma: float = 1.0  # lognormal sigma: p90 = median x 3.6, p99 = median x 10 at 1.0
    tool_tokens: int = 128
    # Tools as they run: a bounded pool of tool workers shared by every episode (None: one per
    # call, no queue); a call that fails holds its worker until ``tool_timeout_s`` and is retried
    # (at most ``tool_max_retries`` times, then the error text is the result), the heavy tail.
    tool_workers: int | None = 64
    tool_failure_rate: float = 0.05
    tool_timeout_s: float = 30.0
    tool_max_retries: int = 2
    # Which waiting call a freed tool worker takes: "fifo", the first come (a plain sandbox pool),
    # or "oldest", the call of the episode launched first (a pool that orders by episode age).
    tool_pool_order: str = "fifo"
    # The equal-tokens twin of a multi-turn workload: each episode's model tokens as one response
    # of one call, no tool (the same prompts, the same tokens per sample).
    flat_episodes: bool = False

    def __post_init__(self) -> None:
        for name in ("max_response_len", "prompt_len", "rollout_batch_size", "n_samples_per_prompt",
                     "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"workload warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.prompt_len < 4:
            raise ValueError("workload prompt_len must be >= 4 (the emulator keys prompts by 4 tokens)")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
        if self.sweep not in ("none", "context", "concurrency", "oversampling"):
            raise ValueError(f"unknown sweep {self.sweep!r}")
        if not 0.0 < self.filter_keep_fraction <= 1.0:
            raise ValueError(f"workload filter_keep_fraction must be in (0, 1], got {self.filter_keep_fraction}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"workload concurrency must be >= 1, got {self.concurrency}")
        self._check_turns()
        bad = [b for b in self.staleness_bounds if b is not None and b < 0]
        if bad or len(set(self.staleness_bounds)) != len(self.staleness_bounds):
            raise ValueError(f"workload staleness_bounds must be distinct, >= 0 or none, got {self.staleness_bounds}")
        if "sync-split" in self.policies and self.turns_max:
            raise ValueError("workload: sync-split dispatches single-turn prompts; a multi-turn workload runs sync")

    def _check_turns(self) -> None:
        if self.turns_max == 0:
            if self.turns_min != 0 or self.flat_episodes:
                raise ValueError("workload turns_min / flat_episodes need turns_max >= 1 (multi-turn)")
            return
        if not 1 <= self.turns_min <= self.turns_max <= MAX_TURNS:
            raise ValueError(f"workload turns must satisfy 1 <= turns_min <= turns_max <= {MAX_TURNS}, "
                             f"got {self.turns_min}..{self.turns_max}")
        if not (self.tool_median_s > 0 and math.isfinite(self.tool_median_s)):
            raise ValueError(f"workload tool_median_s must be a finite number > 0, got {self.tool_median_s}")
        if not (self.tool_sigma >= 0 and math.isfinite(self.tool_sigma)):
            raise ValueError(f"workload tool_sigma must be a finite number >= 0, got {self.tool_sigma}")
        if self.tool_tokens < 0:
            raise ValueError(f"workload tool_tokens must be >= 0, got {self.tool_tokens}")
        if self.tool_workers is not None and self.tool_workers < 1:
            raise ValueError(f"workload tool_workers must be >= 1 or none, got {self.tool_workers}")
        if not 0.0 <= self.tool_failure_rate < 1.0:
            raise ValueError(f"workload tool_failure_rate must be in [0, 1), got {self.tool_failure_rate}")
        if not (self.tool_timeout_s > 0 and math.isfinite(self.tool_timeout_s)):
            raise ValueError(f"workload tool_timeout_s must be a finite number > 0, got {self.tool_timeout_s}")
        if self.tool_max_retries < 0:
            raise ValueError(f"workload tool_max_retries must be >= 0, got {self.tool_max_retries}")
        if self.tool_pool_order not in ("fifo", "oldest"):
            raise ValueError(f"workload tool_pool_order must be fifo or oldest, got {self.tool_pool_order!r}")

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    def copris_concurrency(self) -> int:
        # CoPRIS ran N' = 1024 for 64 x 8 = 512 samples per step: twice a batch.
        return self.concurrency or 2 * self.samples_per_step

    def length_model(self) -> LengthModel:
        return LengthModel.parse(self.length)

    def run_labels(self) -> list[tuple[str, str, int | None]]:
        """(label, policy, max_staleness) of every policy run: each partial-rollout policy at every
        bound of ``staleness_bounds`` (``copris@s2``; unbounded keeps the plain name), the sync
        policies once (they train on-policy)."""
        out = []
        for policy in self.policies:
            if policy.startswith("sync") or not self.staleness_bounds:
                out.append((policy, policy, self.max_staleness))
                continue
            out += [(bound_label(policy, b), policy, b) for b in self.staleness_bounds]
        return out


def bound_label(policy: str, bound: int | None) -> str:
    return policy if bound is None else f"{policy}@s{bound}"


def split_label(label: str) -> tuple[str, int | None]:
    """``copris@s2`` -> (copris, 2); a plain policy -> (policy, None)."""
    policy, _, bound = label.partition("@s")
    return policy, (int(bound) if bound else None)


# The bounds users set: VCPO's multi-turn runs used a lag of 2, this project's copris-vcpo launcher 4.
BOUNDS: tuple[int | None, ...] = (None, 4, 2, 1)

WORKLOADS: dict[str, Workload] = {
    # APRIL's setup (Qwen3-4B, 8 GPUs, DAPO-Math, 32 x 8, 16K, over-sampling 64): the headline.
    # 30 steps: the warm-up detector needs a second half to compare against.
    "dapo16k": Workload(name="dapo16k", steps=30, staleness_bounds=BOUNDS),
    # CoPRIS fig. 3a ran Qwen3-8B from 8K to 40K; same length law, only the budget changes, so the
    # tail (and the runaway samples that hit the budget) grows with the context.
    "context-sweep": Workload(name="context-sweep", preset="h100-qwen3-8b", length="deepscaler-qwen3-8b",
                              steps=20, warmup_steps=2,
                              policies=("sync", "april", "copris"), sweep="context",
                              sweep_values=(8192, 16384, 32768, 40960)),
    # CoPRIS table 2 analogue: fixed N' from half a batch to 8 batches, plus the controller.
    "concurrency-sweep": Workload(name="concurrency-sweep", steps=8, warmup_steps=2,
                                  policies=("copris", "copris-adaptive"), sweep="concurrency",
                                  sweep_values=(128, 256, 512, 768, 1024, 1536, 2048)),
    "oversampling-sweep": Workload(name="oversampling-sweep", steps=8, warmup_steps=2,
                                   policies=("april",),
                                   sweep="oversampling", sweep_values=(1.0, 1.5, 2.0, 3.0, 4.0)),
    # Agentic multi-turn RL (``multiturn.py``), run beside its single-turn twin of equal tokens: 2-6
    # turns per episode; per turn the DAPO-Math law (its shape, 6% of turns running to the budget)
    # with the median scaled down to 1,000 tokens under a 4K per-turn budget; tools of lognormal
    # latency (median 2 s, sigma 1) between turns, each adding 128 masked tokens to the context;
    # 64 tool workers, 5% of tool calls time out at 30 s and are retried (docs/bench.md, "Tools").
    "multi-turn": Workload(name="multi-turn", length="dapo-math-qwen3-4b-16k:median_tokens=1000",
                           max_response_len=4096, steps=30, policies=("sync", "april", "copris"),
                           turns_min=2, turns_max=6, tool_median_s=2.0, tool_sigma=1.0, tool_tokens=128,
                           staleness_bounds=BOUNDS),
}

# --quick: a smoke test of the same shapes - fewer steps, prompts and sweep points; its numbers
# are not a steady state (the output says so).
# --quick --mode http runs on the wall clock (emulated seconds / --time-scale): short responses and
# two policies, so it finishes in about two minutes at the default time scale.
QUICK_HTTP: dict[str, Any] = dict(steps=2, warmup_steps=1, rollout_batch_size=4,
                                  max_response_len=2048, policies=("sync", "copris"), staleness_bounds=())
QUICK: dict[str, dict[str, Any]] = {
    "dapo16k": dict(steps=3, warmup_steps=1, rollout_batch_size=8, staleness_bounds=(None, 2)),
    "context-sweep": dict(steps=2, warmup_steps=1, rollout_batch_size=8, sweep_values=(8192, 40960)),
    "concurrency-sweep": dict(steps=3, warmup_steps=1, rollout_batch_size=8, sweep_values=(64, 128, 256)),
    "oversampling-sweep": dict(steps=3, warmup_steps=1, rollout_batch_size=8, sweep_values=(1.0, 2.0, 4.0)),
    "multi-turn": dict(steps=3, warmup_steps=1, rollout_batch_size=8, staleness_bounds=(None, 2)),
}


# ============================================================================ prompts
class SyntheticPrompts:
    """Fresh prompt groups for the scheduler (``PromptSource``): prompt ``i`` starts with four
    tokens derived from ``i`` (the emulator's prompt key), so every prompt has its own difficulty;
    sample ``j`` of prompt ``i`` has sampling seed ``i * n + j``. Never exhausted."""

    FILLER_TOKEN = 100

    def __init__(self, prompt_len: int, n_samples_per_prompt: int, max_new_tokens: int,
                 vocab_size: int = 151936, seed: int = 0):
        self.prompt_len = prompt_len
        self.n = n_samples_per_prompt
        self.max_new_tokens = max_new_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self.issued = 0

    def prompt_ids(self, index: int) -> list[int]:
        head = [(self.seed * 1_000_003 + index * 7919 + k * 104729 + 17) % (self.vocab_size - 1)
                for k in range(4)]
        return head + [self.FILLER_TOKEN] * (self.prompt_len - 4)

    def group(self, index: int, current_version: int) -> Group:
        prompt = token_column(self.prompt_ids(index))  # one column, shared by the group
        uid = f"p{index}"
        trajectories = [
            Trajectory(uid=f"{uid}/{j}", group_uid=uid, index_in_group=j, prompt_ids=prompt,
                       max_new_tokens=self.max_new_tokens, sampling_seed=index * self.n + j)
            for j in range(self.n)
        ]
        return Group(uid=uid, prompt_ids=prompt, trajectories=trajectories,
                     created_version=current_version)

    def next_groups(self, n: int, current_version: int) -> list[Group]:
        groups = [self.group(self.issued + i, current_version) for i in range(n)]
        self.issued += n
        return groups


# ============================================================================ ideal throughput
@dataclass(frozen=True)
class LengthStats:
    mean: float
    mean_square: float
    median: float
    p90: float
    truncated_fraction: float  # samples that hit the budget

    @property
    def kv_per_slot(self) -> float:
        """Time-averaged KV tokens a running request holds beyond its prompt: over a request of
        length L the engine holds 1..L generated tokens, one step each, and a slot spends time in
        proportion to L, so the average is E[L(L+1)/2] / E[L]."""
        return (self.mean_square + self.mean) / (2.0 * self.mean)


_SCALE_CACHE: dict[tuple, np.ndarray] = {}


def _sample_scales(workload: Workload, num_prompts: int) -> np.ndarray:
    """Weibull scale of the first ``num_prompts`` prompts' samples (NaN: never stops); they do
    not depend on the budget, so one computation serves every point of a context sweep."""
    key = (workload.seed, workload.length, workload.prompt_len, workload.n_samples_per_prompt,
           num_prompts)
    if key not in _SCALE_CACHE:
        model = SyntheticLM(seed=workload.seed, length=workload.length_model())
        prompts = SyntheticPrompts(workload.prompt_len, workload.n_samples_per_prompt, 1,
                                   model.vocab_size, workload.seed)
        n = workload.n_samples_per_prompt
        keys = np.array([prompt_key(prompts.prompt_ids(i)) for i in range(num_prompts)], dtype=np.uint64)
        seeds = np.arange(num_prompts * n, dtype=np.int64).reshape(num_prompts, n)
        _SCALE_CACHE[key] = model.scales(np.repeat(keys[:, None], n, axis=1), seeds).ravel()
    return _SCALE_CACHE[key]


def sample_lengths(workload: Workload, max_response_len: int | None = None, num_prompts: int = 512,
                   seed: int = 0) -> np.ndarray:
    """One response length per sample of the first ``num_prompts`` prompts (shape prompts x
    samples per prompt), each drawn from its exact stop distribution with a fixed random stream:
    what the batch statistics that papers publish (spread across a batch, within a group) are
    computed from."""
    budget = max_response_len or workload.max_response_len
    k = workload.length_model().shape
    scales = _sample_scales(workload, num_prompts)
    draws = np.random.default_rng([seed, 0x6C656E]).exponential(size=scales.shape)
    p0 = workload.prompt_len
    with np.errstate(invalid="ignore"):
        stop_plus_one = np.ceil(scales * ((p0 / scales) ** k + draws) ** (1.0 / k))
    lengths = np.where(np.isnan(stop_plus_one), float(budget), np.clip(stop_plus_one - p0, 1, budget))
    return lengths.reshape(num_prompts, workload.n_samples_per_prompt)


def length_stats(workload: Workload, max_response_len: int | None = None,
                 num_prompts: int = 256, quantiles: int = 64) -> LengthStats:
    """Response-length moments of the workload's prompts under the emulator's length law.

    Exact per sample (the emulator's stop rule is a Weibull hazard on the absolute position, so
    the stop position has a closed-form quantile function), averaged over ``quantiles`` equally
    likely draws per sample instead of one random draw, so the estimate is smooth in the budget.
    """
    budget = max_response_len or workload.max_response_len
    k = workload.length_model().shape
    scales = _sample_scales(workload, num_prompts)[:, None]
    q = (np.arange(quantiles) + 0.5) / quantiles
    exp_draws = -np.log1p(-q)[None, :]
    p0 = workload.prompt_len
    with np.errstate(invalid="ignore"):
        stop_plus_one = np.ceil(scales * ((p0 / scales) ** k + exp_draws) ** (1.0 / k))
    arr = np.where(np.isnan(stop_plus_one), float(budget), np.clip(stop_plus_one - p0, 1, budget))
    arr = arr.ravel()
    return LengthStats(mean=float(arr.mean()), mean_square=float((arr ** 2).mean()),
                       median=float(np.median(arr)), p90=float(np.percentile(arr, 90)),
                       truncated_fraction=float((arr >= budget).mean()))


def ideal_throughput(spec: EngineSpec, workload: Workload, stats: LengthStats) -> dict[str, float]:
    """Generated tokens/s of the whole cluster if every engine were always full at its KV limit.

    Per engine: B = min(max_running_requests, capacity / (prompt + kv_per_slot)) requests run
    every step; a decode step costs t = t0 + c_req * B + c_kv * capacity and yields B tokens; each
    request also pays one prefill of its prompt, spread over its E[L] tokens. Nothing else - no
    idle engine, no retraction, no re-prefill of resumed partials - so it is an upper bound that
    no schedule can beat on this time model.
    """
    tm = spec.time_model()
    capacity = spec.kv_capacity()
    slot = workload.prompt_len + stats.kv_per_slot
    batch = min(float(spec.max_running_requests), capacity / slot)
    kv = batch * slot
    step = tm.decode_fixed(batch) + tm.decode_per_kv_token * kv
    p = workload.prompt_len
    prefill_per_token = (tm.prefill_per_token * p + tm.prefill_per_token_pair * p * (p + 1) / 2) / stats.mean
    seconds_per_token = step / batch + prefill_per_token
    per_engine = 1.0 / seconds_per_token
    return {"tokens_per_s": per_engine * spec.num_engines, "per_engine_tokens_per_s": per_engine,
            "batch_per_engine": batch, "kv_tokens_per_request": slot, "decode_step_s": step,
            "kv_limited_concurrency": batch * spec.num_engines}


def parse_bounds(text: str) -> tuple[int | None, ...]:
    """``none,4,2,1`` -> (None, 4, 2, 1); an empty list or ``-``: no bounds (the workload's
    max_staleness only)."""
    if text.strip() in ("", "-"):
        return ()
    out: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if item.lower() in ("none", "unbounded"):
            out.append(None)
            continue
        if not item.isdigit():
            raise ValueError(f"--bounds {text!r}: expected a comma-separated list of integers >= 0 or none")
        out.append(int(item))
    return tuple(out)
