"""sync vs april vs copris in one run on real SGLang CPU engines behind sglang-router, inside real
slime (its argument parser, data source and RolloutManager methods), on a long-tail workload.

    python scripts/real-stack/bench_policies.py                       # defaults of docs/real-stack.md
    python scripts/real-stack/bench_policies.py --steps 8 --out out/real-bench.json
    python scripts/real-stack/bench_policies.py --arms copris:direct copris:router   # dispatch modes

An arm is ``policy[:dispatch]`` (``april_dispatch``; direct when left out); ratios are against the
first arm.

The workload: a tiny random Qwen3 whose weights end a response with probability ``--eos-rate`` per
token (lengths spread geometrically), a budget ``--max-len`` several times the mean (a few reach it),
``ignore_eos`` off. Steps of the arms are interleaved round by round (the order rotates), so
machine noise hits all of them alike; the first round is a warm-up and is not counted.

Reported per arm: step time (mean; its ratio to the first arm over all counted rounds, and the
min..max of that ratio over blocks of ``--block`` rounds, since a step served from the buffer alone
takes no time),
steps/h, trained and generated tokens per second, and engine utilization from ``/v1/loads`` polled
every 0.1 s (the share of polls with a running request, with every engine running one, and the mean
number running).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from april_slime import rollout
from april_workbench.localstack import local_stack, real_stack_missing
from april_workbench.rollout_manager import SlimeRolloutManager, slime_args
from april_workbench.tiny_qwen3 import build_tiny_qwen3

POLICIES = ("sync", "april", "copris")  # the default arms, direct dispatch


class LoadMonitor:
    """Polls every engine's /v1/loads in a thread; ``window()`` collects what one step saw."""

    def __init__(self, urls: list[str], period_s: float = 0.1):
        self.urls, self.period_s = urls, period_s
        self.samples: list[tuple[float, tuple[int, ...]]] = []  # (time, running requests per engine)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            running = []
            for url in self.urls:
                try:
                    with urllib.request.urlopen(f"{url}/v1/loads", timeout=5) as r:
                        running.append(sum(e["num_running_reqs"] for e in json.loads(r.read())["loads"]))
                except OSError:
                    running.append(0)
            self.samples.append((time.monotonic(), tuple(running)))
            time.sleep(self.period_s)

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> list[tuple[int, ...]]:
        return [n for t, n in self.samples if start <= t <= end]


def write_prompts(path: Path, n: int) -> Path:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            f.write(json.dumps({"prompt": f"Question: what is {a} + {b}? Answer:", "label": str(a + b)}) + "\n")
    return path


async def zero_reward(args, sample, **kwargs) -> float:
    return 0.0


