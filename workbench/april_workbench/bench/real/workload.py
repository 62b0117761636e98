"""What ``april-slime bench real`` runs: the workload of one comparison, and its prompts.

Every sample's length is drawn up front, by the workload alone, and the engines are asked for
exactly that many tokens (``ignore_eos``, the sample's budget = its length): every arm of a
comparison, and the emulated twin of the same comparison, generate the same samples, whatever the
model would have said and however often a sample is aborted and resumed. What differs between the
arms is only when each token is generated: the scheduling the comparison is about.

Lengths come from a law or from a job:

* the law: a sample stops after each token with probability ``eos_rate`` (geometric lengths, mean
  ``1 / eos_rate``), capped at ``max_response_len``; ``prompt_spread`` > 0 makes prompts differ in
  difficulty (each prompt's stop rate is ``eos_rate * exp(-prompt_spread * z)``, ``z`` standard
  normal), so long samples come in groups, as on a reasoning dataset;
* a job (``lengths_file``): the response lengths of a slime rollout dump
  (``--save-debug-rollout-data``'s ``.pt`` files: its samples' ``response_length``, grouped by their
  ``group_index``) or a JSONL file (one sample per line: a number, or an object with
  ``response_length`` and optionally ``group_index``; or one group per line: ``{"lengths": [...]}``).
  Groups are taken in a fixed shuffled order and cycled.

A multi-turn workload (``turns_max`` >= 1) makes every sample an agent episode of
``turns_min..turns_max`` model calls, each of a length drawn from the law under the per-turn budget,
with a tool between two calls: its latency lognormal (``tool_median_s``, ``tool_sigma``) on one of
``tool_workers`` worker processes (``tools.py``), and its result, ``tool_tokens`` tokens, joins the
context (masked out of training).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from april_slime.core.columns import token_column
from april_slime.core.types import Group, Trajectory

from ..multiturn import EpisodePlan

# Token ids the prompts and tool results use: any model takes them (the local tiny Qwen3 has a
# vocabulary of 2,048; an id past the vocabulary kills an SGLang engine).
TOKEN_ID_RANGE = (3, 2000)
_LENGTH_SALT = 0x6C656E67  # keeps the length stream apart from the prompt stream


@dataclass(frozen=True)
class RealWorkload:
    name: str
    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 8
    prompt_len: int = 32
    eos_rate: float = 1 / 64
    prompt_spread: float = 0.0
    max_response_len: int = 1024
    lengths_file: str | None = None  # a job's lengths instead of the law
    # multi-turn (turns_max 0: single turn)
    turns_min: int = 0
    turns_max: int = 0
    tool_median_s: float = 0.2
    tool_sigma: float = 1.0
    tool_workers: int = 8
    tool_tokens: int = 16
    engines: int = 2  # the local stack's engines (a --url stack has its own)
    seed: int = 0
    note: str = ""  # what the workload stands for, printed with its results
    # "tuned": the emulator's engine model was developed on this workload's real runs; "held-out":
    # it was first run with the model fixed (what a prediction is judged on)
    role: str = "held-out"

    def __post_init__(self) -> None:
        for key in ("rollout_batch_size", "n_samples_per_prompt", "prompt_len", "max_response_len",
                    "tool_workers", "engines"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload {self.name}: {key} must be >= 1, got {getattr(self, key)}")
        if not 0.0 < self.eos_rate < 1.0:
            raise ValueError(f"workload {self.name}: eos_rate must lie in (0, 1), got {self.eos_rate}")
        if not (self.prompt_spread >= 0.0 and math.isfinite(self.prompt_spread)):
            raise ValueError(f"workload {self.name}: prompt_spread must be a finite number >= 0")
        if self.turns_max and not 1 <= self.turns_min <= self.turns_max:
            raise ValueError(f"workload {self.name}: turns need 1 <= turns_min <= turns_max, "
                             f"got {self.turns_min}..{self.turns_max}")
        if not self.turns_max and self.turns_min:
            raise ValueError(f"workload {self.name}: turns_min needs turns_max >= 1")
        if self.turns_max and self.lengths_file:
            raise ValueError(f"workload {self.name}: a multi-turn workload draws its turns from the law, "
                             "not from a lengths file")
        if not (self.tool_median_s > 0 and self.tool_sigma >= 0 and self.tool_tokens >= 0):
            raise ValueError(f"workload {self.name}: tool_median_s must be > 0, tool_sigma and tool_tokens >= 0")

    @property
    def multi_turn(self) -> bool:
        return self.turns_max > 0

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    def describe(self) -> str:
        head = f"{self.rollout_batch_size} x {self.n_samples_per_prompt}"
        if self.lengths_file:
            law = f"lengths of {Path(self.lengths_file).name}"
        else:
            law = f"EOS 1/{1 / self.eos_rate:.0f}" + (f", prompt spread {self.prompt_spread:g}"
                                                      if self.prompt_spread else "")
        turns = (f", {self.turns_min}-{self.turns_max} turns, tools {self.tool_median_s:g} s median on "
                 f"{self.tool_workers} workers" if self.multi_turn else "")
        return f"{head}, budget {self.max_response_len}, {law}{turns}, {self.engines} engine(s)"


# ====================================================================== lengths
class LengthSource:
    """Every sample's length (single turn) or every turn's (multi-turn), fixed by the workload."""

    def __init__(self, workload: RealWorkload):
        self.w = workload
        self.groups: list[list[int]] | None = None
        if workload.lengths_file:
            self.groups = shuffled(read_lengths(workload.lengths_file), workload.seed)
            if not self.groups:
                raise ValueError(f"{workload.lengths_file}: no response lengths in it")

    def _prompt_rate(self, index: int) -> float:
        if not self.w.prompt_spread:
            return self.w.eos_rate
        z = np.random.default_rng([_LENGTH_SALT, self.w.seed, index]).standard_normal()
        return min(0.5, self.w.eos_rate * math.exp(-self.w.prompt_spread * z))

    def _law(self, index: int, j: int, k: int, budget: int) -> int:
        rng = np.random.default_rng([_LENGTH_SALT, self.w.seed, index, j, k])
        return int(min(budget, rng.geometric(self._prompt_rate(index))))

    def sample(self, index: int, j: int) -> int:
        """The response length of sample ``j`` of prompt ``index`` (single turn)."""
        if self.groups is None:
            return self._law(index, j, 0, self.w.max_response_len)
        group = self.groups[index % len(self.groups)]
        return max(1, min(self.w.max_response_len, group[j % len(group)]))

    def episode(self, index: int, j: int) -> EpisodePlan:
        """The plan of sample ``j`` of prompt ``index`` as an episode: its turns' lengths and the
        tool latency (seconds) of each tool phase."""
        rng = np.random.default_rng([_LENGTH_SALT, self.w.seed, index, j, 1 << 20])
        turns = int(rng.integers(self.w.turns_min, self.w.turns_max + 1))
        lengths = tuple(self._law(index, j, k, self.w.max_response_len) for k in range(turns))
        tools = tuple((float(self.w.tool_median_s * math.exp(self.w.tool_sigma * z)),)
                      for z in rng.standard_normal(turns - 1))
        return EpisodePlan(lengths, tools)

    def stats(self, prompts: int = 512) -> dict[str, float]:
        """Mean, median, p90, max and the share at the budget, over the first ``prompts`` prompts
        (multi-turn: the model tokens of whole episodes)."""
        n = self.w.n_samples_per_prompt
        if self.w.multi_turn:
            x = np.array([self.episode(i, j).model_tokens for i in range(prompts) for j in range(n)], float)
            capped = 0.0
        else:
            x = np.array([self.sample(i, j) for i in range(prompts) for j in range(n)], float)
            capped = float(np.mean(x >= self.w.max_response_len))
        group_max = x.reshape(prompts, n).max(axis=1)
        return {"mean": float(x.mean()), "median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
                "max": float(x.max()), "at_budget": capped,
                # what a synchronous step waits for: the longest sample of a batch of groups
                "batch_max_mean": float(np.mean([group_max[i:i + self.w.rollout_batch_size].max()
                                                 for i in range(0, prompts, self.w.rollout_batch_size)]))}


def shuffled(groups: list[list[int]], seed: int) -> list[list[int]]:
    order = np.random.default_rng([_LENGTH_SALT, seed]).permutation(len(groups))
    return [groups[i] for i in order]


def read_lengths(path: str | Path) -> list[list[int]]:
    """Groups of response lengths from a slime rollout dump (``.pt``) or a JSONL file (module doc)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths file {path} does not exist")
    if path.suffix == ".pt":
        return _dump_lengths(path)
    groups: dict[object, list[int]] = {}
    singles: list[int] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(item, dict) and "lengths" in item:
                groups[("line", number)] = [_length(v, path, number) for v in item["lengths"]]
            elif isinstance(item, dict) and "response_length" in item:
                key = item.get("group_index", item.get("group"))
                length = _length(item["response_length"], path, number)
                if key is None:
                    singles.append(length)
                else:
                    groups.setdefault(("group", key), []).append(length)
            else:
                singles.append(_length(item, path, number))
    return [g for g in groups.values() if g] + [[x] for x in singles]


