"""``april-slime demo``: partial-rollout RL on a CPU, end to end against real SGLang engines."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

from april_workbench.demo.loop import FULL, POLICIES, QUICK, TASKS, TOOL_FULL, TOOL_QUICK, Until


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-slime demo",
        description="Train a tiny Qwen3 with RL on CPU (reverse digits; with --task tool, multiply with a "
                    "calculator tool over multi-turn episodes): real SGLang engines behind "
                    "sglang-router, the plugin's generate_rollout / AprilDataSource inside slime's rollout path, "
                    "slime's reward path, the plugin's loss on a torch copy of the policy, weights pushed with "
                    "/update_weights_from_disk. Needs the real-stack environment (scripts/real-stack/setup.sh).")
    p.add_argument("--quick", action="store_true",
                   help=f"short run: {', '.join(QUICK.policies)}, {QUICK.steps} steps each "
                        "(under 10 minutes on 2 cores)")
    p.add_argument("--task", choices=TASKS, default="reverse",
                   help="reverse: reverse digits, one model call per sample; tool: multiply two numbers by calling "
                        "a calculator tool (slime custom generate function: episodes of several model calls, "
                        "tool latency between them)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the per-step series of every policy here")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw reward vs wall-clock, off-policy share and ESS")
    p.add_argument("--policies", help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--steps", type=int, help="RL steps per policy")
    p.add_argument("--engines", type=int, help="SGLang CPU engines behind the router (default 1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--sft-steps", type=int, help="supervised warm-start steps (a new value builds a new policy)")
    p.add_argument("--vcpo", action="store_true",
                   help="add VCPO's ESS-scaled learning rate (april_vcpo_lr_scaling) to the CoPRIS-IS loss")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (default 1)")
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("APRIL_REAL_STACK_CACHE",
                                              Path.home() / ".cache" / "april-slime")) / "demo",
                   help="where the warm-started policy is built once and reused")
    p.add_argument("--workdir", type=Path,
                   help="prompt files, checkpoints and weight pushes (default: a temporary folder)")
    return p


def settings_from(ns: argparse.Namespace):
    if ns.task == "tool":
        base = TOOL_QUICK if ns.quick else TOOL_FULL
    else:
        base = QUICK if ns.quick else FULL
    changes = {}
    if ns.policies:
        changes["policies"] = tuple(p.strip() for p in ns.policies.split(",") if p.strip())
    for name in ("steps", "engines", "seed"):
        if getattr(ns, name) is not None:
            changes[name] = getattr(ns, name)
    if ns.vcpo:
        changes["vcpo_lr_scaling"] = True
    if ns.sft_steps is not None:
        changes["policy"] = dataclasses.replace(base.policy, sft_steps=ns.sft_steps)
    return dataclasses.replace(base, **changes)


def main(argv: list[str] | None = None, *, until: Until | None = None, max_steps: int | None = None) -> int:
    """The command; a Python caller may also have each policy go on past ``--steps`` until its
    series satisfy ``until``, at most ``max_steps`` steps (``loop.run_demo``)."""
    ns = _parser().parse_args(argv)
    try:
        settings = settings_from(ns)
        if until is not None and (max_steps is None or max_steps < settings.steps):
            raise ValueError(f"until needs max_steps >= steps ({settings.steps}), got {max_steps}")
    except ValueError as e:
        print(f"april-slime demo: {e}", file=sys.stderr)
        return 2
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        print("april-slime demo: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    from april_workbench.localstack import real_stack_missing

    missing = real_stack_missing()
    if missing:
        print(f"april-slime demo needs the real-stack environment: {missing}", file=sys.stderr)
        return 2
    import torch

    from april_slime.core.jsonfile import write_json_atomic
    from april_workbench.demo.loop import run_demo

    torch.set_num_threads(ns.threads)
    # the engines run in their own process groups: a plain SIGTERM must unwind through the
    # stack's context manager, which stops them, rather than end this process and orphan them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def log(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="april-demo-") as tmp:
        workdir = ns.workdir or Path(tmp)
        result = run_demo(settings, cache_dir=ns.cache_dir, workdir=workdir, log=log, until=until,
                          max_steps=max_steps)
    for line in summary(result):
        log(line)
    if ns.json:
        write_json_atomic(ns.json, result)
        log(f"wrote {ns.json}")
    if ns.plot:
        from april_workbench.demo.plot import plot

        plot(result, ns.plot)
        log(f"wrote {ns.plot}")
    return 0


def summary(result: dict) -> list[str]:
    lines = [f"policy build {result['policy_build_s']:.0f}s, engine start {result['engine_start_s']:.0f}s, "
             f"total {result['total_s']:.0f}s"]
    for name, h in result["policies"].items():
        lines.append(f"{name:>7}: held-out reward {h['eval_reward'][0]:.3f} -> {h['eval_reward'][-1]:.3f} in "
                     f"{h['wall_s'][-1]:.0f}s over {len(h['reward'])} steps; mean off-policy share "
                     f"{_mean(h['offpolicy_token_fraction']):.2f}, min ESS ratio {min(h['ess_ratio']):.3f}")
    sync = result["policies"].get("sync")
    if sync is not None:
        target = sync["eval_reward"][-1]
        for name, h in result["policies"].items():
            at = time_to_reward(h, target)
            lines.append(f"{name:>7}: first held-out reward >= sync's final {target:.3f} at "
                         + (f"{at:.0f}s (step {h['eval_step'][h['eval_wall_s'].index(at)]})" if at is not None
                            else "never"))
    return lines


def time_to_reward(series: dict, target: float) -> float | None:
    """Wall-clock seconds of the first held-out evaluation at or above ``target`` (None: never)."""
    for wall, reward in zip(series["eval_wall_s"], series["eval_reward"]):
        if reward >= target:
            return wall
    return None


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


if __name__ == "__main__":
    sys.exit(main())
