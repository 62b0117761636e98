"""``april-slime bench real``: sync, april and copris on real SGLang engines, and what the emulator
predicts for the same comparison.

    april-slime bench real                               # the sweep, on the local CPU stack
    april-slime bench real --workloads longtail --bounds none,2 --json out.json
    april-slime bench real --url http://router:30000 --batch 64 --n 8 --max-len 8192 --eos-rate 0.0005
    april-slime bench real --lengths dump/rollout_data/12.pt --predict   # a job's lengths
    april-slime bench real --quick                       # smoke test: the path runs

Per workload: the engines (the local stack's: a tiny Qwen3 on SGLang 0.5.23 CPU engines behind
sglang-router; or ``--url``: a router, an engine, or comma-separated engines), the arms (sync,
then april and copris at every ``--bounds``; or ``--arms``), ``--rounds`` rounds of one step per
arm in rotating order (``rounds.py``), the warm-up left out, each arm's speed-up against the first
with its 95% band, and where each step's time went (``trace.py``). ``--predict`` first measures the
engines' timings with ``april-slime calibrate`` (decode and prefill steps, abort latency: engine
timings only, never a policy's ratio), then runs the same arms on the same workload in the
emulator (its twin: same prompts, lengths, N', engines, tool pool) and reports both columns.
``--engine-spec`` predicts from a spec measured before instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..spec import ENGINE_PRESETS, EngineSpec
from ..workloads import parse_bounds
from .rounds import Arm, StepRecord, default_arms, parse_arm, run_rounds
from .stacks import EmulatedStack, HttpStack, discover, local
from .stats import summarize, warmup_rounds
from .tools import ToolProcessPool
from .workload import QUICK, SWEEP, WORKLOADS, LengthSource, RealWorkload, job_workload, with_lengths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="april-slime bench real", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None,
                   help="engines to run on: a router, an engine, or comma-separated engines (default: start "
                        "the local CPU stack)")
    p.add_argument("--workloads", default=",".join(SWEEP),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all); or job: the shape of "
                        "--lengths (its groups per step and group size)")
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="a job's response lengths (slime rollout dump .pt, or JSONL) instead of the law")
    p.add_argument("--batch", type=int, default=None, help="override rollout_batch_size")
    p.add_argument("--n", type=int, default=None, help="override n_samples_per_prompt")
    p.add_argument("--max-len", type=int, default=None, help="override the response budget")
    p.add_argument("--eos-rate", type=float, default=None, help="override the law's stop rate per token")
    p.add_argument("--engines", type=int, default=None, help="override the local stack's engine count")
    p.add_argument("--arms", default=None,
                   help="comma-separated arms, the first the baseline: policy[@s<bound>][[key=value,...]] with "
                        "april_* rollout settings, e.g. sync,april,copris,copris[refill_batch=1,dispatch=router]")
    p.add_argument("--bounds", default="none,2",
                   help="the staleness bounds april and copris run at (default none,2; '-': unbounded only)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 24; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="fewest rounds left out (default 3; --quick 1)")
    p.add_argument("--block", type=int, default=4,
                   help="consecutive rounds resampled together by the band's bootstrap, and per block of the "
                        "coarse min..max band (default 4)")
    p.add_argument("--dispatch", choices=("direct", "router"), default="direct")
    p.add_argument("--max-running-requests", type=int, default=64, help="local stack: per engine")
    p.add_argument("--predict", action="store_true",
                   help="calibrate the engines, then run the same comparison in the emulator")
    p.add_argument("--engine-spec", default=None, metavar="PATH",
                   help="predict from this spec (april-slime calibrate) instead of calibrating now")
    p.add_argument("--emulated-only", action="store_true",
                   help="with --engine-spec: only the emulated twin, no engines (a prediction for a job)")
    p.add_argument("--slime-dump", type=int, default=0, metavar="STEPS",
                   help="local stack: first run STEPS rollout steps of a slime job on the engines (the plugin at "
                        "sync, the model's own stop tokens), save them with slime's --save-debug-rollout-data "
                        "writer, and compare the policies on those lengths")
    p.add_argument("--quick", action="store_true", help="smoke test: one tiny workload, 3 rounds")
    p.add_argument("--json", default=None, metavar="PATH", help="write everything measured as JSON")
    p.add_argument("--log-dir", default=None, help="local stack: keep the model and server logs here")
    return p


def _workloads(ns: argparse.Namespace) -> list[RealWorkload]:
    if ns.quick:
        chosen = [QUICK]
    elif ns.workloads == "job":
        if not ns.lengths:
            raise ValueError("the job workload takes its lengths from --lengths")
        chosen = [job_workload(ns.lengths)]
    else:
        names = [x.strip() for x in ns.workloads.split(",") if x.strip()]
        unknown = [x for x in names if x not in WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
        chosen = [WORKLOADS[x] for x in names]
    overrides = {k: v for k, v in (("rollout_batch_size", ns.batch), ("n_samples_per_prompt", ns.n),
                                   ("max_response_len", ns.max_len), ("eos_rate", ns.eos_rate),
                                   ("engines", ns.engines)) if v is not None}
    chosen = [replace(w, **overrides) for w in chosen]
    if ns.lengths:
        chosen = [w if w.lengths_file else with_lengths(w, ns.lengths, ns.max_len)
                  for w in chosen if not w.multi_turn]
        if not chosen:
            raise ValueError("--lengths replaces a single-turn workload's law; every chosen workload is multi-turn")
    return chosen


def _arms(ns: argparse.Namespace) -> list[Arm]:
    if ns.arms:
        return [parse_arm(a.replace(";", ",")) for a in _split_arms(ns.arms)]  # ';' also separates settings
    return default_arms(parse_bounds(ns.bounds) or (None,))


def _split_arms(text: str) -> list[str]:
    """Arms split at the commas outside their [settings]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [a.strip() for a in [*out, cur] if a.strip()]


