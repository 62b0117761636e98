#!/usr/bin/env python
"""CPU cost of VCPO's loss side against a packed variable-length plain step, as ratios in one run.

The variants of ``april_workbench.vcpo_timing`` (one optimizer step's forward, loss and
backward until the gradient is ready) on one decoder of Qwen3-like proportions and one batch of
``samples`` variable-length samples packed into ``tokens`` positions:

  plain         packed micro-batch, varlen attention, IS-weighted loss with the group-mean baseline
  plain_single  the same loss, one sample per micro-batch
  opob_single   VCPO: one sample per micro-batch, norm off the gradient buffer, two fused adds
  opob_packed   VCPO: the packed micro-batch, layer hooks (per-sample gradients)

Every repetition runs all variants back to back in a rotating order (interleaved: a drift of the
shared machine hits every variant), after ``--warmup`` unmeasured repetitions; each variant's ratio
to ``plain`` is taken within its repetition, and the median and the band (min-max over
repetitions) of those ratios are reported. ``--clock cpu`` (the default) times the process's CPU
seconds (user + system, ``time.process_time``) instead of wall seconds: on a machine shared with
other jobs the wall clock also counts the time the step waited for a core, the CPU clock only the
work (run it with ``--threads 1``, so that no thread spins while another works). Both clocks are
recorded either way. ``--memory`` adds each variant's peak RSS, measured in a fresh child process.

    python scripts/vcpo_overhead.py --config cpu_16k --memory --out docs/results/vcpo_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from april_workbench.vcpo_timing import CONFIGS, VARIANTS, build


def commit() -> str | None:
    """The repository's commit, with ``+dirty`` when the work tree has changes."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def memory_child(config_name, variant, threads, queue):
    torch.set_num_threads(threads)
    runner = build(CONFIGS[config_name])
    runner.prepare(variant)
    runner.step(variant)  # first-touch allocations
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak resident set size
        f.write("5")
    before = _status_kib("VmRSS")
    runner.step(variant)
    queue.put({"rss_before_mib": before / 1024, "peak_rss_mib": _status_kib("VmHWM") / 1024})


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu_16k", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=5, help="measured repetitions")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="what the ratios are taken of")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--memory", action="store_true", help="also peak RSS per variant (child processes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if "plain" not in args.variants:
        ap.error("the ratios are to the plain variant: keep it in --variants")
    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    runner = build(cfg)
    n_params = sum(p.numel() for p in runner.model.parameters())
    times = {v: [] for v in args.variants}
    other = {v: [] for v in args.variants}  # the clock the ratios are not taken of
    ratios = {v: [] for v in args.variants}
    started, load_start = time.time(), os.getloadavg()[0]
    for rep in range(args.warmup + args.steps):
        order = args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]
        this = {}
        that = {}
        for variant in order:
            runner.prepare(variant)
            w0, c0 = time.perf_counter(), time.process_time()
            runner.step(variant)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            this[variant], that[variant] = (cpu, wall) if args.clock == "cpu" else (wall, cpu)
        runner.prepare("plain")
        if rep >= args.warmup:
            for v, t in this.items():
                times[v].append(t)
                other[v].append(that[v])
                ratios[v].append(t / this["plain"])
        print(f"rep {rep}{' (warm-up)' if rep < args.warmup else ''}: "
              + "  ".join(f"{v} {this[v]:.2f}s" for v in args.variants), flush=True)

    memory = {}
    if args.memory:
        ctx = mp.get_context("spawn")
        for variant in args.variants:
            q = ctx.Queue()
            proc = ctx.Process(target=memory_child, args=(args.config, variant, args.threads, q))
            proc.start()
            memory[variant] = q.get(timeout=1800)
            proc.join()

    rows = []
    for v in args.variants:
        row = {"variant": v, "step_s_median": statistics.median(times[v]),
               "other_clock_step_s_median": statistics.median(other[v]),
               "ratio_to_plain_median": statistics.median(ratios[v]),
               "ratio_to_plain_band": [min(ratios[v]), max(ratios[v])]}
        if v in memory:
            row.update(memory[v])
            row["peak_rss_ratio_to_plain"] = memory[v]["peak_rss_mib"] / memory["plain"]["peak_rss_mib"]
        rows.append(row)
    result = {"commit": commit(), "config_name": args.config, "config": cfg, "params_m": n_params / 1e6,
              "clock": args.clock, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "load_average_start_end": [load_start, os.getloadavg()[0]], "wall_s": time.time() - started,
              "rows": rows, "command": " ".join(["python", "scripts/" + Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(f"params={n_params / 1e6:.2f}M tokens={cfg['tokens']} samples={cfg['samples']} threads={args.threads} "
          f"clock={args.clock} commit={result['commit']}")
    for r in rows:
        lo, hi = r["ratio_to_plain_band"]
        mem = f"  peak RSS x{r['peak_rss_ratio_to_plain']:.3f}" if "peak_rss_ratio_to_plain" in r else ""
        print(f"{r['variant']:<13} {r['step_s_median']:8.2f}s  x{r['ratio_to_plain_median']:.3f} "
              f"(band {lo:.3f}-{hi:.3f}){mem}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
