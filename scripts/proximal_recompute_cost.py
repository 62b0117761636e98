#!/usr/bin/env python
"""What skipping slime's log-prob recompute saves, measured through slime's own trainer actor on CPU.

The training tier's setup (tests/support/training/slime_cpu.py: slime at the pinned commit with
the repository's patches, Megatron's DDP, optimizer and schedule on gloo) runs
``MegatronTrainRayActor.train_actor`` for one rollout of decoupled PPO with one optimizer step,
alternately with ``april_prox_log_probs: recompute`` (slime's separate log-prob forward, then the
step) and ``auto`` (the custom loss takes the proximal log-probs from its training forward;
patches/slime-skip-proximal-recompute.patch lets slime skip the recompute). Each repetition runs
both, in alternating order, after ``--warmup`` unmeasured ones; reported: the median and band of
the per-repetition ratio of train_actor's CPU seconds (``time.process_time``, one thread: a loaded
machine does not inflate it the way it inflates wall time; ``--clock wall`` for wall seconds),
recompute / auto, and slime's own (wall-clock) timers of that rollout (``perf/log_probs_time``,
``perf/actor_train_time``).

The model is the training tier's token-wise model, made deeper and wider so that compute, not
Python, dominates (``--dim``, ``--depth``); a transformer's forward is a larger share of its step.

    python scripts/proximal_recompute_cost.py --out docs/results/proximal_recompute_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

DECOUPLED = dict(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
                 april_is_mode="decoupled", april_is_level="token", april_is_correction="truncate",
                 april_is_low=0.0, april_is_high=2.0, april_loss_level="token")


def one_rollout(sc, args, dim, depth, prompts, per_prompt, max_response):
    model = sc.GPTLikeLM(seed=0, dim=dim, depth=depth)
    ddp, optimizer, scheduler = sc.megatron_trainer(model, "sgd", 0.01)
    data = sc.rollout_to_trainer(args, sc.make_stale_samples(model, num_prompts=prompts, per_prompt=per_prompt,
                                                             max_response=max_response))
    w0, c0 = time.perf_counter(), time.process_time()
    logged = sc.train_actor(args, ddp, optimizer, scheduler, data)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    perf = next(line for line in logged if "perf/actor_train_time" in line)
    return {"wall": wall, "cpu": cpu}, "log_probs" in data, perf


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    from vcpo_overhead import commit

    from tests.support.training import megatron_cpu
    from tests.support.training import slime_cpu as sc

    n = args.prompts * args.per_prompt
    job = dict(DECOUPLED, **sc.ACTOR_ARGS, rollout_batch_size=args.prompts, n_samples_per_prompt=args.per_prompt,
               global_batch_size=n, micro_batch_size=args.per_prompt)
    walls = {"recompute": [], "auto": []}
    perf = {"recompute": [], "auto": []}
    ratios = []
    with sc.gloo_world(), megatron_cpu.ddp_and_optimizer_on_cpu():
        for rep in range(args.warmup + args.steps):
            order = ("recompute", "auto") if rep % 2 == 0 else ("auto", "recompute")
            this = {}
            for mode in order:
                clocks, recomputed, line = one_rollout(sc, sc.make_args(**job, april_prox_log_probs=mode), args.dim,
                                                     args.depth, args.prompts, args.per_prompt, args.max_response)
                assert recomputed == (mode == "recompute"), (mode, recomputed)
                this[mode] = (clocks[args.clock], line)
            print(f"rep {rep}{' (warm-up)' if rep < args.warmup else ''}: "
                  + "  ".join(f"{m} {this[m][0]:.2f}s" for m in ("recompute", "auto")), flush=True)
            if rep >= args.warmup:
                for m in this:
                    walls[m].append(this[m][0])
                    perf[m].append({k: this[m][1][k] for k in ("perf/actor_train_time", "perf/log_probs_time")
                                    if k in this[m][1]})
                ratios.append(this["recompute"][0] / this["auto"][0])
    log_probs = [p["perf/log_probs_time"] for p in perf["recompute"]]
    train_r = [p["perf/actor_train_time"] for p in perf["recompute"]]
    result = {
        "commit": commit(), "clock": args.clock, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
        "model": {"dim": args.dim, "depth": args.depth, "vocab": sc.VOCAB}, "samples": n,
        "max_response": args.max_response,
        "train_actor_s_median": {m: statistics.median(v) for m, v in walls.items()},
        "recompute_over_auto_median": statistics.median(ratios), "band": [min(ratios), max(ratios)],
        "slime_log_probs_s_median": statistics.median(log_probs),
        "slime_actor_train_s_median_with_recompute": statistics.median(train_r),
        "command": " ".join(["python", "scripts/proximal_recompute_cost.py", *(argv or sys.argv[1:])]),
    }
    print(f"train_actor: recompute {result['train_actor_s_median']['recompute']:.2f}s  auto "
          f"{result['train_actor_s_median']['auto']:.2f}s  ratio {result['recompute_over_auto_median']:.3f} "
          f"(band {min(ratios):.3f}-{max(ratios):.3f}); slime's timers: log_probs "
          f"{result['slime_log_probs_s_median']:.2f}s, actor_train "
          f"{result['slime_actor_train_s_median_with_recompute']:.2f}s  commit={result['commit']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