def _print_step(record: StepRecord, runner: object) -> None:
    b = record.breakdown
    print(f"  round {record.round:3d} {record.arm:22s} {b['step_s']:6.2f} s  target {b['target_s']:5.2f}  "
          f"in flight {b['in_flight']:6.1f}  calls {b['calls']:5.0f}", file=sys.stderr, flush=True)


def _run_real(stack: Any, workload: RealWorkload, arms: list[Arm], rounds: int, dispatch: str,
              verbose: bool) -> dict[str, list[StepRecord]]:
    async def go() -> dict[str, list[StepRecord]]:
        pool = ToolProcessPool(workload.tool_workers) if workload.multi_turn else None
        try:
            await stack.start()
            return await run_rounds(stack, workload, arms, rounds, dispatch=dispatch,
                                    tool_runner=pool.run if pool else None,
                                    on_step=_print_step if verbose else None)
        finally:
            if pool is not None:
                pool.close()
            await stack.close()
    return asyncio.run(go())


def _run_emulated(spec: EngineSpec, workload: RealWorkload, arms: list[Arm], rounds: int,
                  dispatch: str) -> dict[str, list[StepRecord]]:
    from april_workbench.emulator import run_virtual

    async def go() -> dict[str, list[StepRecord]]:
        stack = EmulatedStack(spec, seed=workload.seed)
        await stack.start()
        try:
            return await run_rounds(stack, workload, arms, rounds, dispatch=dispatch, measure_cpu=False)
        finally:
            await stack.close()
    return run_virtual(go())


