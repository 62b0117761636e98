"""``april-slime bench`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields, replace
from typing import Any, Sequence

from .report import format_table, headline, plot
from .runner import PolicyRun, run_benchmark
from .spec import ENGINE_PRESETS, EngineSpec
from .workloads import MODES, POLICIES, QUICK, WORKLOADS, Workload

# ============================================================================ command line
def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "," in text:
        return tuple(_parse_value(t) for t in text.split(",") if t.strip())
    return text


def apply_overrides(workload: Workload, spec: EngineSpec,
                    assignments: Sequence[str]) -> tuple[Workload, EngineSpec]:
    """``key=value`` pairs; keys are ``Workload`` or ``EngineSpec`` fields (unique names)."""
    w_fields = {f.name for f in fields(Workload)}
    s_fields = {f.name for f in fields(EngineSpec)}
    w_changes: dict[str, Any] = {}
    s_changes: dict[str, Any] = {}
    for item in assignments:
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise ValueError(f"--set {item!r}: expected key=value")
        value = _parse_value(raw)
        if key in ("policies", "sweep_values") and not isinstance(value, tuple):
            value = (value,)
        if key in w_fields:
            w_changes[key] = value
        elif key in s_fields:
            s_changes[key] = value
        else:
            raise ValueError(f"--set {key}: unknown key; workload keys: {sorted(w_fields)}; "
                             f"engine keys: {sorted(s_fields)}")
    return replace(workload, **w_changes), replace(spec, **s_changes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-slime bench",
        description="Rollout policies (sync, april, copris, copris-adaptive) driven by the "
                    "production scheduler against the SGLang emulator. See docs/bench.md.")
    p.add_argument("workload", nargs="?", default="dapo16k", choices=sorted(WORKLOADS),
                   help="what to run (default: dapo16k)")
    p.add_argument("--mode", choices=MODES, default="virtual",
                   help="virtual: in-process, virtual clock (fast); http: real HTTP on loopback, "
                        "emulator clock at --time-scale")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="http mode: emulated seconds per wall second; the client parses every "
                        "token in wall time, so keep (emulated tok/s x scale) well under ~20k")
    p.add_argument("--engine-preset", choices=sorted(ENGINE_PRESETS), default=None,
                   help="engine/hardware calibration (default: the workload's)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--steps", type=int, default=None, help="rollout steps per policy")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps, prompts and sweep points (under a minute)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a workload or engine-spec field, e.g. --set concurrency=768 "
                        "--set mem_fraction_static=0.8 --set decode_per_kv_token=3e-8")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the figure")
    p.add_argument("--show-engine", action="store_true",
                   help="print the derived engine time model and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = WORKLOADS[args.workload]
    if args.quick:
        workload = replace(workload, **QUICK[workload.name])
    try:
        spec = ENGINE_PRESETS[args.engine_preset or workload.preset]
        if args.policies:
            workload = replace(workload, policies=tuple(x.strip() for x in args.policies.split(",")))
        if args.steps:
            workload = replace(workload, steps=args.steps)
        workload, spec = apply_overrides(workload, spec, args.set)
        workload = replace(workload, preset=spec.name)
    except (ValueError, TypeError) as exc:
        print(f"april-slime bench: {exc}", file=sys.stderr)
        return 2
    if args.show_engine:
        print(json.dumps(spec.describe(), indent=2))
        return 0

    def progress(run: PolicyRun) -> None:
        print(f"  {run.label}: {len(run.steps)} steps in {run.wall_s:.1f} s wall", file=sys.stderr,
              flush=True)

    print(f"april-slime bench {workload.name} ({args.mode}) on {spec.model}, {spec.num_engines} "
          f"engines x {spec.gpus_per_engine} GPUs", file=sys.stderr, flush=True)
    result = run_benchmark(workload, spec, mode=args.mode, time_scale=args.time_scale,
                           progress=progress)
    print(format_table(result))
    for line in headline(result):
        print(line)
    print(f"(steady state over steps {workload.warmup_steps + 1}..{workload.steps}; "
          f"{result.wall_s:.1f} s wall)")
    if args.json:
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result.to_json(), fh, indent=2)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
