"""``april-slime bench multi-turn``: a multi-turn workload beside its single-turn twin, in one run.

What partial rollout gains on multi-turn is only readable next to what it gains on single turn,
so this module runs both from one command: the multi-turn workload (episodes, ``multiturn.py``)
and its flat twin (the same prompts, each sample one response of exactly its episode's model
tokens, no tool), each policy on a fresh cluster, either once (``run_pair``) or over the band's
variants (``run_pair_band``: the headline's three seeds plus the tool latency halved and doubled,
the input of the multi-turn model we are least sure of). It owns the comparison (each policy's
ratio to sync on both workloads, and their quotient, measured within each variant) and what the
command prints and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from .band import Variant, band_labels, headline_variants, run_variant, summarize_band
from .multiturn import plans_of
from .report import format_band, format_table, headline, plot
from .runner import BenchResult, Progress, run_benchmark, run_jobs
from .spec import EngineSpec
from .workloads import Workload

TOOL_KEYS = {"tool_median_s", "tool_sigma", "tool_workers", "tool_failure_rate", "tool_timeout_s",
             "tool_max_retries", "tool_pool_order"}  # variants that change only these leave the flat twin as is


def flat_twin(workload: Workload) -> Workload:
    """The single-turn workload of equal tokens: the same prompts and per-sample model tokens."""
    return replace(workload, flat_episodes=True)


def pair_variants(workload: Workload, spec: EngineSpec) -> list[Variant]:
    """The headline's seeds, and the tool latency's median halved and doubled (the input of the
    multi-turn model we are least sure of; the training and engine variants are the headline's)."""
    return headline_variants(workload, spec)[:3] + [
        Variant("short tools", 0, workload={"tool_median_s": workload.tool_median_s / 2}),
        Variant("long tools", 0, workload={"tool_median_s": workload.tool_median_s * 2}),
    ]


def episode_stats(workload: Workload, num_prompts: int = 64) -> dict[str, float]:
    """What the workload's episodes are, from the plans of its first ``num_prompts`` prompts."""
    plans = plans_of(workload, workload.max_response_len, num_prompts)
    turns = np.array([p.turns for p in plans], dtype=float)
    tokens = np.array([p.model_tokens for p in plans], dtype=float)
    per_turn = np.array([n for p in plans for n in p.lengths], dtype=float)
    tools = np.array([t for p in plans for t in p.tool_s], dtype=float)
    return {
        "turns_mean": float(turns.mean()), "model_tokens_mean": float(tokens.mean()),
        "model_tokens_median": float(np.median(tokens)), "model_tokens_p90": float(np.percentile(tokens, 90)),
        "model_tokens_max": float(tokens.max()), "turn_tokens_mean": float(per_turn.mean()),
        "turn_tokens_median": float(np.median(per_turn)),
        "turns_at_budget": float((per_turn >= workload.max_response_len).mean()),
        "tool_s_mean": float(tools.mean()) if tools.size else 0.0,
        "tool_s_p90": float(np.percentile(tools, 90)) if tools.size else 0.0,
        "tool_s_per_episode_mean": float(tools.sum() / len(plans)),
        "tool_failures_per_call": float(sum(p.tool_failures for p in plans) / tools.size) if tools.size else 0.0,
    }


def describe(workload: Workload, stats: dict[str, float]) -> str:
    return (f"episodes: {workload.turns_min}-{workload.turns_max} turns (uniform; mean {stats['turns_mean']:.2f}); "
            f"per turn: {workload.length} under {workload.max_response_len} tokens (mean "
            f"{stats['turn_tokens_mean']:,.0f}, median {stats['turn_tokens_median']:,.0f}, "
            f"{stats['turns_at_budget']:.1%} at the budget); per episode {stats['model_tokens_mean']:,.0f} model "
            f"tokens on average (median {stats['model_tokens_median']:,.0f}, p90 {stats['model_tokens_p90']:,.0f}); "
            f"tools: lognormal, median {workload.tool_median_s:g} s, sigma {workload.tool_sigma:g} (mean "
            f"{stats['tool_s_mean']:.2f} s, p90 {stats['tool_s_p90']:.2f} s, {stats['tool_s_per_episode_mean']:.1f} s "
            f"per episode, failed attempts included), {workload.tool_tokens} masked tokens per tool result; "
            f"{workload.tool_workers or 'unbounded'} tool workers"
            f"{' (the oldest episode served first)' if workload.tool_pool_order == 'oldest' else ''}, "
            f"{workload.tool_failure_rate:.0%} of attempts "
            f"time out at {workload.tool_timeout_s:g} s (retried up to {workload.tool_max_retries} times; "
            f"{stats['tool_failures_per_call']:.3f} failed attempts per tool call); single-turn twin: the same "
            f"prompts, each sample one response of its episode's model tokens")


# ============================================================================ one run
def run_pair(workload: Workload, spec: EngineSpec, *, mode: str = "virtual", time_scale: float = 1.0,
             progress: Progress | None = None, jobs: int = 1) -> tuple[BenchResult, BenchResult]:
    """Every policy on the multi-turn workload, then on its single-turn twin."""
    multi = run_benchmark(workload, spec, mode=mode, time_scale=time_scale, progress=progress, jobs=jobs)
    single = run_benchmark(flat_twin(workload), spec, mode=mode, time_scale=time_scale, progress=progress,
                           jobs=jobs)
    return multi, single


def compare(multi: dict[str, dict[str, Any]], single: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy: steps/h ratio to sync on each workload, and multi-turn's over single turn's."""
    out = {}
    for policy in multi:
        if policy == "sync" or "sync" not in multi or policy not in single:
            continue
        m = multi[policy]["steps_per_hour"] / multi["sync"]["steps_per_hour"]
        s = single[policy]["steps_per_hour"] / single["sync"]["steps_per_hour"]
        out[policy] = {"multi_turn": m, "single_turn": s, "gain": m / s}
    return out


# ============================================================================ the band
def run_pair_band(workload: Workload, spec: EngineSpec, variants: list[Variant], *,
                  jobs: int = 1) -> dict[str, Any]:
    """Both workloads over ``variants`` in one pool of ``jobs`` processes. The twin has no tool,
    so variants that change only the tools reuse its nominal runs instead of repeating them."""
    policies = band_labels(workload)
    twin = flat_twin(workload)
    tool_only = {v.name for v in variants if v.workload and set(v.workload) <= TOOL_KEYS}
    todo = [(workload, spec, v, p) for v in variants for p in policies]
    todo += [(twin, spec, v, p) for v in variants if v.name not in tool_only for p in policies]
    results = run_jobs(run_variant, todo, jobs)
    runs: dict[str, dict[str, dict[str, dict[str, Any]]]] = {"multi_turn": {}, "single_turn": {}}
    for k, (name, policy, summary) in enumerate(results):
        side = "multi_turn" if k < len(variants) * len(policies) else "single_turn"
        runs[side].setdefault(name, {})[policy] = summary
    for name in tool_only:
        runs["single_turn"][name] = runs["single_turn"][variants[0].name]
    out = {side: summarize_band(runs[side], variants, policies) for side in runs}
    gains = {}
    for policy in policies[1:]:
        per_variant = [compare(runs["multi_turn"][v.name], runs["single_turn"][v.name])[policy] for v in variants]
        gains[policy] = {key: {"nominal": per_variant[0][key], "min": min(x[key] for x in per_variant),
                               "max": max(x[key] for x in per_variant)} for key in per_variant[0]}
    out["comparison"] = gains
    return out


# ============================================================================ printing
def format_comparison(comparison: dict[str, Any]) -> list[str]:
    """One line per policy; with a band, each value's min-max over the variants."""
    lines = []
    for policy, c in comparison.items():
        def show(key: str, c: dict[str, Any] = c) -> str:
            v = c[key]
            if isinstance(v, dict):
                return f"{v['nominal']:.2f}x ({v['min']:.2f}-{v['max']:.2f}x)"
            return f"{v:.2f}x"
        lines.append(f"{policy} / sync, steps/h: multi-turn {show('multi_turn')}, single turn of equal tokens "
                     f"{show('single_turn')}; multi-turn gain over single turn {show('gain')}")
    return lines


def format_episodes(summaries: dict[str, dict[str, Any]]) -> str:
    """What the episodes did per step (steady state), per policy."""
    rows = [["policy", "calls/step", "episodes done/step", "suspended calls/step", "calls resumed",
             "live at step end", "tool queue s/step", "workers busy max"]]
    for label, s in summaries.items():
        if "episode_calls_per_step" in s:
            rows.append([label, f"{s['episode_calls_per_step']:.0f}", f"{s['episodes_finished_per_step']:.0f}",
                         f"{s['suspended_calls_per_step']:.0f}", f"{s['resumed_call_fraction']:.1%}",
                         f"{s['live_episodes_mean']:.0f}", f"{s.get('tool_wait_s_per_step', 0.0):,.0f}",
                         f"{s.get('tool_busy_max') or '-'}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _stationarity(band: dict[str, Any]) -> str:
    runs = [(side, name, policy, summary) for side in ("multi_turn", "single_turn")
            for name, by_policy in band[side]["runs"].items() for policy, summary in by_policy.items()]
    unsteady = [f"{side} {name} {policy}" for side, name, policy, summary in runs if not summary["stationary"]]
    warmups = [summary["warmup_steps"] for *_, summary in runs]
    head = f"steady state: warm-up {min(warmups)}-{max(warmups)} steps (MSER on the tokens held by unfinished groups)"
    if unsteady:
        more = f" and {len(unsteady) - 8} more" if len(unsteady) > 8 else ""
        return f"{head}; NOT STATIONARY ({len(unsteady)} of {len(runs)} runs): {', '.join(unsteady[:8])}{more}"
    return f"{head}; every run stationary"


def main_pair(args: argparse.Namespace, workload: Workload, spec: EngineSpec, notes: list[str],
              progress: Progress | None = None) -> int:
    """The CLI for a multi-turn workload: both workloads, the comparison, optionally the band."""
    stats = episode_stats(workload)
    if args.band:
        variants = pair_variants(workload, spec)[:args.variants or None]
        print(f"april-slime bench {workload.name} --band: {len(variants)} variants x "
              f"{len(band_labels(workload))} policy runs x 2 workloads x {workload.steps} steps in {args.jobs} "
              f"processes", file=sys.stderr, flush=True)
        band = run_pair_band(workload, spec, variants, jobs=args.jobs)
        print(describe(workload, stats))
        for side, title in (("multi_turn", "multi-turn"), ("single_turn", "single turn, equal tokens")):
            print(f"\n{title}:\n{format_band(band[side])}")
        nominal = variants[0].name
        print(f"\nmulti-turn episodes ({nominal}):\n{format_episodes(band['multi_turn']['runs'][nominal])}\n")
        for line in format_comparison(band["comparison"]):
            print(line)
        print(_stationarity(band))
        if args.json:
            _write_json(args.json, {"workload": asdict(workload), "engine": spec.describe(), "episodes": stats,
                                    "band": band})
        return 0
    multi, single = run_pair(workload, spec, mode=args.mode, time_scale=args.time_scale, progress=progress,
                             jobs=args.jobs)
    if args.quick:
        print(f"SMOKE TEST (--quick): {workload.steps} steps of {workload.samples_per_step} samples; the buffer "
              f"never reaches a steady state, so these numbers check that the path runs and are not results.")
    for note in notes:
        print(note)
    print(describe(workload, stats))
    for title, result in (("multi-turn", multi), ("single turn, equal tokens", single)):
        print(f"\n{title}:\n{format_table(result)}")
        for line in headline(result):
            print(line)
    print(f"\nmulti-turn episodes:\n{format_episodes(multi.summaries)}\n")
    comparison = compare(multi.summaries, single.summaries)
    for line in format_comparison(comparison):
        print(line)
    print(f"({multi.wall_s + single.wall_s:.1f} s wall)")
    if args.json:
        _write_json(args.json, {"multi_turn": multi.to_json(), "single_turn": single.to_json(), "episodes": stats,
                                "comparison": comparison})
    if args.plot:
        plot(multi, args.plot)
    return 0


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