def job(ns, arm: str, router_url: str, model: Path, folder: Path, n_engines: int) -> SlimeRolloutManager:
    folder.mkdir(parents=True, exist_ok=True)
    policy, _, dispatch = arm.partition(":")
    settings = {"april_policy": policy, "april_dispatch": dispatch or "direct"}
    if policy == "copris":
        settings["april_concurrency"] = ns.batch * ns.n
    (folder / "april.yaml").write_text(yaml.safe_dump(settings))
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    argv = ["--rollout-function-path", "april_slime.rollout.generate_rollout",
            "--data-source-path", "april_slime.rollout.AprilDataSource",
            "--custom-config-path", str(folder / "april.yaml"), "--hf-checkpoint", str(model),
            "--prompt-data", str(write_prompts(folder / "prompts.jsonl", 4000)),
            "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", str(ns.batch), "--n-samples-per-prompt", str(ns.n),
            "--over-sampling-batch-size", str(2 * ns.batch),
            "--rollout-max-response-len", str(ns.max_len), "--rollout-temperature", "1.0",
            "--num-rollout", "100000", "--custom-rm-path", f"{__name__}.zero_reward",
            "--sglang-router-ip", host, "--sglang-router-port", port, "--save", str(folder / "ckpt"),
            "--rollout-num-gpus", str(n_engines), "--rollout-num-gpus-per-engine", "1"]
    return SlimeRolloutManager(slime_args(argv))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="counted steps per policy (after one warm-up)")
    parser.add_argument("--batch", type=int, default=8, help="rollout_batch_size (groups)")
    parser.add_argument("--n", type=int, default=4, help="n_samples_per_prompt")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--eos-rate", type=float, default=1 / 40)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--block", type=int, default=3, help="rounds per block of the ratio's band")
    parser.add_argument("--arms", nargs="+", default=list(POLICIES),
                        help="policy[:dispatch] per arm (dispatch: direct | router | auto; default direct); "
                             "ratios are against the first arm")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    ns = parser.parse_args()
    arms = tuple(ns.arms)
    missing = real_stack_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_qwen3(root / "model", eos_rate=ns.eos_rate)
        with local_stack(model, n_engines=ns.engines, max_running_requests=ns.max_running_requests,
                         log_dir=root / "logs") as stack:
            managers = {a: job(ns, a, stack.router_url, model, root / a.replace(":", "-"), ns.engines)
                        for a in arms}
            rows: dict[str, list[dict]] = {a: [] for a in arms}
            with LoadMonitor(stack.engine_urls) as monitor:
                for rnd in range(ns.steps + 1):
                    k = rnd % len(arms)
                    order = arms[k:] + arms[:k]
                    for policy in order:
                        start = time.monotonic()
                        samples, metrics, _ = managers[policy].generate(rnd)
                        end = time.monotonic()
                        window = monitor.window(start, end)
                        rows[policy].append({
                            "round": rnd, "step_s": end - start,
                            "trained_tokens": sum(s.response_length for s in samples),
                            "generated_tokens": metrics.get("april/generated_tokens", 0.0),
                            "truncated": sum(s.status.name == "TRUNCATED" for s in samples),
                            "busy": sum(sum(n) > 0 for n in window) / max(1, len(window)),
                            # every engine running something (the balance dispatch buys)
                            "all_busy": sum(min(n) > 0 for n in window) / max(1, len(window)),
                            "mean_running": statistics.fmean(sum(n) for n in window) if window else 0.0,
                        })
                        print(f"round {rnd} {policy:15s} {end - start:6.2f} s", file=sys.stderr, flush=True)
            rollout.shutdown()
    counted = {a: [r for r in rows[a] if r["round"] > 0] for a in arms}
    base_by_round = {r["round"]: r["step_s"] for r in counted[arms[0]]}
    result = {"machine": f"{platform.processor() or platform.machine()}, {os_cpus()} CPUs, {platform.platform()}",
              "settings": vars(ns) | {"out": str(ns.out) if ns.out else None}, "policies": {}}
    print(f"\n{'arm':15s} {'step s':>8s} {'x ' + arms[0]:>16s} {'steps/h':>8s} {'trained tok/s':>14s} "
          f"{'generated tok/s':>16s} {'busy':>6s} {'all busy':>8s} {'running':>8s} {'truncated':>9s}")
    for p in arms:
        r = counted[p]
        step = statistics.fmean(x["step_s"] for x in r)
        # a step can be served whole from buffered groups (near 0 s), so single rounds make no
        # ratio: the point is the ratio of total times, the band its range over blocks of rounds
        blocks = [r[i:i + ns.block] for i in range(0, len(r), ns.block)]
        ratios = [sum(base_by_round[x["round"]] for x in b) / sum(x["step_s"] for x in b) for b in blocks]
        total_s = sum(x["step_s"] for x in r)
        entry = {"step_s_mean": step, "speedup_vs_first_mean": sum(base_by_round.values()) / total_s,
                 "speedup_vs_first_min": min(ratios), "speedup_vs_first_max": max(ratios),
                 "steps_per_hour": 3600 / step,
                 "trained_tokens_per_s": sum(x["trained_tokens"] for x in r) / total_s,
                 "generated_tokens_per_s": sum(x["generated_tokens"] for x in r) / total_s,
                 "engine_busy_fraction": statistics.fmean(x["busy"] for x in r),
                 "all_engines_busy_fraction": statistics.fmean(x["all_busy"] for x in r),
                 "mean_running_requests": statistics.fmean(x["mean_running"] for x in r),
                 "truncated_per_step": statistics.fmean(x["truncated"] for x in r), "steps": r}
        result["policies"][p] = entry
        print(f"{p:15s} {step:8.2f} {entry['speedup_vs_first_mean']:6.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
              f" {entry['steps_per_hour']:8.0f} {entry['trained_tokens_per_s']:14.1f}"
              f" {entry['generated_tokens_per_s']:16.1f} {entry['engine_busy_fraction']:6.2f}"
              f" {entry['all_engines_busy_fraction']:8.2f}"
              f" {entry['mean_running_requests']:8.1f} {entry['truncated_per_step']:9.1f}")
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def os_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
