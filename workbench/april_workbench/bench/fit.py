"""``april-slime bench reproduce --fit``: each length law's median and tail, and veRL's training phase.

What is fitted, and on what (nothing else is, and nothing per row):

* **veRL's training phase** (``spec.VERL_TRAINING``). CoPRIS tab. 2 splits its N' = 1024 step
  (Distill-Qwen-1.5B, 16 A800) into rollout 75.43 s, log-probs 22.15 s and the rest 25.54 s. On the
  tokens the emulated run of that point trains per step (T, prompt + response) and holds in its buffer
  (B), the log-prob forward costs 22.15 s / (T + B) per token and the rest 25.54 s / T per trained
  token; as MFUs (2 and 6 FLOPs per parameter and token) they carry over to the other veRL presets'
  GPUs and models. The training phase does not change what the engines do, so it is applied to
  each run afterwards (``step_seconds``), and the grid below needs no run per MFU.
* **each length law's median and tail** (``median_tokens``, ``prompt_sigma``; the spread within a
  group is common to all laws, ``emulator.model._GROUP_SPREAD``):
  - APRIL's laws (``dapo-math-qwen3-4b-16k``, ``deepmath-qwen3-16k``): at each candidate median the
    tail is what makes the standard deviation across a step's batch APRIL's 4,250 tokens (the middle
    of fig. 7's 4,000-4,500); the median minimises the sum of squared misses, each over its
    tolerance, of the fit row's ratio (5%), the carried-over tokens of its april run (0.40, +-0.10:
    "approximately 40%") and the within-group deviation's excess over 1,500 tokens (150);
  - CoPRIS' laws (``deepscaler-r1-distill``, ``deepscaler-qwen3-8b``): median x tail on a grid; the
    pair minimises the misses of the fit row's two published seconds per step (5% each), with the
    training phase calibrated at that candidate (r1-distill) or at the r1-distill fit (Qwen3-8B).

The median's uncertainty (``median_interval``) is the range of medians, interpolated on the grid,
at which the fit row's ratio stays within 5% of the published one: the headline band spans it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .laws import length_spec, statistics, with_fields
from .reproduce import Row, Run, april_family, fill, parse, published_statistic, rows, run_all, tab2_reference
from .spec import ENGINE_PRESETS, EngineSpec

RATIO_TOLERANCE = 0.05
STEP_TOLERANCE = 0.05
CARRIED_TOLERANCE = 0.10
GROUP_SIGMA_TOLERANCE = 150.0


@dataclass(frozen=True)
class LawFit:
    law: str
    row: str  # the fit row
    medians: tuple[float, ...]
    tails: tuple[float, ...] = ()  # prompt_sigma candidates; () = solved from APRIL's batch sigma


FITS = (
    LawFit("dapo-math-qwen3-4b-16k", "APRIL Qwen3-4B GRPO DAPO-Math: april / sync rollout tok/s per GPU",
           (6000.0, 7500.0, 9000.0, 10500.0)),
    LawFit("deepmath-qwen3-16k", "APRIL Qwen3-4B GRPO DeepMath: april / sync rollout tok/s per GPU",
           (6000.0, 7500.0, 9000.0, 10500.0)),
    LawFit("deepscaler-r1-distill", "CoPRIS tab. 1 Distill-Qwen-7B: veRL / CoPRIS training hours",
           (5000.0, 7000.0, 9500.0), (0.4, 0.65, 0.9)),
    LawFit("deepscaler-qwen3-8b", "CoPRIS tab. 1 Qwen3-8B: veRL / CoPRIS training hours",
           (6000.0, 8500.0, 11500.0), (0.4, 0.65, 0.9)),
)


def candidates(fit: LawFit) -> list[str]:
    """Every candidate law of a fit, as a law string."""
    if fit.tails:
        return [with_fields(fit.law, median_tokens=m, prompt_sigma=t) for m in fit.medians for t in fit.tails]
    return [april_family(fit.law, m) for m in fit.medians]


# ============================================================================ veRL's training phase
def verl_training(reference: dict[str, Any], spec: EngineSpec | None = None) -> dict[str, float]:
    """``train_mfu`` / ``logprob_mfu`` that give CoPRIS tab. 2's N' = 1024 training phase on the
    tokens the emulated run of that point (``reference``, a summary) trained and buffered."""
    spec = spec or ENGINE_PRESETS["a800-r1-distill-1.5b-vllm"]
    flops = spec.num_gpus * spec.bf16_flops
    trained, buffered = reference["train_tokens_per_step"], reference["buffer_tokens_mean"]
    logprob_s = published_statistic("CoPRIS tab. 2 N'=1024 log-prob seconds")["published"]
    rest_s = published_statistic("CoPRIS tab. 2 N'=1024 other training seconds")["published"]
    logprob_per_token = logprob_s / (trained + buffered)
    update_per_token = rest_s / trained
    return {"logprob_mfu": spec.logprob_flops_per_token_param * spec.params / (flops * logprob_per_token),
            "train_mfu": spec.train_flops_per_token_param * spec.params / (flops * update_per_token),
            "train_fixed_s": 0.0}


def step_seconds(summary: dict[str, Any], spec: EngineSpec) -> dict[str, Any]:
    """``summary`` with its training phase (and what derives from it) recomputed under ``spec``."""
    parts = spec.train_parts(summary["train_tokens_per_step"], summary["buffer_tokens_mean"])
    train = sum(parts.values())
    step = summary["rollout_s_per_step"] + train
    out = dict(summary, train_s_per_step=train, buffered_logprob_s_per_step=parts["buffered"], step_s=step,
               steps_per_hour=3600.0 / step)
    # steps/h from the cold start keeps its own rollout mix; only the training part changes
    scale = (summary["step_s"] / step) if summary["step_s"] > 0 else 1.0
    out["steps_per_hour_all"] = summary["steps_per_hour_all"] * scale
    return out


# ============================================================================ objective
def objective(row: Row, result: dict[str, Any], law: str) -> tuple[float, dict[str, float]]:
    """Sum of squared misses over their tolerances, and the misses."""
    misses: dict[str, float] = {}
    published_s = row.published_s
    if published_s is not None:
        for side, pub in zip(("numerator", "denominator"), published_s):
            misses[f"{side} s/step"] = (result[side]["step_s"] / pub - 1.0) / STEP_TOLERANCE
    else:
        misses["ratio"] = result["difference"] / RATIO_TOLERANCE
    if row.name.startswith("APRIL"):
        carried = published_statistic("APRIL carried-over tokens")["published"]
        misses["carried"] = (result["numerator"]["carried_token_fraction"] - carried) / CARRIED_TOLERANCE
        bound = published_statistic("APRIL group sigma GRPO")["published"]
        misses["group sigma"] = max(0.0, statistics(law)["sigma_group"] - bound) / GROUP_SIGMA_TOLERANCE
    return float(sum(m * m for m in misses.values())), misses


def median_interval(points: list[dict[str, Any]]) -> tuple[float, float]:
    """Medians at which the fit row's ratio is within RATIO_TOLERANCE of the published one,
    linearly interpolated between grid points; the best point's neighbours if none is."""
    med = np.array([p["median_tokens"] for p in points])
    diff = np.array([p["difference"] for p in points])
    order = np.argsort(med)
    med, diff = med[order], diff[order]
    fine = np.linspace(med[0], med[-1], 400)
    inside = fine[np.abs(np.interp(fine, med, diff)) <= RATIO_TOLERANCE]
    if inside.size:
        return float(inside.min()), float(inside.max())
    best = int(np.argmin(np.abs(diff)))
    return float(med[max(0, best - 1)]), float(med[min(len(med) - 1, best + 1)])


