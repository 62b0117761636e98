"""``april-slime bench`` command line (and ``april-slime bench reproduce``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from .records import PolicyRun, StepRecord
from .report import format_band, format_table, headline, plot
from .runner import Progress, plan, run_benchmark
from .spec import ENGINE_PRESETS, EngineSpec
from .workloads import MODES, POLICIES, QUICK, QUICK_HTTP, WORKLOADS, Workload, parse_bounds


# ============================================================================ --set values
def _field_kind(annotation: str) -> str:
    """What a dataclass field holds, from its (string) annotation."""
    a = annotation.replace(" ", "")
    if a.startswith("tuple"):
        return "tuple"
    for kind in ("bool", "int", "float", "str"):
        if a.split("|")[0] == kind:
            return kind
    return "any"


def _coerce(key: str, raw: str, annotation: str) -> Any:
    """``raw`` as the type field ``key`` holds; a value that does not parse names the key."""
    text = raw.strip()
    kind = _field_kind(annotation)
    optional = "None" in annotation
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind == "int":
            value = float(text)
            if not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float":
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        if kind == "tuple":
            items = [t.strip() for t in text.split(",") if t.strip()]
            if not items:
                raise ValueError
            if key == "sweep_values":
                return tuple(float(t) for t in items)
            if key == "staleness_bounds":
                return parse_bounds(text)
            return tuple(items)
    except ValueError:
        expected = {"bool": "true or false", "int": "an integer", "float": "a finite number",
                    "tuple": "a comma-separated list" + (" of numbers" if key == "sweep_values" else "")}
        none = " or none" if optional else ""
        raise ValueError(f"--set {key}={raw!r}: expected {expected[kind]}{none}") from None
    return text


def apply_overrides(workload: Workload, spec: EngineSpec,
                    assignments: Sequence[str]) -> tuple[Workload, EngineSpec]:
    """``key=value`` pairs; keys are ``Workload`` or ``EngineSpec`` fields (unique names)."""
    w_fields = {f.name: f for f in fields(Workload)}
    s_fields = {f.name: f for f in fields(EngineSpec)}
    w_changes: dict[str, Any] = {}
    s_changes: dict[str, Any] = {}
    for item in assignments:
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ValueError(f"--set {item!r}: expected key=value")
        if key in w_fields:
            w_changes[key] = _coerce(key, raw, str(w_fields[key].type))
        elif key in s_fields:
            s_changes[key] = _coerce(key, raw, str(s_fields[key].type))
        else:
            raise ValueError(f"--set {key}: unknown key; workload keys: {sorted(w_fields)}; "
                             f"engine keys: {sorted(s_fields)}")
    try:
        workload = replace(workload, **w_changes)
        spec = replace(spec, **s_changes)
    except ValueError as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in {**w_changes, **s_changes}.items())
        raise ValueError(f"{exc} (with --set {given})") from None
    return workload, spec


# ============================================================================ progress
class _Bar(Progress):
    """A tqdm bar over every step of every run (what slime uses for its own progress); plain
    lines every 30 s where tqdm is not installed."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.done = 0
        self.last_line = time.monotonic()
        self.stepped: set[str] = set()  # runs that reported their steps (not those in other processes)
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total_steps, unit="step", file=sys.stderr, dynamic_ncols=True,
                            mininterval=1.0)

    def step(self, label: str, record: StepRecord) -> None:
        self.stepped.add(label)
        self.done += 1
        text = f"{label} step {record.index + 1}: rollout {record.rollout_s:.0f} s emulated"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self.last_line > 30:
            self.last_line = time.monotonic()
            print(f"  [{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def run_done(self, run: PolicyRun) -> None:
        line = f"  {run.label}: {len(run.steps)} steps in {run.wall_s:.1f} s wall"
        if run.label not in self.stepped:
            self.done += len(run.steps)
            if self.bar is not None:
                self.bar.update(len(run.steps))
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ============================================================================ parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-slime bench",
        description="Rollout policies (sync, april, copris, copris-adaptive) driven by the "
                    "production scheduler against the SGLang emulator. `april-slime bench "
                    "reproduce` sets up the published figures. See docs/bench.md.")
    p.add_argument("workload", nargs="?", default="dapo16k", choices=sorted(WORKLOADS),
                   help="what to run (default: dapo16k, the headline: 30 steps x 4 policies, the "
                        "partial-rollout ones at 4 staleness bounds, about 10 minutes of CPU; "
                        "multi-turn: agent episodes with tools, run beside their single-turn twin of "
                        "equal tokens)")
    p.add_argument("--mode", choices=MODES, default="virtual",
                   help="virtual: in-process, virtual clock (fast); http: real HTTP on loopback, "
                        "emulator clock at --time-scale (as slow as the emulated time / scale)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="http mode: emulated seconds per wall second (> 0); the client parses "
                        "every token in wall time, so keep (emulated tok/s x scale) well under ~20k")
    p.add_argument("--engine-preset", choices=sorted(ENGINE_PRESETS), default=None,
                   help="engine/hardware calibration (default: the workload's)")
    p.add_argument("--engine-spec", default=None, metavar="PATH",
                   help="engine spec JSON (e.g. written by `april-slime calibrate`); fields it "
                        "leaves out come from its base_preset or the workload's preset")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--steps", type=int, default=None, help="rollout steps per policy (>= 1)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: fewer steps, prompts and sweep points (virtual: under a "
                        "minute on 2 cores, 22 s measured; --mode http: 2 policies x 2 steps of 4 x 8 samples "
                        "with a 2K budget, 1-2 minutes at --time-scale 1); no steady state, so "
                        "the numbers are not results")
    p.add_argument("--band", action="store_true",
                   help="also run the workload over seeds and the uncertain inputs (the length law's "
                        "fitted median, the training cost, the decode-step overhead) and print steps/h "
                        "with its band (9 variants; multi-turn: seeds and tool latency)")
    p.add_argument("--bounds", default=None, metavar="LIST",
                   help="april_max_staleness bounds each partial-rollout policy runs at, e.g. none,4,2,1 "
                        "(the default of dapo16k and multi-turn; none: unbounded); '-': only the "
                        "workload's max_staleness")
    p.add_argument("--variants", type=int, default=None, metavar="N",
                   help="--band: only the first N variants (the nominal seed first)")
    p.add_argument("--jobs", type=int, default=1,
                   help="virtual mode: processes to run the runs (sweep points, --band variants) in "
                        "(default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload or engine-spec field, e.g. --set concurrency=768 "
                        "--set mem_fraction_static=0.8 --set decode_per_kv_token=3e-8")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the figure")
    p.add_argument("--show-engine", action="store_true",
                   help="print the derived engine time model and exit")
    return p


