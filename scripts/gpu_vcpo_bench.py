#!/usr/bin/env python
"""GPU step time and peak memory of VCPO's loss side against a packed variable-length plain step.

The variants of ``april_workbench.vcpo_timing`` on a random-init decoder (~0.45B parameters
in bf16 by default) with ``--samples`` variable-length samples packed into ``--tokens`` positions,
attention per sample (the FLOPs of a varlen kernel, no dense T x T mask):

  plain         packed micro-batch, IS-weighted loss with the group-mean baseline (the reference)
  plain_single  the same loss, one sample per micro-batch (what micro-batching alone costs)
  opob_single   VCPO: one sample per micro-batch, norm off the gradient buffer, two fused adds
  opob_packed   VCPO: the packed micro-batch, layer hooks (per-sample gradients)

Timing: CUDA events, every repetition runs all variants in a rotating order after ``--warmup``
unmeasured repetitions; each ratio to ``plain`` is taken within its repetition (median and band).
Memory: torch.cuda.max_memory_allocated minus what was allocated before the step, per variant.
The JSON records the commit, the GPU and torch. ``--tiny --device cpu`` runs a toy configuration
anywhere (wall-clock timing, no memory numbers).

    python scripts/gpu_vcpo_bench.py --out vcpo_bench_16k.json                        # 16384 x 16
    python scripts/gpu_vcpo_bench.py --tokens 4096 --samples 8 --out vcpo_bench_4k.json
    python scripts/gpu_vcpo_bench.py --tiny --device cpu --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vcpo_overhead import commit  # noqa: E402

from april_workbench.vcpo_timing import CONFIGS, VARIANTS, build  # noqa: E402


def timed_step(runner, variant, device) -> tuple[float, float | None]:
    runner.prepare(variant)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.step(variant)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0, (torch.cuda.max_memory_allocated() - base) / 2**30
    t0 = time.perf_counter()
    runner.step(variant)
    return time.perf_counter() - t0, None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy model (runs on CPU in seconds)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=None, help="packed tokens per optimizer step")
    ap.add_argument("--samples", type=int, default=None, help="samples per optimizer step")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default="vcpo_bench.json")
    args = ap.parse_args(argv)

    cfg = dict(CONFIGS["tiny" if args.tiny else "0.5b"])
    if args.tokens:
        cfg["tokens"] = args.tokens
    if args.samples:
        cfg["samples"] = args.samples
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    runner = build(cfg, device=device, dtype=dtype)
    n_params = sum(p.numel() for p in runner.model.parameters())
    times = {v: [] for v in args.variants}
    peaks = {v: [] for v in args.variants}
    ratios = {v: [] for v in args.variants}
    for rep in range(args.warmup + args.steps):
        k = rep % len(args.variants)
        this = {}
        for variant in args.variants[k:] + args.variants[:k]:
            this[variant], peak = timed_step(runner, variant, device)
            if rep >= args.warmup and peak is not None:
                peaks[variant].append(peak)
        if rep >= args.warmup:
            for v, t in this.items():
                times[v].append(t)
                ratios[v].append(t / this["plain"] if "plain" in this else float("nan"))
    rows = [{"variant": v, "step_s_median": statistics.median(times[v]), "step_s_min": min(times[v]),
             "ratio_to_plain_median": statistics.median(ratios[v]),
             "ratio_to_plain_band": [min(ratios[v]), max(ratios[v])],
             "peak_extra_gib": max(peaks[v]) if peaks[v] else None} for v in args.variants]

    print(f"params={n_params / 1e6:.1f}M dtype={dtype} device={device} tokens={cfg['tokens']} "
          f"samples={cfg['samples']} steps={args.steps} warmup={args.warmup} commit={commit()}")
    print(f"{'variant':<13} {'median s':>10} {'x plain':>8} {'band':>13} {'peak extra GiB':>15}")
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        lo, hi = r["ratio_to_plain_band"]
        print(f"{r['variant']:<13} {r['step_s_median']:>10.4f} {r['ratio_to_plain_median']:>8.3f} "
              f"{lo:>6.3f}-{hi:<6.3f} {peak:>15}")
    result = {"commit": commit(), "config": cfg, "params": n_params, "dtype": str(dtype), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
              "baseline": "plain: packed micro-batch, per-sample (varlen) causal attention", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
