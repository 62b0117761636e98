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

from .laws import on_family, solve, statistics, with_fields
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
    role: str  # "fit", "held-out" or PARTLY_FITTED
    numerator: Run
    denominator: Run
    metric: str  # summary key; emulated = metric(numerator) / metric(denominator)
    note: str = ""
    # the paper's seconds per step (and their rollout and log-prob parts) of numerator, denominator
    published_s: tuple[float, float] | None = None
    published_rollout_s: tuple[float, float] | None = None
    published_logprob_s: tuple[float, float] | None = None


def _w(name: str, **kw: Any) -> Workload:
    base = dict(name=name, prompt_len=256, n_samples_per_prompt=8, warmup_steps=2, sweep="none",
                timeline_interval_s=10.0, load_poll_interval_s=2.0)
    base.update(kw)
    return Workload(**base)


def _run(preset: str, workload: Workload, policy: str, **kw: Any) -> Run:
    return Run(preset, replace(workload, policies=(policy,), **kw))


def published() -> dict[str, Any]:
    """``data/published.json``: ``{"rows": [...], "statistics": [...]}``."""
    text = resources.files("april_workbench.bench").joinpath("data/published.json").read_text("utf-8")
    return json.loads(text)


def published_statistic(name: str) -> dict[str, Any]:
    for item in published()["statistics"]:
        if item["name"] == name:
            return item
    raise KeyError(f"no published statistic {name!r}")


def april_family(law: str, median: float) -> str:
    """The law at ``median`` that meets APRIL's length statistics: the batch's spread fig. 7's
    4,250 tokens, a group's no wider than fig. 8's 1,500 (``laws.on_family``)."""
    return on_family(law, median, published_statistic("APRIL batch sigma")["published"],
                     published_statistic("APRIL group sigma GRPO")["published"])


def dapo_arm(law: str) -> str:
    """The law of a DAPO run: the same prompts' lengths with the wider spread within a group that
    APRIL measured for DAPO (fig. 8: 2,400 tokens, against < 1,500 for GRPO)."""
    return solve(law, "sample_sigma", "sigma_group", published_statistic("APRIL group sigma DAPO")["published"],
                 0.0, 1.5)


# A row published as held out whose one arm is the run veRL's training phase is fitted on
# (``tab2_reference``): its ratio is not a prediction of that arm's step time.
PARTLY_FITTED = "partly fitted"
# The emulated length statistics a law is solved to meet (``april_family``, ``dapo_arm``): inputs
# of the fit, reported beside their published values, not outputs.
SOLVED_STATISTICS = ("APRIL batch sigma", "APRIL group sigma DAPO")


def mark_partly_fitted(table: list[Row], reference: Run) -> list[Row]:
    """The held-out rows with ``reference`` (the training fit's run) as an arm, as PARTLY_FITTED."""
    return [replace(r, role=PARTLY_FITTED) if r.role == "held-out" and reference in (r.numerator, r.denominator)
            else r for r in table]