def _length(value: object, path: Path, number: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 1 \
            or not float(value).is_integer():
        raise ValueError(f"{path}:{number}: a response length must be an integer >= 1, got {value!r}")
    return int(value)


def _dump_lengths(path: Path) -> list[list[int]]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path}: reading a slime rollout dump needs torch (pip install torch==2.13.0)") from None
    data = torch.load(path, weights_only=False)
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list):
        raise ValueError(f"{path}: not a slime rollout dump (no 'samples' list)")
    groups: dict[object, list[int]] = {}
    for k, s in enumerate(samples):
        if not isinstance(s, dict) or "response_length" not in s:
            raise ValueError(f"{path}: sample {k} has no response_length")
        key = s.get("group_index")
        groups.setdefault(k if key is None else key, []).append(_length(s["response_length"], path, k))
    return list(groups.values())


# ====================================================================== prompts
def prompt_ids(workload: RealWorkload, index: int) -> list[int]:
    rng = np.random.default_rng([workload.seed, index])
    return [int(x) for x in rng.integers(*TOKEN_ID_RANGE, workload.prompt_len)]


def tool_ids(n: int) -> list[int]:
    """The tokens a tool result adds to an episode's context."""
    low, high = TOKEN_ID_RANGE
    return [low + (37 * k) % (high - low) for k in range(n)]


