#!/usr/bin/env python
"""CPU overhead of VCPO's per-sample gradient norms: step time and peak memory, plain vs hooked.

One run measures both variants on the same scaled-down decoder of realistic shape (the layer
mix and proportions of a Qwen3-style model: RMSNorm, q/k/v/o projections, an up/down MLP four
times wider, untied embedding and lm head; packed variable-length samples) and reports the
ratios hooked / plain:

* step time: forward + loss + backward (+ the baseline combination for ``opob``), median of
  ``--steps`` interleaved repetitions after warm-up (plain and hooked alternate, so drifts of a
  shared machine hit both);
* peak memory: each variant in a fresh child process; after one unmeasured step the peak
  resident set size is reset (Linux ``/proc/self/clear_refs``) and read again after the
  measured steps (``VmHWM``); reported whole and as the step's extra over the resident size
  before the measured steps (model, gradients, second buffer, batch).

Variants: ``plain`` (IS-weighted policy-gradient loss, ordinary backward), ``opob`` (VCPO's
full loss side: exact per-sample norms, the weighted second buffer and ``Q - b P``).

    python scripts/vcpo_overhead.py --out docs/vcpo_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch

from april_slime.training.grad_norms import PerSampleGradNorms
from april_slime.workbench.vcpo_timing import CONFIG, build, one_step


def memory_child(variant, steps, queue):
    torch.set_num_threads(int(os.environ.get("VCPO_OVERHEAD_THREADS", "2")))
    model, batch = build()
    tracker = PerSampleGradNorms(model, weighted=True) if variant == "opob" else None
    for p in model.parameters():  # gradients exist in both variants before measuring
        p.grad = torch.zeros_like(p)
    one_step(variant, model, batch, tracker)  # first-touch allocations of both variants alike
    _reset_peak_rss()
    before_kib = _status_kib("VmRSS")
    for _ in range(steps):
        one_step(variant, model, batch, tracker)
    peak_kib = _status_kib("VmHWM")
    queue.put({"variant": variant, "rss_before_mib": before_kib / 1024, "peak_rss_mib": peak_kib / 1024,
               "peak_extra_mib": (peak_kib - before_kib) / 1024})


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["VCPO_OVERHEAD_THREADS"] = str(args.threads)

    model, batch = build()
    n_params = sum(p.numel() for p in model.parameters())
    tracker = PerSampleGradNorms(model, weighted=True)
    tracker.remove()  # re-attached around each hooked step
    times = {"plain": [], "opob": []}
    for it in range(args.warmup + args.steps):
        for variant in ("plain", "opob"):
            t = PerSampleGradNorms(model, weighted=True) if variant == "opob" else None
            t0 = time.perf_counter()
            one_step(variant, model, batch, t)
            elapsed = time.perf_counter() - t0
            if t is not None:
                t.remove()
            if it >= args.warmup:
                times[variant].append(elapsed)

    ctx = mp.get_context("spawn")
    memory = {}
    for variant in ("plain", "opob"):
        q = ctx.Queue()
        proc = ctx.Process(target=memory_child, args=(variant, 2, q))
        proc.start()
        memory[variant] = q.get(timeout=600)
        proc.join()

    plain_t, opob_t = statistics.median(times["plain"]), statistics.median(times["opob"])
    ratios = [o / p for o, p in zip(times["opob"], times["plain"])]
    result = {
        "config": CONFIG, "params_m": n_params / 1e6, "threads": args.threads, "steps": args.steps,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "step_s_median": {"plain": plain_t, "opob": opob_t},
        "step_time_ratio": opob_t / plain_t,
        "step_time_ratio_band": [min(ratios), max(ratios)],
        "memory": memory,
        "peak_rss_ratio": memory["opob"]["peak_rss_mib"] / memory["plain"]["peak_rss_mib"],
        "peak_extra_ratio": memory["opob"]["peak_extra_mib"] / memory["plain"]["peak_extra_mib"],
    }
    print(f"params={n_params / 1e6:.1f}M tokens={CONFIG['tokens']} samples={CONFIG['samples']} "
          f"threads={args.threads}")
    print(f"step time  plain {plain_t:.3f}s  opob {opob_t:.3f}s  ratio {result['step_time_ratio']:.3f} "
          f"(per-repetition band {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"peak RSS   plain {memory['plain']['peak_rss_mib']:.0f} MiB  opob {memory['opob']['peak_rss_mib']:.0f} MiB  "
          f"ratio {result['peak_rss_ratio']:.3f}  (step's extra over the resident model: "
          f"{result['peak_extra_ratio']:.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