def rows(steps_scale: float = 1.0, laws: dict[str, str] | None = None) -> list[Row]:
    """Every row; ``steps_scale`` shortens the runs (tests), ``laws`` replaces length laws by name
    (``{"dapo-math-qwen3-4b-16k": "dapo-math-qwen3-4b-16k:median_tokens=3000,..."}``: the fit)."""
    pub = {r["name"]: r for r in published()["rows"]}
    laws = laws or {}

    def steps(n: int) -> int:
        return max(4, int(round(n * steps_scale)))

    def length(name: str) -> str:
        return laws.get(name, name)

    out: list[Row] = []

    def row(name: str, num: Run, den: Run, metric: str, note: str = "") -> None:
        p = pub[name]

        def pair(key: str) -> tuple[float, float] | None:
            return tuple(p[key]) if key in p else None  # type: ignore[return-value]

        out.append(Row(name, float(p["published"]), p["source"], p["role"], num, den, metric, note,
                       pair("published_s_per_step"), pair("published_rollout_s"), pair("published_logprob_s")))

    # ---- APRIL §3.2.1 / fig. 4: slime + SGLang, 8 x MI300X, Qwen3-4B/8B, 32 x 8, 16K,
    # over_sampling_batch_size 64. The figure is slime's perf/tokens_per_gpu_per_sec: the response
    # tokens of the samples a step returns / its rollout time (slime/observability/rollout_metrics.py),
    # i.e. trained tokens, not every token generated (a baseline's discarded partials do not count).
    for dataset, law in (("DAPO-Math", length("dapo-math-qwen3-4b-16k")), ("DeepMath", length("deepmath-qwen3-16k"))):
        for size in ("4b", "8b"):
            preset = f"mi300x-qwen3-{size}"
            w = _w(f"april-{size}-{dataset.lower()}", length=law, max_response_len=16384, rollout_batch_size=32,
                   steps=steps(16), over_sampling_factor=2.0)
            row(f"APRIL Qwen3-{size.upper()} GRPO {dataset}: april / sync rollout tok/s per GPU",
                _run(preset, w, "april"), _run(preset, w, "sync"), "effective_throughput_tokens_per_s")
            if dataset != "DAPO-Math":
                continue
            # DAPO arm: dynamic sampling in both arms (half the groups have mixed rewards), so the
            # baseline already over-samples and aborts; it discards its partials, APRIL keeps them.
            wf = replace(w, name=f"april-{size}-dapo", length=dapo_arm(law), filter_keep_fraction=0.5)
            row(f"APRIL Qwen3-{size.upper()} DAPO DAPO-Math: april / sync rollout tok/s per GPU",
                _run(preset, wf, "april"), _run(preset, wf, "sync-oversample"),
                "effective_throughput_tokens_per_s")

    # ---- CoPRIS: veRL + vLLM 0.8.4; 64 prompts x 8, N' = 1024, prompts <= 1024 tokens, budget
    # 15360. 32 H800 (7B, Qwen3-8B) -> an 8-GPU slice: 16 prompts, N' 256; 16 A800 (1.5B) ->
    # 32 prompts, N' 512. The baseline is veRL's synchronous rollout (sync-split).
    q8 = length("deepscaler-qwen3-8b")
    r1 = length("deepscaler-r1-distill")
    for budget in (8192, 40960):
        # fig. 3a: 50 steps from a cold start, average effective throughput over all of them
        w = _w(f"copris-ctx-{budget // 1024}k", length=q8, max_response_len=budget,
               rollout_batch_size=16, concurrency=256, steps=steps(50))
        row(f"CoPRIS fig. 3a Qwen3-8B {budget // 1024}K: copris / veRL effective throughput",
            _run("h800-qwen3-8b-vllm", w, "copris"), _run("h800-qwen3-8b-vllm", w, "sync-split"),
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
            _run(preset, w, "copris"), _run(preset, w, "sync-split"), "steps_per_hour")
    # tab. 2 (1.5B, 16 A800): seconds per step at N' 512 / 1536 / 2048 and naive partial rollout
    # (over-sampling to 1536 requests) against N' = 1024; slice: N' halved.
    ref = tab2_reference(steps_scale, laws)
    preset, w = ref.preset, ref.workload
    for n_prime in (512, 1536, 2048):
        row(f"CoPRIS tab. 2 step time N'={n_prime} / N'=1024",
            ref, _run(preset, w, "copris", concurrency=n_prime // 2), "steps_per_hour")
    row("CoPRIS tab. 2 step time naive partial rollout (1536) / CoPRIS N'=1024",
        ref, _run(preset, w, "april", over_sampling_factor=3.0), "steps_per_hour")

    # ---- verl async partial-rollout recipe: 2 x 8 H20, Qwen3-4B, vLLM, DAPO-Math, 18384-token
    # budget; sample supplementation keeps every engine busy up to the batch (CoPRIS with N' =
    # the batch) and caches what is unfinished. Its baseline is veRL's agent loop, which spreads
    # requests over the servers by load (sync). Batch not stated: 32 x 8 assumed (16 on 8 GPUs).
    w = _w("verl-recipe", length=length("dapo-math-qwen3-4b-16k"), max_response_len=18384, rollout_batch_size=16,
           concurrency=128, steps=steps(16))
    row("verl recipe DAPO-Math Qwen3-4B: noPR / PR time per step",
        _run("h20-qwen3-4b-vllm", w, "copris"), _run("h20-qwen3-4b-vllm", w, "sync"),
        "steps_per_hour")
    return mark_partly_fitted(out, ref)


def tab2_reference(steps_scale: float = 1.0, laws: dict[str, str] | None = None) -> Run:
    """CoPRIS tab. 2's N' = 1024 run (1.5B on A800, slice: N' 512): every tab. 2 row's
    reference, and the point veRL's training phase is calibrated on (``fit.py``)."""
    law = (laws or {}).get("deepscaler-r1-distill", "deepscaler-r1-distill")
    w = _w("copris-t1-1.5B", length=law, max_response_len=15360, rollout_batch_size=32, concurrency=512,
           steps=max(4, int(round(24 * steps_scale))))
    return _run("a800-r1-distill-1.5b-vllm", w, "copris")


def _run_job(run: Run) -> tuple[Run, dict[str, Any]]:
    result = run_benchmark(run.workload, ENGINE_PRESETS[run.preset])
    return run, result.summaries[run.policy]


_ARM_KEYS = ("step_s", "rollout_s_per_step", "train_s_per_step", "buffered_logprob_s_per_step",
             "offpolicy_token_fraction", "carried_token_fraction", "train_tokens_per_step", "buffer_tokens_mean",
             "stationary", "warmup_steps")


def arm(run: Run, summary: dict[str, Any], published_s: float | None = None,
        published_rollout_s: float | None = None, published_logprob_s: float | None = None) -> dict[str, Any]:
    """One side of a row: its run and what it measured, beside the paper's seconds where given."""
    out = {"preset": run.preset, "policy": run.policy, "law": run.workload.length,
           **{k: summary[k] for k in _ARM_KEYS}}
    out.update(published_s_per_step=published_s, published_rollout_s=published_rollout_s,
               published_logprob_s=published_logprob_s)
    return out


def fill(row: Row, num: dict[str, Any], den: dict[str, Any]) -> dict[str, Any]:
    """A row's result from its two runs' summaries."""
    emulated = num[row.metric] / den[row.metric] if den[row.metric] > 0 else float("nan")

    def side(k: int) -> tuple[float | None, ...]:
        return tuple(x[k] if x is not None else None
                     for x in (row.published_s, row.published_rollout_s, row.published_logprob_s))

    return {"name": row.name, "published": row.published, "emulated": emulated,
            "difference": emulated / row.published - 1.0, "source": row.source,
            "role": row.role, "metric": row.metric, "note": row.note,
            "numerator": arm(row.numerator, num, *side(0)), "denominator": arm(row.denominator, den, *side(1))}


def run_all(runs: list[Run], jobs: int = 1) -> dict[Run, dict[str, Any]]:
    """Every distinct run once, in ``jobs`` processes: run -> summary."""
    return dict(run_jobs(_run_job, list(dict.fromkeys(runs)), jobs))


def reproduce(table: list[Row], jobs: int = 1) -> list[dict[str, Any]]:
    """Run every distinct ``Run`` once and fill the rows."""
    done = run_all([r for row in table for r in (row.numerator, row.denominator)], jobs)
    return [fill(row, done[row.numerator], done[row.denominator]) for row in table]


def format_rows(result: list[dict[str, Any]]) -> str:
    lines = [f"{'figure':<78} {'published':>9} {'emulated':>8} {'diff':>7}  {'s/step num / den: pub, emu':<30} role"]
    for r in result:
        def s(a: dict) -> str:
            pub = f"{a['published_s_per_step']:.0f}" if a["published_s_per_step"] else "-"
            return f"{pub}, {a['step_s']:.0f}"
        lines.append(f"{r['name']:<78} {r['published']:>8.2f}x {r['emulated']:>7.2f}x "
                     f"{r['difference']:>+7.1%}  {s(r['numerator']) + ' / ' + s(r['denominator']):<30} {r['role']}")
    for role in ("fit", "held-out", PARTLY_FITTED):
        errs = [abs(r["difference"]) for r in result if r["role"] == role]
        if errs:
            within = sum(e <= 0.10 for e in errs)
            lines.append(f"{role}: mean |diff| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} "
                         f"over {len(errs)} rows, {within} of {len(errs)} within +-10%")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-slime bench reproduce",
        description="Every published figure we can set up (APRIL, CoPRIS, the verl partial-rollout "
                    "recipe), published vs emulated, with the seconds per step beside each ratio. "
                    "Long: 30 runs of 16-50 steps (about 2 hours of CPU).")
    p.add_argument("--json", default=None, metavar="PATH",
                   help='write {"rows": [{"name", "published", "emulated", "numerator", ...}], "statistics": [...]}')
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="only the rows whose name contains TEXT")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every run's steps (at least 4); < 1 for a quick look")
    p.add_argument("--law", action="append", default=[], metavar="PRESET:FIELD=VALUE,...",
                   help="replace a length law (repeatable), e.g. the values --fit just found")
    p.add_argument("--fit", action="store_true",
                   help="fit every length law's median and tail on its fit rows and APRIL's length "
                        "statistics, and veRL's training phase on CoPRIS tab. 2 (docs/results/calibration/fit.json)")
    p.add_argument("--laws", default=None, metavar="LAW,...", help="--fit: only these length laws")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]] | None:
    """The arguments and the ``--law`` replacements; None (after saying why) when they are wrong."""
    args = build_parser().parse_args(argv)
    if args.jobs < 1 or not args.steps_scale > 0:
        print("april-slime bench reproduce: --jobs must be >= 1 and --steps-scale > 0", file=sys.stderr)
        return None
    try:
        laws = {spec.partition(":")[0]: with_fields(spec) for spec in args.law}
    except ValueError as exc:
        print(f"april-slime bench reproduce: --law: {exc}", file=sys.stderr)
        return None
    return args, laws


