"""``april-slime bench reproduce``: every published figure we can set up, published vs emulated.

One model, one parameter set per hardware/model preset (``spec.ENGINE_PRESETS``) and one length law
per dataset/model (``emulator.model.LENGTH_PRESETS``); nothing here is tuned per row. What each
row sets up is the paper's own configuration (model, GPUs, batch, budget, N', over-sampling,
baseline), scaled to an 8-GPU slice where the paper used more GPUs: prompts per step and N' are
divided by the same factor, so every engine sees the load it saw in the paper (engines do not talk
to each other; only the law of large numbers on the batch's longest response changes, and it
changes towards a *smaller* sync penalty, see docs/bench.md).

Rows marked ``fit`` are the figures the length laws' ``median_tokens`` were chosen on; every other
row is held out. The published numbers and their sources are data (``data/published.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from .runner import run_benchmark, run_jobs
from .spec import ENGINE_PRESETS
from .workloads import Workload


@dataclass(frozen=True)
class Run:
    """One policy run of one setup (shared by every row that needs it)."""

    preset: str
    workload: Workload  # with policies = (policy,)

    @property
    def policy(self) -> str:
        return self.workload.policies[0]


@dataclass(frozen=True)
class Row:
    name: str
    published: float
    source: str
    role: str  # "fit" or "held-out"
    numerator: Run
    denominator: Run
    metric: str  # summary key; emulated = metric(numerator) / metric(denominator)
    note: str = ""


def _w(name: str, **kw: Any) -> Workload:
    base = dict(name=name, prompt_len=256, n_samples_per_prompt=8, warmup_steps=2, sweep="none",
                timeline_interval_s=10.0, load_poll_interval_s=2.0)
    base.update(kw)
    return Workload(**base)


def _run(preset: str, workload: Workload, policy: str, **kw: Any) -> Run:
    return Run(preset, replace(workload, policies=(policy,), **kw))


def _published() -> dict[str, dict[str, Any]]:
    text = resources.files("april_slime.workbench.bench").joinpath("data/published.json").read_text("utf-8")
    return {r["name"]: r for r in json.loads(text)["rows"]}


def rows(steps_scale: float = 1.0, median_overrides: dict[str, float] | None = None) -> list[Row]:
    """Every row; ``steps_scale`` shortens the runs (tests), ``median_overrides`` replaces a
    length law's median (the fit)."""
    pub = _published()
    med = median_overrides or {}

    def steps(n: int) -> int:
        return max(4, int(round(n * steps_scale)))

    def length(preset: str) -> str:
        return f"{preset}:median_tokens={med[preset]}" if preset in med else preset

    out: list[Row] = []

    def row(name: str, num: Run, den: Run, metric: str, note: str = "") -> None:
        p = pub[name]
        out.append(Row(name, float(p["published"]), p["source"], p["role"], num, den, metric, note))

    # ---- APRIL §3.2.1 / fig. 4: slime + SGLang, 8 x MI300X, Qwen3-4B/8B, DAPO-Math-17k,
    # 32 x 8, 16K, over_sampling_batch_size 64; rollout throughput (tokens / rollout time).
    dapo = length("dapo-math-qwen3-4b-16k")
    for size in ("4b", "8b"):
        preset = f"mi300x-qwen3-{size}"
        w = _w(f"april-{size}", length=dapo, max_response_len=16384, rollout_batch_size=32,
               steps=steps(16), over_sampling_factor=2.0)
        row(f"APRIL Qwen3-{size.upper()} GRPO DAPO-Math: april / sync rollout tok/s",
            _run(preset, w, "april"), _run(preset, w, "sync"), "throughput_tokens_per_s")
        # DAPO arm: dynamic sampling in both arms (half the groups have mixed rewards), so the
        # baseline already over-samples and aborts; it discards its partials, APRIL keeps them.
        wf = replace(w, name=f"april-{size}-dapo", filter_keep_fraction=0.5)
        row(f"APRIL Qwen3-{size.upper()} DAPO DAPO-Math: april / sync rollout tok/s",
            _run(preset, wf, "april"), _run(preset, wf, "sync-oversample"),
            "throughput_tokens_per_s")

    # ---- CoPRIS: veRL + vLLM 0.8.4; 64 prompts x 8, N' = 1024, prompts <= 1024 tokens, budget
    # 15360. 32 H800 (7B, Qwen3-8B) -> an 8-GPU slice: 16 prompts, N' 256; 16 A800 (1.5B) ->
    # 32 prompts, N' 512.
    q8 = length("deepscaler-qwen3-8b")
    r1 = length("deepscaler-r1-distill")
    for budget in (8192, 40960):
        # fig. 3a: 50 steps from a cold start, average effective throughput over all of them
        w = _w(f"copris-ctx-{budget // 1024}k", length=q8, max_response_len=budget,
               rollout_batch_size=16, concurrency=256, steps=steps(50))
        row(f"CoPRIS fig. 3a Qwen3-8B {budget // 1024}K: copris / veRL effective throughput",
            _run("h800-qwen3-8b-vllm", w, "copris"), _run("h800-qwen3-8b-vllm", w, "sync"),
            "steps_per_hour_all")
    t1 = {
        "7B": ("h800-r1-distill-7b-vllm", r1, 16, 256),
        "1.5B": ("a800-r1-distill-1.5b-vllm", r1, 32, 512),
        "Qwen3-8B": ("h800-qwen3-8b-vllm", q8, 16, 256),
    }
    for label, (preset, law, prompts, n_prime) in t1.items():
        w = _w(f"copris-t1-{label}", length=law, max_response_len=15360, rollout_batch_size=prompts,
               concurrency=n_prime, steps=steps(24))
        model = label if label == "Qwen3-8B" else f"Distill-Qwen-{label}"
        row(f"CoPRIS tab. 1 {model}: veRL / CoPRIS training hours",
            _run(preset, w, "copris"), _run(preset, w, "sync"), "steps_per_hour")
    # tab. 2 (1.5B, 16 A800): seconds per step at N' 512 / 1536 / 2048 and naive partial rollout
    # (over-sampling to 1536 requests) against N' = 1024; slice: N' halved.
    preset, law, prompts, _ = t1["1.5B"]
    w = _w("copris-t1-1.5B", length=law, max_response_len=15360, rollout_batch_size=prompts,
           concurrency=512, steps=steps(24))
    ref = _run(preset, w, "copris")
    for n_prime in (512, 1536, 2048):
        row(f"CoPRIS tab. 2 step time N'={n_prime} / N'=1024",
            ref, _run(preset, w, "copris", concurrency=n_prime // 2), "steps_per_hour")
    row("CoPRIS tab. 2 step time naive partial rollout (1536) / CoPRIS N'=1024",
        ref, _run(preset, w, "april", over_sampling_factor=3.0), "steps_per_hour")

    # ---- verl async partial-rollout recipe: 2 x 8 H20, Qwen3-4B, vLLM, DAPO-Math, 18384-token
    # budget; sample supplementation keeps every engine busy up to the batch (CoPRIS with N' =
    # the batch) and caches what is unfinished. Batch not stated: 32 x 8 assumed (16 on 8 GPUs).
    w = _w("verl-recipe", length=dapo, max_response_len=18384, rollout_batch_size=16,
           concurrency=128, steps=steps(16))
    row("verl recipe DAPO-Math Qwen3-4B: noPR / PR time per step",
        _run("h20-qwen3-4b-vllm", w, "copris"), _run("h20-qwen3-4b-vllm", w, "sync"),
        "steps_per_hour")
    return out


def _run_job(run: Run) -> tuple[Run, dict[str, Any]]:
    result = run_benchmark(run.workload, ENGINE_PRESETS[run.preset])
    return run, result.summaries[run.policy]


def reproduce(table: list[Row], jobs: int = 1) -> list[dict[str, Any]]:
    """Run every distinct ``Run`` once and fill the rows."""
    unique = list(dict.fromkeys(r for row in table for r in (row.numerator, row.denominator)))
    done = dict(run_jobs(_run_job, unique, jobs))
    out = []
    for row in table:
        num, den = done[row.numerator], done[row.denominator]
        emulated = num[row.metric] / den[row.metric] if den[row.metric] > 0 else float("nan")
        out.append({"name": row.name, "published": row.published, "emulated": emulated,
                    "difference": emulated / row.published - 1.0, "source": row.source,
                    "role": row.role, "metric": row.metric, "note": row.note,
                    "numerator": {"preset": row.numerator.preset, "policy": row.numerator.policy,
                                  "stationary": num["stationary"], "warmup_steps": num["warmup_steps"]},
                    "denominator": {"preset": row.denominator.preset, "policy": row.denominator.policy,
                                    "stationary": den["stationary"], "warmup_steps": den["warmup_steps"]}})
    return out


# The fit: each length law's median_tokens is chosen, from these candidates, on its fit row.
FIT_CANDIDATES: dict[str, tuple[float, ...]] = {
    "dapo-math-qwen3-4b-16k": (4000.0, 6000.0, 8000.0, 10000.0, 12000.0),
    "deepscaler-qwen3-8b": (6000.0, 7000.0, 8500.0, 10000.0, 12000.0),
    "deepscaler-r1-distill": (3500.0, 4500.0, 5500.0),
}
_FIT_ROW_LAW = {
    "APRIL Qwen3-4B GRPO DAPO-Math: april / sync rollout tok/s": "dapo-math-qwen3-4b-16k",
    "CoPRIS fig. 3a Qwen3-8B 8K: copris / veRL effective throughput": "deepscaler-qwen3-8b",
    "CoPRIS tab. 1 Distill-Qwen-7B: veRL / CoPRIS training hours": "deepscaler-r1-distill",
}


def fit(jobs: int = 1, steps_scale: float = 1.0, laws: list[str] | None = None) -> dict[str, Any]:
    """Every fit row at every candidate median of its law, in one pool; the best per law."""
    table: list[Row] = []
    for law, candidates in FIT_CANDIDATES.items():
        if laws is not None and law not in laws:
            continue
        for median in candidates:
            for row in rows(steps_scale, {law: median}):
                if _FIT_ROW_LAW.get(row.name) == law:
                    table.append(replace(row, note=f"{law} median_tokens={median}"))
    result = reproduce(table, jobs)
    best: dict[str, Any] = {}
    for r in result:
        law, _, median = r["note"].partition(" median_tokens=")
        if law not in best or abs(r["difference"]) < abs(best[law]["difference"]):
            best[law] = {"median_tokens": float(median), "row": r["name"],
                         "published": r["published"], "emulated": r["emulated"],
                         "difference": r["difference"]}
    return {"grid": result, "best": best}


def format_rows(result: list[dict[str, Any]]) -> str:
    lines = [f"{'figure':<78} {'published':>9} {'emulated':>8} {'diff':>7}  role"]
    for r in result:
        lines.append(f"{r['name']:<78} {r['published']:>8.2f}x {r['emulated']:>7.2f}x "
                     f"{r['difference']:>+7.1%}  {r['role']}")
    for role in ("fit", "held-out"):
        errs = [abs(r["difference"]) for r in result if r["role"] == role]
        if errs:
            lines.append(f"{role}: mean |diff| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} "
                         f"over {len(errs)} rows")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="april-slime bench reproduce",
        description="Every published figure we can set up (APRIL, CoPRIS, the verl partial-rollout "
                    "recipe), published vs emulated. Long: 24 runs of 16-50 steps (about 1.5 "
                    "hours of CPU; --jobs 16 took 6 minutes).")
    p.add_argument("--json", default=None, metavar="PATH",
                   help='write {"rows": [{"name", "published", "emulated", "source", ...}]}')
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="only the rows whose name contains TEXT")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every run's steps (at least 4); < 1 for a quick look")
    p.add_argument("--medians", default=None, metavar="LAW=TOKENS,...",
                   help="replace length laws' median_tokens (e.g. the values --fit just found)")
    p.add_argument("--laws", default=None, metavar="LAW,...", help="--fit: only these length laws")
    p.add_argument("--fit", action="store_true",
                   help="grid-search each length law's median_tokens on its fit row and print the "
                        "best (what docs/calibration/fit.json records)")
    args = p.parse_args(argv)
    if args.jobs < 1 or not args.steps_scale > 0:
        print("april-slime bench reproduce: --jobs must be >= 1 and --steps-scale > 0", file=sys.stderr)
        return 2
    medians: dict[str, float] = {}
    try:
        for item in filter(None, (args.medians or "").split(",")):
            law, _, value = item.partition("=")
            medians[law.strip()] = float(value)
    except ValueError:
        print(f"april-slime bench reproduce: --medians {args.medians!r}: expected LAW=TOKENS,...",
              file=sys.stderr)
        return 2
    if args.fit:
        laws = [x.strip() for x in args.laws.split(",")] if args.laws else None
        found = fit(args.jobs, args.steps_scale, laws)
        print(format_rows(found["grid"]))
        for law, b in found["best"].items():
            print(f"{law}: median_tokens {b['median_tokens']:g} -> {b['emulated']:.2f}x vs "
                  f"{b['published']:.2f}x ({b['difference']:+.1%})")
        print("MEDIANS " + ",".join(f"{law}={b['median_tokens']:g}" for law, b in found["best"].items()))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(found, fh, indent=2)
        return 0
    table = rows(args.steps_scale, medians)
    if args.only:
        table = [r for r in table if args.only.lower() in r.name.lower()]
        if not table:
            print(f"april-slime bench reproduce: no row matches {args.only!r}", file=sys.stderr)
            return 2
    result = reproduce(table, args.jobs)
    print(format_rows(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": result}, fh, indent=2)
    return 0
