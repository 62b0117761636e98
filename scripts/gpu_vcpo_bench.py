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
import torch.nn.functional as F
from torch import nn

from april_slime.training.offpolicy import Packing
from april_slime.vcpo import PerSampleGradNorms, finish_opob_step, opob_policy_loss


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv_q, self.qkv_k, self.qkv_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for m in (self.qkv_q, self.qkv_k, self.qkv_v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.norm(x))


CONFIGS = {
    "0.5b": dict(vocab=50304, d=1024, layers=28, heads=16, ff=4096, tokens=4096, samples=8),
    "tiny": dict(vocab=97, d=32, layers=2, heads=4, ff=64, tokens=96, samples=4),
}


def make_batch(cfg: dict, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, total = cfg["samples"], cfg["tokens"]
    cuts = sorted(torch.randperm(total - 8, generator=g)[: n - 1].add(4).tolist())
    cu = [0, *cuts, total]
    tokens = torch.randint(0, cfg["vocab"], (1, total), generator=g)
    seg = Packing.from_cu_seqlens(cu).packed_segment_ids(total)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    mask = causal & (seg[:, None] == seg[None, :])
    # responses: the second half of every sample
    resp = torch.zeros(total)
    for s, e in zip(cu[:-1], cu[1:]):
        resp[(s + e) // 2 + 1:e] = 1.0
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    return (tokens.to(device), seg.to(device), mask.to(device)[None, None], resp.to(device), cu,
            rewards.to(device))


def plain_truncated_is_loss(lps, rollout, masks, rewards) -> torch.Tensor:
    """The baseline the VCPO loss side is timed against: sequence-level IS weight truncated at 2,
    group-mean baseline, no per-sample gradient norms."""
    log_ratio = torch.stack([((lp.detach() - r) * m).sum() for lp, r, m in zip(lps, rollout, masks)])
    w = log_ratio.exp().clamp(max=2.0)
    adv = rewards - rewards.mean()
    return sum(-(w[i] * adv[i]) * (lps[i] * masks[i]).sum() for i in range(len(lps)))


def per_sample_log_probs(logits, tokens, resp, cu):
    lp = logits[0, :-1].float().log_softmax(-1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    lp = F.pad(lp, (1, 0))
    return [lp[s:e] for s, e in zip(cu[:-1], cu[1:])], [resp[s:e] for s, e in zip(cu[:-1], cu[1:])]


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
