"""What the VCPO cost scripts time: a decoder of Qwen3-like layer mix, a packed batch of
variable-length samples, and one training step (forward, loss, backward, gradient ready) of the
plain policy loss or of VCPO's loss side.

Attention is variable-length: every sample attends causally to its own tokens only (one scaled
dot-product call per sample, the FLOPs of a varlen kernel), never a dense T x T mask over the
packed stream. The variants of a step:

* ``plain``: the 16 samples packed into one micro-batch, the IS-weighted policy-gradient loss with
  the group-mean baseline (what VCPO is measured against);
* ``plain_single``: the same loss, one sample per micro-batch (what micro-batching alone costs);
* ``opob_single``: VCPO's loss side with one sample per micro-batch (norm read off the gradient
  buffer, two fused adds per sample, the group's baseline folded at its last sample);
* ``opob_packed``: VCPO's loss side on the packed micro-batch (layer hooks, per-sample gradients).

Shared by ``scripts/gpu_vcpo_bench.py`` (GPU), ``scripts/vcpo_overhead.py`` (CPU) and
``scripts/logprob_forward_cost.py`` (what slime's separate log-prob forward adds to a step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from april_slime.training.baseline import OpobAccumulator, OpobOptions, SampleGroups, opob_policy_loss
from april_slime.training.grad_norms import PerSampleGradNorms
from april_slime.training.offpolicy import Packing

__all__ = ["CONFIG", "CONFIGS", "VARIANTS", "Block", "Decoder", "StepRunner", "build", "make_batch", "one_step",
           "per_sample_log_probs", "plain_truncated_is_loss"]

VARIANTS = ("plain", "plain_single", "opob_single", "opob_packed")

# Qwen3-4B is d=2560, 36 layers, ff=9728, vocab 151936; these keep its proportions (ff ~ 4 d,
# vocab >> d) at sizes a 2-core CPU steps through in seconds.
CONFIGS = {
    "cpu_1k": dict(vocab=8192, d=256, layers=4, heads=4, ff=1024, tokens=1024, samples=4),
    "cpu_16k": dict(vocab=4096, d=128, layers=2, heads=2, ff=512, tokens=16384, samples=16),
    "tiny": dict(vocab=97, d=32, layers=2, heads=4, ff=64, tokens=96, samples=4),
    "0.5b": dict(vocab=50304, d=1024, layers=28, heads=16, ff=4096, tokens=16384, samples=16),
}
CONFIG = CONFIGS["cpu_1k"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv_q, self.qkv_k, self.qkv_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
        _, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(t, self.heads, d // self.heads) for m in (self.qkv_q, self.qkv_k, self.qkv_v))

        def heads(z, s, e):  # one sample's [heads, tokens, head dim], contiguous for the attention kernel
            return z[s:e].transpose(0, 1).contiguous()

        att = torch.cat([F.scaled_dot_product_attention(heads(q, s, e), heads(k, s, e), heads(v, s, e),
                                                        is_causal=True).transpose(0, 1)
                         for s, e in zip(cu[:-1], cu[1:])], dim=0)
        x = x + self.proj(att.reshape(1, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cu: list[int]) -> torch.Tensor:  # [1, T] -> [1, T, V]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cu)
        return self.head(self.norm(x))


def make_batch(cfg: dict, device, seed: int = 0):
    """(tokens [1, T], cu_seqlens, response mask [T], raw rewards [N]) of ``samples`` samples of
    random lengths packed into ``tokens`` positions; the second half of every sample is its response."""
    g = torch.Generator().manual_seed(seed)
    n, total = cfg["samples"], cfg["tokens"]
    cuts = sorted(torch.randperm(total - 8, generator=g)[: n - 1].add(4).tolist())
    cu = [0, *cuts, total]
    tokens = torch.randint(0, cfg["vocab"], (1, total), generator=g)
    resp = torch.zeros(total)
    for s, e in zip(cu[:-1], cu[1:]):
        resp[(s + e) // 2 + 1:e] = 1.0
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    return tokens.to(device), cu, resp.to(device), rewards.to(device)


def per_sample_log_probs(logits, tokens, resp, cu):
    lp = logits[0, :-1].float().log_softmax(-1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    lp = F.pad(lp, (1, 0))
    return [lp[s:e] for s, e in zip(cu[:-1], cu[1:])], [resp[s:e] for s, e in zip(cu[:-1], cu[1:])]


def plain_truncated_is_loss(lps, rollout, masks, advantages) -> torch.Tensor:
    """The loss VCPO's loss side is timed against: sequence-level IS weight truncated at 8 times the
    group-mean (GRPO) advantage, the per-trajectory token mean; no per-sample gradient norms."""
    log_ratio = torch.stack([((lp.detach() - r) * m).sum() for lp, r, m in zip(lps, rollout, masks)])
    w = log_ratio.exp().clamp(max=8.0)
    adv = advantages
    return sum(-(w[i] * adv[i]) * (lps[i] * masks[i]).sum() / masks[i].sum().clamp_min(1) for i in range(len(lps)))


class StepRunner:
    """One model, its batch and the batch's rollout log-probs (the model's own, perturbed: off-policy
    data), and the hooks and buffers VCPO's variants keep across steps."""

    def __init__(self, model: Decoder, batch, options: OpobOptions = OpobOptions()):
        self.model, self.batch, self.options = model, batch, options
        tokens, cu, resp, rewards = batch
        with torch.no_grad():
            lps, _ = per_sample_log_probs(model(tokens, cu), tokens, resp, cu)
        g = torch.Generator().manual_seed(0)
        self.rollout = [lp + 0.05 * torch.randn(lp.shape, generator=g).to(lp) for lp in lps]
        self.reward_std = float(rewards.std(unbiased=False))
        self._opob: OpobAccumulator | None = None

    def prepare(self, variant: str) -> None:
        """Attach VCPO's layer hooks for an ``opob`` variant, remove them otherwise (a job attaches
        them once: not part of a step's time)."""
        if variant.startswith("opob") and self._opob is None:
            self._opob = OpobAccumulator(PerSampleGradNorms(self.model, weighted=True), list(self.model.parameters()),
                                         self.options)
        elif not variant.startswith("opob"):
            self.close()

    def close(self) -> None:
        if self._opob is not None:
            self._opob.grad_norms.remove()
            self._opob = None

    def step(self, variant: str) -> None:
        """Forward, loss and backward of one optimizer step's samples; the gradient is ready after.
        Call ``prepare(variant)`` first."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
        tokens, cu, resp, rewards = self.batch
        n = rewards.numel()
        self.model.zero_grad(set_to_none=False)
        if variant.endswith("_single"):
            parts = [(tokens[:, s:e], [0, e - s], resp[s:e], [i]) for i, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
        else:
            parts = [(tokens, cu, resp, list(range(n)))]
        opob = self._opob if variant.startswith("opob") else None
        if variant.startswith("opob") and opob is None:
            raise RuntimeError("call prepare() before an opob step")
        if opob is not None:
            opob.begin_step()
        for tok, cu_mb, resp_mb, rows in parts:
            lps, masks = per_sample_log_probs(self.model(tok, cu_mb), tok, resp_mb, cu_mb)
            rollout = [self.rollout[i] for i in rows]
            if opob is None:
                plain_truncated_is_loss(lps, rollout, masks, (rewards - rewards.mean())[rows]).backward()
                continue
            # the step's samples are one prompt group (std-normalised group baseline, the released recipe)
            groups = SampleGroups([0] * len(rows), [n] * len(rows), [self.reward_std] * len(rows))
            segments = Packing.from_cu_seqlens(cu_mb).packed_segment_ids(tok.shape[1])
            opob_policy_loss(lps, rollout, masks, rewards[rows], segments, accumulator=opob, groups=groups,
                             options=self.options).loss.backward()
        if opob is not None:
            opob.finish()


def one_step(variant: str, runner: StepRunner) -> None:
    runner.prepare(variant)
    runner.step(variant)


def build(config: dict = CONFIG, seed: int = 0, device="cpu", dtype=torch.float32) -> StepRunner:
    torch.manual_seed(seed)
    model = Decoder(config["vocab"], config["d"], config["layers"], config["heads"], config["ff"])
    model = model.to(device=device, dtype=dtype)
    return StepRunner(model, make_batch(config, device, seed))