class FixedLengthPrompts:
    """Fresh prompt groups for the scheduler (``PromptSource``); every sample's budget is its drawn
    length, or its episode's planned tokens (``plans``, by member uid). Never exhausted."""

    def __init__(self, workload: RealWorkload):
        self.w = workload
        self.lengths = LengthSource(workload)
        self.plans: dict[str, EpisodePlan] = {}
        self.issued = 0

    def group(self, index: int, current_version: int) -> Group:
        prompt = token_column(prompt_ids(self.w, index))  # one column, shared by the group
        uid = f"p{index}"
        trajectories = []
        for j in range(self.w.n_samples_per_prompt):
            t = Trajectory(uid=f"{uid}/{j}", group_uid=uid, index_in_group=j, prompt_ids=prompt,
                           max_new_tokens=1, sampling_seed=index * self.w.n_samples_per_prompt + j)
            if self.w.multi_turn:
                plan = self.plans[t.uid] = self.lengths.episode(index, j)
                t.max_new_tokens = plan.model_tokens + self.w.tool_tokens * (plan.turns - 1)
            else:
                t.max_new_tokens = self.lengths.sample(index, j)
            trajectories.append(t)
        return Group(uid=uid, prompt_ids=prompt, trajectories=trajectories, created_version=current_version)

    def next_groups(self, n: int, current_version: int) -> list[Group]:
        groups = [self.group(self.issued + i, current_version) for i in range(n)]
        self.issued += n
        return groups


# ====================================================================== the sweep
# The CPU stack's workloads (2 SGLang CPU engines of 64 running requests each unless said): big
# enough that a step is seconds of engine work, not fixed costs; small enough for a sweep in
# under an hour on 2 cores.
WORKLOADS: dict[str, RealWorkload] = {w.name: w for w in (
    RealWorkload("short", rollout_batch_size=8, n_samples_per_prompt=8, eos_rate=1 / 48, max_response_len=512,
                 note="short steps: 64 samples of mean 48 tokens", role="tuned"),
    RealWorkload("longtail", rollout_batch_size=16, n_samples_per_prompt=8, eos_rate=1 / 64, prompt_spread=0.5,
                 max_response_len=2048, role="tuned",
                 note="the long tail: 128 samples, hard prompts' groups run several times the mean"),
    RealWorkload("long", rollout_batch_size=32, n_samples_per_prompt=8, eos_rate=1 / 96, max_response_len=1024,
                 note="long steps: 256 samples, twice what the engines run at once"),
    RealWorkload("one-engine", rollout_batch_size=8, n_samples_per_prompt=8, eos_rate=1 / 64, prompt_spread=0.5,
                 max_response_len=2048, engines=1, note="the long tail on one engine"),
    RealWorkload("multi-turn", rollout_batch_size=8, n_samples_per_prompt=4, eos_rate=1 / 32,
                 max_response_len=256, turns_min=2, turns_max=4, tool_median_s=0.15, tool_sigma=1.0,
                 tool_workers=8, tool_tokens=16,
                 note="agent episodes: 2-4 calls, tools on 8 worker processes (lognormal, median 0.15 s)"),
)}
SWEEP = ("short", "longtail", "long", "one-engine", "multi-turn")
QUICK = RealWorkload("quick", rollout_batch_size=4, n_samples_per_prompt=4, eos_rate=1 / 24, max_response_len=128,
                     note="smoke test: the path runs; no steady state")


def job_workload(path: str) -> RealWorkload:
    """A comparison shaped like the job the lengths come from: a slime dump holds one rollout step,
    so its groups are the job's rollout_batch_size (at most 512 from any file) and their most common
    size its n_samples_per_prompt."""
    groups = read_lengths(path)
    sizes = [len(g) for g in groups]
    n = max(set(sizes), key=sizes.count)
    return with_lengths(RealWorkload("job", rollout_batch_size=min(len(groups), 512), n_samples_per_prompt=n),
                        path)


def with_lengths(workload: RealWorkload, path: str, max_response_len: int | None = None) -> RealWorkload:
    """``workload`` with a job's lengths (its budget: ``max_response_len``, else the file's longest)."""
    longest = max(max(g) for g in read_lengths(path))
    return replace(workload, lengths_file=str(path), max_response_len=max_response_len or longest,
                   name=f"{workload.name}:{Path(path).stem}")


