#!/usr/bin/env python
"""What slime's separate log-prob forward costs relative to a training step, on CPU.

slime recomputes the log-probs of every sample with one no-grad forward before the step unless
``--use-rollout-logprobs`` is set (or ``--loss-type policy_loss`` lets it reuse the training
forward). This measures, interleaved in one run on the decoder of scripts/vcpo_overhead.py, the
step (forward + loss + backward) and that extra forward, and reports the step time with the
recompute relative to the step without it.

    python scripts/logprob_forward_cost.py --out docs/results/logprob_forward_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from april_workbench.vcpo_timing import CONFIG, build, per_sample_log_probs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = build()
    tokens, cu, resp, _ = runner.batch
    runner.prepare("plain")
    step_t, fwd_t = [], []
    for it in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            per_sample_log_probs(runner.model(tokens, cu), tokens, resp, cu)
        t1 = time.perf_counter()
        runner.step("plain")
        t2 = time.perf_counter()
        if it >= args.warmup:
            fwd_t.append(t1 - t0)
            step_t.append(t2 - t1)
    ratios = [(s + f) / s for s, f in zip(step_t, fwd_t)]
    result = {"config": CONFIG, "threads": args.threads, "steps": args.steps,
              "step_s_median": statistics.median(step_t), "logprob_forward_s_median": statistics.median(fwd_t),
              "step_with_recompute_ratio": statistics.median(ratios), "band": [min(ratios), max(ratios)]}
    print(f"training step {result['step_s_median']:.3f}s  log-prob forward {result['logprob_forward_s_median']:.3f}s  "
          f"step with the recompute / without: {result['step_with_recompute_ratio']:.3f} "
          f"(band {min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
