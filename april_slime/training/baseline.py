"""VCPO's off-policy optimal baseline (OPOB), applied by linearity after the one backward pass.

``b = sum_i w_i^2 R_i ||g_i||^2 / sum_i w_i^2 ||g_i||^2`` with ``g_i = grad log pi(y_i|x_i)`` (the score
of the whole sequence: token log-probs summed), paper eq. 7 / 13 (Huang et al., "Stable Asynchrony:
Variance-Controlled Off-Policy RL for LLMs"). ``opob_policy_loss`` is the loss side of one
micro-batch: autograd accumulates ``P = sum_i w_i grad(-log pi_i)`` into the parameters' gradients
while the hooks of ``PerSampleGradNorms`` accumulate ``Q = sum_i R_i w_i grad(-log pi_i)`` and the
exact per-sample norms; ``finish_opob_step`` then forms ``b`` across ranks and sets every gradient
to ``Q - b P`` (eq. 8). No second backward pass is run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from april_slime.training import offpolicy
from april_slime.training.grad_norms import PerSampleGradNorms, group_active

__all__ = ["OpobResult", "finish_opob_step", "opob_baseline", "opob_policy_loss"]


def opob_baseline(num: torch.Tensor | float | None, den: torch.Tensor | float | None,
                  group=None, device=None) -> tuple[float, float, float]:
    """``b = num / den`` after summing both over ``group`` (every rank of the training job: data
    parallel ranks add their samples, TP/PP ranks their parameter shards -- the sums are linear
    in the per-sample squared norms). Returns ``(b, num, den)``; ``b = 0`` when ``den == 0`` (every
    weighted gradient is zero, so the baseline has nothing to act on)."""
    device = offpolicy.collective_device(group, device)
    vals = torch.tensor([float(num or 0.0), float(den or 0.0)], dtype=torch.float64, device=device)
    if group_active(group):
        dist.all_reduce(vals, op=dist.ReduceOp.SUM, group=group)
    num_g, den_g = float(vals[0]), float(vals[1])
    if not (math.isfinite(num_g) and math.isfinite(den_g)):
        raise FloatingPointError(f"non-finite OPOB sums num={num_g} den={den_g}")
    return (num_g / den_g if den_g > 0 else 0.0), num_g, den_g


@dataclass
class OpobResult:
    loss: torch.Tensor            # sum_i w_i * (-log pi(y_i|x_i)): what autograd differentiates
    is_weights: torch.Tensor      # [N] w_i used as coefficients (after truncation / masking)
    seq_log_ratios: torch.Tensor  # [N] unclipped log pi_theta(y_i|x_i) - log mu(y_i|x_i), for the ESS
    rewards: torch.Tensor         # [N] R_i
    keep: torch.Tensor            # [N] 0.0 where masking (MIS) removed the sample
    truncated: torch.Tensor       # [N] 1.0 where truncation (TIS) changed the weight
    packing: offpolicy.Packing    # layout of the samples' response tokens


def opob_policy_loss(log_probs: Sequence[torch.Tensor], rollout_log_probs: Sequence[torch.Tensor],
                     loss_masks: Sequence[torch.Tensor], rewards: torch.Tensor | Sequence[float],
                     segment_ids: torch.Tensor, *, grad_norms: PerSampleGradNorms | None = None,
                     correction: str = "truncate", low: float = 0.0, high: float = 2.0) -> OpobResult:
    """Loss side of VCPO for one micro-batch (paper eq. 9 without the baseline term).

    Returns ``loss = sum_i w_i * (-sum_t mask_t log pi_t)`` -- differentiate it once; its gradient
    is the score buffer ``P``. ``w_i`` is the sequence-level importance weight
    ``pi_theta(y_i|x_i) / mu(y_i|x_i)`` corrected by ``offpolicy.correct_log_weights`` (``truncate``
    = TIS, ``mask`` = MIS, ``none``; bounds ``[low, high]``). With ``grad_norms`` (``weighted=True``)
    the micro-batch is registered so that the backward hooks accumulate
    ``Q = sum_i R_i w_i grad(-log pi_i)`` and the OPOB sums; ``finish_opob_step`` then turns the
    gradients into ``Q - b P``, the gradient of ``sum_i w_i (R_i - b)(-log pi_i)``. The unclipped
    sequence log-ratios come back in ``seq_log_ratios`` for the ESS learning-rate scaler.

    ``log_probs`` are the training forward's per-token log-probs of each sample's response (with
    grad); ``rollout_log_probs`` the behaviour log-probs (a resumed sample's concatenation over its
    generation stages, so the ratio is against the policies that actually produced it);
    ``segment_ids`` map every token of the layers' activations to its sample (-1 = none).
    """
    n = len(log_probs)
    if not (len(rollout_log_probs) == n == len(loss_masks)):
        raise ValueError("log_probs, rollout_log_probs and loss_masks must have one entry per sample")
    for i, (lp, rlp, m) in enumerate(zip(log_probs, rollout_log_probs, loss_masks)):
        if lp.shape != rlp.shape or lp.shape != m.shape:
            raise ValueError(f"sample {i}: log_probs {tuple(lp.shape)}, rollout_log_probs "
                             f"{tuple(rlp.shape)} and loss_mask {tuple(m.shape)} differ in length")
    if n == 0:
        raise ValueError("empty micro-batch")
    if isinstance(rewards, (list, tuple)):
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float64).reshape(()) for r in rewards])
    rewards = torch.as_tensor(rewards).detach().reshape(-1)
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} samples")
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")

    current, packing = offpolicy.pack(list(log_probs))
    rollout = torch.cat([r.detach() for r in rollout_log_probs]).to(device=current.device, dtype=torch.float64)
    mask = torch.cat(list(loss_masks)).to(current.device)
    clean = offpolicy.check_finite({"log_probs": current, "rollout_log_probs": rollout}, mask, packing)
    current = clean["log_probs"]
    log_ratio = offpolicy.sequence_log_weights(
        offpolicy.masked_log_ratio(current.detach().to(torch.float64), clean["rollout_log_probs"], mask),
        packing, mask)
    weights = offpolicy.correct_log_weights(log_ratio, correction, low, high)
    if grad_norms is not None:
        grad_norms.set_microbatch(segment_ids, n, rewards.to(torch.float64))
    nll = -packing.sum(current * mask.to(current.dtype))
    loss = (nll * weights.weights.to(current.dtype)).sum()
    return OpobResult(loss, weights.weights, log_ratio, rewards, weights.keep, weights.truncated, packing)


def finish_opob_step(grad_norms: PerSampleGradNorms, params: Iterable[nn.Parameter], group=None
                     ) -> float:
    """After the step's last backward and before any gradient reduction: compute the global ``b``
    and set every covered parameter's gradient to ``Q - b P`` (``main_grad`` when Megatron keeps
    one, else ``.grad``). Collective over ``group``. Returns ``b``."""
    device = None
    if grad_norms.den is not None:
        device = grad_norms.den.device
    b, num, den = opob_baseline(grad_norms.num, grad_norms.den, group=group, device=device)
    for p in params:
        q = grad_norms.weighted_grads.get(p)
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is None:
            if q is not None and q.abs().max() > 0:
                raise RuntimeError("a parameter received a weighted gradient but no autograd gradient")
            continue
        grad.mul_(-b)
        if q is not None:
            grad.add_(q.to(grad.dtype))
    grad_norms.last_baseline, grad_norms.last_num, grad_norms.last_den = b, num, den
    grad_norms.reset()
    return b