def _calibrate(url: str, engines: int) -> EngineSpec:
    from ..calibrate import engine_spec, measure

    print(f"calibrating {url} (engine timings, every engine at once)", file=sys.stderr, flush=True)
    m = asyncio.run(measure(url, batches=[1, 8, 32, 64], contexts=[32, 256], decode_tokens=24,
                            prefill_lengths=(32, 256, 1024), prefill_batches=(8, 32, 64), repeats=3,
                            concurrent=True))
    return EngineSpec.from_dict(engine_spec(m, "h100-qwen3-4b", name=f"calibrated {engines} CPU engine(s)"),
                                base=ENGINE_PRESETS["h100-qwen3-4b"])


def _from_slime_dump(workload: RealWorkload, engines: Any, folder: Path, steps: int) -> RealWorkload:
    from .slime_dump import slime_rollout_dump
    from .workload import read_lengths

    print(f"   a slime rollout dump: {steps} step(s) of {workload.rollout_batch_size} x "
          f"{workload.n_samples_per_prompt} on the engines", file=sys.stderr, flush=True)
    files = slime_rollout_dump(engines.router_url, engines.model, folder, batch=workload.rollout_batch_size,
                               n=workload.n_samples_per_prompt, max_len=workload.max_response_len,
                               engines=len(engines.engine_urls), rollouts=steps)
    combined = folder / "lengths.jsonl"
    with open(combined, "w", encoding="utf-8") as f:
        for path in files:
            for group in read_lengths(path):
                f.write(json.dumps({"lengths": group, "dump": path.name}) + "\n")
    return with_lengths(workload, str(combined), workload.max_response_len)


def _table(workload: RealWorkload, summary: dict[str, Any], emulated: dict[str, Any] | None,
           baseline: str) -> str:
    head = (f"{'arm':22s} {'step s':>7s} {'x ' + baseline:>19s} {'emulated':>9s} {'target s':>8s} {'drain s':>7s} "
            f"{'in flight':>9s} {'idle eng-s':>10s} {'free':>6s} {'transit ms':>10s} "
            f"{'client cpu':>10s} {'engine cpu':>10s} {'gen tok/s':>9s}")
    lines = [f"{workload.name}: {workload.describe()}", head, "-" * len(head)]
    for label, s in summary.items():
        sp = s["speedup"]
        band = f"{sp['ratio']:.2f} ({sp['low']:.2f}-{sp['high']:.2f})"
        emu = f"{emulated[label]['speedup']['ratio']:.2f}" if emulated else "-"
        lines.append(f"{label:22s} {s['step_s']:7.2f} {band:>19s} {emu:>9s} {s['target_s']:8.2f} {s['drain_s']:7.2f} "
                     f"{s['in_flight']:9.1f} {s['engine_idle_s']:10.2f} {s['free_slots']:6.1f} "
                     f"{s['transit_ms']:10.1f} {s['client_cpu_s']:10.2f} {s['engine_cpu_s']:10.2f} "
                     f"{s['generated_tokens_per_s']:9.0f}")
    return "\n".join(lines)


def _records_json(runs: dict[str, list[StepRecord]]) -> dict[str, list[dict[str, Any]]]:
    return {label: [asdict(r) for r in records] for label, records in runs.items()}