def main(argv: list[str] | None = None) -> int:
    parsed = parse(argv)
    if parsed is None:
        return 2
    args, laws = parsed
    if args.fit:  # `april-slime bench reproduce --fit` is fit.main's (it imports this module)
        print("april-slime bench reproduce: --fit runs through `april-slime bench reproduce --fit`", file=sys.stderr)
        return 2
    table = rows(args.steps_scale, laws)
    if args.only:
        table = [r for r in table if args.only.lower() in r.name.lower()]
        if not table:
            print(f"april-slime bench reproduce: no row matches {args.only!r}", file=sys.stderr)
            return 2
    result = reproduce(table, args.jobs)
    stats = law_statistics(result, laws)
    print(format_rows(result))
    for item in stats:
        print(f"{item['name']}: published {item['published']:g}, emulated {item['emulated']:.3g} ({item['where']})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": result, "statistics": stats}, fh, indent=2)
    return 0


def law_statistics(result: list[dict[str, Any]], laws: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """APRIL's published length statistics beside the emulated ones: the batch and group spread of
    the DAPO-Math law (and its DAPO arm) and the carried-over tokens of its GRPO april run."""
    law = (laws or {}).get("dapo-math-qwen3-4b-16k", "dapo-math-qwen3-4b-16k")
    grpo, dapo = statistics(law), statistics(dapo_arm(law))
    out = []
    for name, value, where in (
            ("APRIL batch sigma", grpo["sigma_batch"], "dapo-math-qwen3-4b-16k at 16K, 32 x 8 per step"),
            ("APRIL group sigma GRPO", grpo["sigma_group"], "dapo-math-qwen3-4b-16k"),
            ("APRIL group sigma DAPO", dapo["sigma_group"], "the DAPO arm's law")):
        out.append({**published_statistic(name), "emulated": value, "where": where,
                    "solved": name in SOLVED_STATISTICS})
    for r in result:
        if r["name"].startswith("APRIL Qwen3-4B GRPO DAPO-Math"):
            out.append({**published_statistic("APRIL carried-over tokens"),
                        "emulated": r["numerator"]["carried_token_fraction"], "where": "its april run"})
    return out
