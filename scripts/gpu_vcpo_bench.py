#!/usr/bin/env python
"""Step time and peak memory of the VCPO loss side against a plain policy loss.

Three variants of one training micro-batch (forward + loss + backward) on a random-init decoder
(~0.45B parameters in bf16 by default) with packed variable-length samples:

  plain       IS-weighted policy-gradient loss, ordinary backward
  norms       + exact per-sample gradient norms from the layer hooks (no second buffer)
  opob        + the weighted second buffer and the baseline combination (VCPO's full loss side)

Timing uses CUDA events after warm-up; memory is torch.cuda.max_memory_allocated per variant.
Prints a table and writes JSON. ``--tiny --device cpu`` runs a toy configuration anywhere
(wall-clock timing, no memory numbers).

    python scripts/gpu_vcpo_bench.py --out vcpo_bench.json
    python scripts/gpu_vcpo_bench.py --tiny --device cpu --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

from april_slime.training.baseline import finish_opob_step, opob_policy_loss
from april_slime.training.grad_norms import PerSampleGradNorms
from april_slime.workbench.vcpo_timing import Decoder, make_batch, per_sample_log_probs, plain_truncated_is_loss

CONFIGS = {
    "0.5b": dict(vocab=50304, d=1024, layers=28, heads=16, ff=4096, tokens=4096, samples=8),
    "tiny": dict(vocab=97, d=32, layers=2, heads=4, ff=64, tokens=96, samples=4),
}


def run_variant(name, model, batch, steps, warmup, device):
    tokens, seg, mask, resp, cu, rewards = batch
    tracker = None
    if name != "plain":
        tracker = PerSampleGradNorms(model, weighted=(name == "opob"))
    cuda = torch.device(device).type == "cuda"
    times = []
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
        for it in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            logits = model(tokens, mask)
            lps, masks = per_sample_log_probs(logits, tokens, resp, cu)
            with torch.no_grad():
                rollout = [lp.detach() + 0.05 * torch.randn_like(lp) for lp in lps]
            if name == "plain":
                plain_truncated_is_loss(lps, rollout, masks, rewards).backward()
            else:
                out = opob_policy_loss(lps, rollout, masks, rewards, seg, grad_norms=tracker,
                                       correction="truncate", high=2.0)
                out.loss.backward()
                if name == "opob":
                    finish_opob_step(tracker, model.parameters())
                else:
                    tracker.reset()
            if cuda:
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end) / 1000.0
            else:
                elapsed = time.perf_counter() - t0
            if it >= warmup:
                times.append(elapsed)
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if cuda else None
    finally:
        if tracker is not None:
            tracker.remove()
    return {"variant": name, "step_s_median": statistics.median(times), "step_s_min": min(times),
            "peak_extra_gib": peak}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy model (runs on CPU in seconds)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=None, help="packed tokens per micro-batch")
    ap.add_argument("--samples", type=int, default=None, help="samples per micro-batch")
    ap.add_argument("--out", default="vcpo_bench.json")
    args = ap.parse_args(argv)

    cfg = dict(CONFIGS["tiny" if args.tiny else "0.5b"])
    if args.tokens:
        cfg["tokens"] = args.tokens
    if args.samples:
        cfg["samples"] = args.samples
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    model = Decoder(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["ff"]).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    batch = make_batch(cfg, device)
    rows = [run_variant(v, model, batch, args.steps, args.warmup, device) for v in ("plain", "norms", "opob")]
    plain = rows[0]["step_s_median"]
    for r in rows:
        r["time_vs_plain"] = r["step_s_median"] / plain if plain > 0 else math.nan

    print(f"params={n_params / 1e6:.1f}M dtype={dtype} device={device} tokens={cfg['tokens']} "
          f"samples={cfg['samples']} steps={args.steps} warmup={args.warmup}")
    print(f"{'variant':<8} {'median s':>10} {'min s':>10} {'x plain':>8} {'peak extra GiB':>15}")
    for r in rows:
        peak = "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        print(f"{r['variant']:<8} {r['step_s_median']:>10.4f} {r['step_s_min']:>10.4f} "
              f"{r['time_vs_plain']:>8.2f} {peak:>15}")
    result = {"config": cfg, "params": n_params, "dtype": str(dtype), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