def _clean(value: Any) -> Any:
    """NaN -> None, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _compare(ns: argparse.Namespace, workload: RealWorkload, arms: list[Arm], rounds: int, minimum: int,
             spec: EngineSpec | None) -> dict[str, Any]:
    """One workload: on the engines (unless --emulated-only), then its emulated twin where there is
    a spec; the summaries and every step's record."""
    real = None
    spec_used = replace(spec, num_engines=workload.engines) if spec is not None else None
    if not ns.emulated_only:
        with contextlib.ExitStack() as hold:
            if ns.url:
                engine_urls, router = asyncio.run(discover(ns.url))
                stack = HttpStack(engine_urls, router, "url")
            else:
                folder = Path(ns.log_dir or hold.enter_context(tempfile.TemporaryDirectory())) / workload.name
                engines = hold.enter_context(local(workload.engines, folder,
                                                   max_running_requests=ns.max_running_requests))
                engine_urls, router = engines.engine_urls, engines.router_url
                stack = HttpStack(engine_urls, router, "local", engines.process_groups)
                if ns.slime_dump:
                    workload = _from_slime_dump(workload, engines, folder / "slime-dump", ns.slime_dump)
            if ns.predict and spec is None:
                spec_used = _calibrate(router or engine_urls[0], len(engine_urls))
            if spec_used is not None:
                spec_used = replace(spec_used, num_engines=len(engine_urls))
            real = _run_real(stack, workload, arms, rounds, ns.dispatch, verbose=True)
    emulated = None
    if spec_used is not None:
        print(f"   emulated twin on {spec_used.name}", file=sys.stderr, flush=True)
        emulated = _run_emulated(spec_used, workload, arms, rounds, ns.dispatch)
    source = real if real is not None else emulated
    warmup, stationary = warmup_rounds(source, minimum)
    baseline = arms[0].label
    return {"workload": asdict(workload), "lengths": LengthSource(workload).stats(), "rounds": rounds,
            "warmup": warmup, "stationary": stationary,
            "real": summarize(real, baseline, warmup, ns.block) if real is not None else None,
            "emulated": summarize(emulated, baseline, warmup, ns.block) if emulated is not None else None,
            "engine_spec": spec_used.describe() if spec_used is not None else None,
            "steps": {"real": _records_json(real) if real else None,
                      "emulated": _records_json(emulated) if emulated else None}}


def _stop_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl-C does, so the local stack's servers are stopped on the way
    out (by default SIGTERM ends the process at once and leaves them running)."""
    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    previous = signal.getsignal(signal.SIGTERM)
    _stop_on_sigterm()
    try:
        return _main(argv)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        workloads = _workloads(ns)
        arms = _arms(ns)
        if len({a.label for a in arms}) != len(arms):
            raise ValueError("--arms: two arms with the same label")
        rounds = ns.rounds if ns.rounds is not None else (3 if ns.quick else 24)
        minimum = ns.warmup if ns.warmup is not None else (1 if ns.quick else 3)
        if rounds < minimum + 2:
            raise ValueError(f"--rounds {rounds}: needs at least --warmup + 2 = {minimum + 2}")
        if ns.emulated_only and not ns.engine_spec:
            raise ValueError("--emulated-only predicts from --engine-spec")
        if ns.slime_dump and (ns.url or ns.emulated_only or ns.lengths):
            raise ValueError("--slime-dump makes its dump on the local stack: not with --url, --emulated-only "
                             "or --lengths")
        spec = EngineSpec.load(ns.engine_spec, base=ENGINE_PRESETS["h100-qwen3-4b"]) if ns.engine_spec else None
    except ValueError as exc:
        print(f"april-slime bench real: {exc}", file=sys.stderr)
        return 2
    baseline = arms[0].label
    result: dict[str, Any] = {
        "command": "april-slime bench real " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, {platform.platform()}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_start": os.getloadavg(),
        "arms": [a.label for a in arms], "baseline": baseline, "workloads": {}}
    for workload in workloads:
        print(f"== {workload.name}: {workload.describe()}", file=sys.stderr, flush=True)
        entry = _compare(ns, workload, arms, rounds, minimum, spec)
        result["workloads"][entry["workload"]["name"]] = entry
        shown = entry["real"] or entry["emulated"]
        print(_table(RealWorkload(**entry["workload"]), shown, entry["emulated"] if entry["real"] else None,
                     baseline))
        if not entry["stationary"]:
            print(f"   note: a buffer was still filling at the end ({rounds} rounds): not a steady state")
        if ns.quick:
            print("SMOKE TEST (--quick): too few rounds for a steady state; the numbers are not results.")
        result["load_average_end"] = os.getloadavg()
        if ns.json:  # after every workload: a long sweep cut short keeps what it measured
            _write(ns.json, result)
    return 0


def _write(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean(result), indent=1) + "\n", encoding="utf-8")