# ============================================================================ the fit
def fit(jobs: int = 1, steps_scale: float = 1.0, only: list[str] | None = None) -> dict[str, Any]:
    """Every candidate of every law in one pool of ``jobs`` processes; the best per law."""
    fits = [f for f in FITS if only is None or f.law in only]
    tables: dict[tuple[str, str], Row] = {}
    references: dict[str, Any] = {}
    for f in fits:
        for law in candidates(f):
            table = rows(steps_scale, {f.law: law})
            tables[(f.law, law)] = next(r for r in table if r.name == f.row)
            if f.law == "deepscaler-r1-distill":
                references[law] = tab2_reference(steps_scale, {f.law: law})
    # Runs that differ only in their name or their law's preset name (two laws at one candidate)
    # run once: each run is keyed by its canonical form.
    runs = [r for row in tables.values() for r in (row.numerator, row.denominator)] + list(references.values())
    done = run_all([_canonical(r) for r in runs], jobs)
    summaries = {r: done[_canonical(r)] for r in runs}
    out: dict[str, Any] = {"laws": {}, "verl_training": {}}
    training_by_law = {law: verl_training(summaries[ref]) for law, ref in references.items()}
    out["references"] = {law: summaries[ref] for law, ref in references.items()}
    for f in fits:
        points = []
        for (name, law), row in tables.items():
            if name != f.law:
                continue
            training = training_by_law.get(law) or out["verl_training"] or None
            num, den = summaries[row.numerator], summaries[row.denominator]
            if training is not None and ENGINE_PRESETS[row.numerator.preset].engine == "vllm":
                num = step_seconds(num, replace(ENGINE_PRESETS[row.numerator.preset], **training))
                den = step_seconds(den, replace(ENGINE_PRESETS[row.denominator.preset], **training))
            result = fill(row, num, den)
            score, misses = objective(row, result, law)
            model = with_fields(law)
            points.append({"law": model, "median_tokens": float(_field(model, "median_tokens")),
                           "prompt_sigma": float(_field(model, "prompt_sigma")), "score": score, "misses": misses,
                           "difference": result["difference"], "emulated": result["emulated"],
                           "published": result["published"], "statistics": statistics(law),
                           "numerator": result["numerator"], "denominator": result["denominator"],
                           "verl_training": training})
        best = min(points, key=lambda p: p["score"])
        line = [p for p in points if p["prompt_sigma"] == best["prompt_sigma"]] if f.tails else points
        out["laws"][f.law] = {"row": f.row, "best": best["law"], "grid": points,
                              "median_interval": median_interval(line)}
        if f.law == "deepscaler-r1-distill":
            out["verl_training"] = best["verl_training"]
    return out