def _configure(args: argparse.Namespace) -> tuple[Workload, EngineSpec, list[str]]:
    """Workload and spec from the arguments, and notes to print; ValueError names what is wrong."""
    notes: list[str] = []
    workload = WORKLOADS[args.workload]
    if args.quick:
        workload = replace(workload, **QUICK[workload.name])
        if args.mode == "http" and workload.sweep == "none":
            workload = replace(workload, **QUICK_HTTP)
    if args.mode == "http" and not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise ValueError(f"--time-scale must be a finite number > 0 (emulated seconds per wall "
                         f"second), got {args.time_scale}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    spec = ENGINE_PRESETS[args.engine_preset or workload.preset]
    if args.engine_spec:
        spec = EngineSpec.load(args.engine_spec, base=spec)
    if args.policies:
        workload = replace(workload, policies=tuple(x.strip() for x in args.policies.split(",")))
    if args.bounds is not None:
        workload = replace(workload, staleness_bounds=parse_bounds(args.bounds))
    if args.variants is not None and args.variants < 1:
        raise ValueError(f"--variants must be >= 1, got {args.variants}")
    if args.steps is not None:
        if args.steps <= workload.warmup_steps:
            # The user asked for this many steps; measure them all rather than refuse over a
            # default they never set.
            notes.append(f"--steps {args.steps}: every step is measured, the cold start included "
                         f"(no warm-up left out), so this is not a steady state")
            workload = replace(workload, steps=args.steps, warmup_steps=0)
        else:
            workload = replace(workload, steps=args.steps)
    workload, spec = apply_overrides(workload, spec, args.set)
    workload = replace(workload, preset=spec.name)
    return workload, spec, notes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "reproduce" and "--fit" in argv[1:]:
        from .fit import main as fit_main

        return fit_main(argv[1:])
    if argv and argv[0] == "reproduce":
        from .reproduce import main as reproduce_main

        return reproduce_main(argv[1:])
    if argv and argv[0] == "report":
        from .docs_report import main as report_main

        return report_main(argv[1:])
    if argv and argv[0] == "scale":
        from .scale import main as scale_main

        return scale_main(argv[1:])
    if argv and argv[0] == "real":
        from .real.cli import main as real_main

        return real_main(argv[1:])
    if argv and argv[0] == "predict":
        # a job's speed-up from its lengths and an engine spec: the emulated twin alone
        from .real.cli import main as real_main

        rest = argv[1:]
        if "-h" in rest or "--help" in rest:
            print("usage: april-slime bench predict --lengths FILE --engine-spec SPEC [bench real options]\n\n"
                  "Each policy's speed-up for the job whose response lengths FILE holds (a slime rollout dump "
                  "from --save-debug-rollout-data, or JSONL), on the engines SPEC describes (april-slime "
                  "calibrate): `april-slime bench real --emulated-only --workloads job`. The job's shape "
                  "(groups per step, samples per group) comes from FILE unless --batch / --n say.")
            return 0
        return real_main(["--emulated-only", "--workloads", "job", *rest])
    args = build_parser().parse_args(argv)
    try:
        workload, spec, notes = _configure(args)
    except (ValueError, TypeError) as exc:
        print(f"april-slime bench: {exc}", file=sys.stderr)
        return 2
    if args.show_engine:
        print(json.dumps(spec.describe(), indent=2))
        return 0

    if workload.turns_max and not workload.flat_episodes:
        return _main_multi_turn(args, workload, spec, notes)
    if args.band:
        return _main_band(args, workload, spec)
    label = "SMOKE TEST (--quick): " if args.quick else ""
    print(f"{label}april-slime bench {workload.name} ({args.mode}) on {spec.model}, "
          f"{spec.num_engines} engines x {spec.gpus_per_engine} GPUs", file=sys.stderr, flush=True)
    bar = _Bar(len(plan(workload)) * workload.steps)
    try:
        result = run_benchmark(workload, spec, mode=args.mode, time_scale=args.time_scale,
                               progress=bar, jobs=args.jobs)
    finally:
        bar.close()
    if args.quick:
        print(f"SMOKE TEST (--quick): {workload.steps} steps of {workload.samples_per_step} samples; "
              f"the buffer never reaches a steady state, so these numbers check that the path runs "
              f"and are not results.")
    for note in notes:
        print(note)
    print(format_table(result))
    for line in headline(result):
        print(line)
    print(f"({result.wall_s:.1f} s wall)")
    if args.json:
        _write_json(args.json, result.to_json())
    if args.plot:
        plot(result, args.plot)
    return 0


def _main_multi_turn(args: argparse.Namespace, workload: Workload, spec: EngineSpec, notes: list[str]) -> int:
    """A multi-turn workload runs beside its single-turn twin of equal tokens (once, or --band)."""
    from .multiturn_report import main_pair

    if args.band:
        return main_pair(args, workload, spec, notes)
    label = "SMOKE TEST (--quick): " if args.quick else ""
    print(f"{label}april-slime bench {workload.name} ({args.mode}) on {spec.model}, {spec.num_engines} engines x "
          f"{spec.gpus_per_engine} GPUs, with its single-turn twin", file=sys.stderr, flush=True)
    bar = _Bar(2 * len(plan(workload)) * workload.steps)
    try:
        return main_pair(args, workload, spec, notes, progress=bar)
    finally:
        bar.close()


def _main_band(args: argparse.Namespace, workload: Workload, spec: EngineSpec) -> int:
    """--band: every (variant, policy) on a fresh cluster, in --jobs processes; the nominal
    variant is the headline run, so nothing runs twice."""
    from .band import headline_variants, run_band

    if workload.sweep != "none":
        print("april-slime bench: --band runs a policy workload (dapo16k), not a sweep",
              file=sys.stderr)
        return 2
    variants = headline_variants(workload, spec)[:args.variants or None]
    print(f"april-slime bench {workload.name} --band: {len(variants)} variants x "
          f"{len(plan(workload))} policy runs x {workload.steps} steps in {args.jobs} processes",
          file=sys.stderr, flush=True)
    band = run_band(workload, spec, variants, jobs=args.jobs)
    print(format_band(band))
    if args.json:
        from dataclasses import asdict

        _write_json(args.json, {"workload": asdict(workload), "engine": spec.describe(), "band": band})
    return 0


def _write_json(path: str, data: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
