"""What the VCPO cost scripts time: a decoder of Qwen3-like layer mix, a packed batch of
variable-length samples, and one training step of the plain policy loss or of VCPO's loss side.

Shared by ``scripts/gpu_vcpo_bench.py`` (GPU step time and memory), ``scripts/vcpo_overhead.py``
(CPU step time and memory) and ``scripts/logprob_forward_cost.py`` (what slime's separate log-prob
forward adds to a step); ``CONFIG`` / ``build`` / ``one_step`` are the CPU-sized setup of the last two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from april_slime.training.baseline import finish_opob_step, opob_policy_loss
from april_slime.training.offpolicy import Packing

__all__ = ["CONFIG", "Block", "Decoder", "build", "make_batch", "one_step", "per_sample_log_probs",
           "plain_truncated_is_loss"]


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


# Qwen3-4B is d=2560, 36 layers, ff=9728, vocab 151936, responses of thousands of tokens; this
# keeps its proportions (ff ~ 4 d, vocab >> d, samples of hundreds of tokens) at CPU size.
CONFIG = dict(vocab=8192, d=256, layers=4, heads=4, ff=1024, tokens=1024, samples=4)


def one_step(variant, model, batch, tracker):
    tokens, seg, mask, resp, cu, rewards = batch
    model.zero_grad(set_to_none=False)
    logits = model(tokens, mask)
    lps, masks = per_sample_log_probs(logits, tokens, resp, cu)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        rollout = [lp.detach() + 0.05 * torch.randn(lp.shape, generator=g) for lp in lps]
    if variant == "plain":
        plain_truncated_is_loss(lps, rollout, masks, rewards).backward()
    else:
        out = opob_policy_loss(lps, rollout, masks, rewards, seg, grad_norms=tracker, correction="truncate",
                               high=2.0)
        out.loss.backward()
        finish_opob_step(tracker, model.parameters())


def build(seed=0):
    torch.manual_seed(seed)
    cfg = CONFIG
    model = Decoder(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["ff"])
    return model, make_batch(cfg, "cpu")