def _canonical(run: Run) -> Run:
    w = run.workload
    return Run(run.preset, replace(w, name="fit", length=length_spec(w.length_model())))


def _field(law: str, name: str) -> float:
    from april_workbench.emulator import LengthModel

    return getattr(LengthModel.parse(law), name)


def main(argv: list[str] | None = None) -> int:
    """``april-slime bench reproduce --fit``."""
    parsed = parse(argv)
    if parsed is None:
        return 2
    args, _ = parsed
    return main_fit(args.jobs, args.steps_scale, args.laws.split(",") if args.laws else None, args.json)


def main_fit(jobs: int, steps_scale: float, only: list[str] | None, json_path: str | None) -> int:
    found = fit(jobs, steps_scale, only)
    for law, f in found["laws"].items():
        print(f"{law} on {f['row']}:")
        for p in sorted(f["grid"], key=lambda p: (p["median_tokens"], p["prompt_sigma"])):
            misses = ", ".join(f"{k} {v:+.2f}" for k, v in p["misses"].items())
            print(f"  median {p['median_tokens']:>6.0f} tail {p['prompt_sigma']:.3f}: {p['emulated']:.2f}x "
                  f"(published {p['published']:.2f}x), s/step {p['numerator']['step_s']:.0f} / "
                  f"{p['denominator']['step_s']:.0f}, score {p['score']:.2f} ({misses})")
        lo, hi = f["median_interval"]
        print(f"  best: {f['best']} (median interval {lo:.0f}-{hi:.0f})")
    if found["verl_training"]:
        t = found["verl_training"]
        print("VERL_TRAINING " + ", ".join(f"{k}={v:.4g}" for k, v in t.items()))
    print("LAWS " + " ".join(f"--law {f['best']}" for f in found["laws"].values()))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(found, fh, indent=2)
    return 0
