"""Off-policy math for partial rollouts: importance ratios, TIS/MIS, decoupled PPO, the objectives.

Pure torch; nothing here knows about slime. Every function works on *packed* data: one flat 1-D
tensor holding the response tokens of all samples back to back, plus a :class:`Packing` that
records how many tokens belong to each sample. ``pack`` turns a list of per-sample tensors into
that form and ``Packing.split`` turns it back.

Three log-probability vectors meet here, all aligned with the response tokens:

* ``log_probs``          log pi_theta, the policy being optimised (carries gradient);
* ``old_log_probs``      log pi_old, recomputed by the trainer before the step (the *proximal*
                         policy of decoupled PPO);
* ``rollout_log_probs``  L, what the engines reported while sampling. After resumption this is the
                         concatenation of the log-probs of every stage (CoPRIS eq. 6), so it is the
                         *behaviour* policy of every token, whichever weights generated it.

Objectives (per token t of sample i, A = advantage, clip(r) = clamp(r, 1 - eps, 1 + eps_high)):

* ``on_policy``  ``-min(r A, clip(r) A)`` with ``r = pi_theta / pi_old`` (rollout log-probs ignored).
* ``copris``     the same with ``r = pi_theta / pi_rollout`` (CoPRIS eq. 8). With TIS/MIS the token
                 loss is multiplied by ``sg(c(r) / r)``, so its gradient is that of ``c(r) A`` with
                 ``c`` the truncation (clamp) or masking (zero outside) of the ratio at the chosen
                 level.
* ``decoupled``  ``-w min(r A, clip(r) A)`` with ``r = pi_theta / pi_old`` (proximal) and
                 ``w = c(pi_old / pi_rollout)`` (AReaL decoupled PPO; behaviour = rollout).

Levels of an importance ratio: ``token`` (per token), ``sequence`` (product over the sample's
loss-masked tokens, formed as a sum in log space) and ``geometric`` (exp of the mean log-ratio).
With ``loss_level="sequence"`` (GSPO) the clipped ratio itself is the geometric mean over the
sample, shared by all its tokens.

Numerics: log-ratios are clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before ``exp``. Where
the ratio carries the policy gradient (``bounded_exp``) the clamp bounds the value but passes the
gradient through as that of ``exp`` at the clamped point, so a token far outside the bound still
gets its (truncated) weight times its advantage instead of a silent zero.
Non-finite log-probs (NaN/inf) at tokens the loss mask keeps raise :class:`NonFiniteLogProbError`
naming the tensor, sample and token; at masked-out positions (padding, tool output) they are
ignored, since those tokens never enter the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from april_slime.training.settings import IS_CORRECTIONS, IS_LEVELS, IS_MODES, LOSS_LEVELS

LOG_RATIO_BOUND = 20.0



class NonFiniteLogProbError(ValueError):
    """A log-prob (or advantage) the loss would use is NaN or infinite."""


# --------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class Packing:
    """Layout of a flat per-token tensor: ``lengths[i]`` consecutive tokens belong to sample i."""

    lengths: torch.Tensor  # [N] int64
    segment_ids: torch.Tensor  # [T] int64, sample index of every token
    sizes: tuple[int, ...]  # the same lengths on the host, so splitting needs no device sync

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> Packing:
        sizes = tuple(int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths))
        if any(n < 0 for n in sizes):
            raise ValueError(f"sample lengths must be >= 0, got {list(sizes)}")
        lengths_t = torch.tensor(sizes, dtype=torch.long, device=device)
        segment_ids = torch.repeat_interleave(torch.arange(len(sizes), device=lengths_t.device), lengths_t,
                                              output_size=sum(sizes))
        return cls(lengths_t, segment_ids, sizes)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | torch.Tensor,
                        device: torch.device | str | None = None) -> Packing:
        """From cumulative boundaries ``[0, end_0, end_1, ...]`` (the varlen / thd convention)."""
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
        return cls.from_lengths([b - a for a, b in zip(cu, cu[1:])], device=device)

    def packed_segment_ids(self, num_positions: int) -> torch.Tensor:
        """Sample index of every position of a packed stream [num_positions] that holds the samples
        back to back followed by padding; padding positions are -1."""
        if num_positions < self.num_tokens:
            raise ValueError(f"a stream of {num_positions} positions cannot hold {self.num_tokens} tokens")
        padding = torch.full((num_positions - self.num_tokens,), -1, dtype=torch.long, device=self.segment_ids.device)
        return torch.cat([self.segment_ids, padding])

    def padded_segment_ids(self, row_length: int) -> torch.Tensor:
        """Right-padded layout [N, row_length]: row i holds sample i in its first ``sizes[i]``
        positions; padding positions are -1."""
        if any(n > row_length for n in self.sizes):
            raise ValueError(f"sample lengths {list(self.sizes)} do not fit rows of {row_length}")
        pos = torch.arange(row_length, device=self.lengths.device)
        rows = torch.arange(self.num_samples, device=self.lengths.device)[:, None].expand(-1, row_length)
        return torch.where(pos[None, :] < self.lengths[:, None], rows, torch.full_like(rows, -1))

    @property
    def num_samples(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    def check(self, name: str, x: torch.Tensor) -> None:
        if x.dim() != 1 or x.numel() != self.num_tokens:
            raise ValueError(f"{name}: expected a flat tensor of {self.num_tokens} tokens, got shape {tuple(x.shape)}")

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.check("split", x)
        return list(x.split(list(self.sizes)))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample sum, [N]; differentiable."""
        out = torch.zeros(self.num_samples, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.segment_ids, x)

    def expand(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Broadcast one value per sample to all of the sample's tokens, [T]."""
        return per_sample[self.segment_ids]

    def mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-sample masked mean, [N]; 0 for a sample with no masked-in token."""
        m = mask.to(x.dtype)
        return self.sum(x * m) / self.sum(m).clamp_min(1)

    def max(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-sample masked max, [N]; 0 for a sample with no masked-in token (not differentiable)."""
        x = x.detach()
        neg_inf = torch.full_like(x, -math.inf)
        masked = torch.where(mask.bool(), x, neg_inf)
        out = torch.full((self.num_samples,), -math.inf, dtype=x.dtype, device=x.device)
        out = out.scatter_reduce(0, self.segment_ids, masked, reduce="amax", include_self=True)
        return torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Packing]:
    """Concatenate per-sample 1-D tensors; returns the flat tensor and its packing."""
    for i, t in enumerate(tensors):
        if t.dim() != 1:
            raise ValueError(f"sample {i}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    device = tensors[0].device if len(tensors) else None
    flat = torch.cat(list(tensors)) if len(tensors) else torch.zeros(0)
    return flat, Packing.from_lengths([t.numel() for t in tensors], device=device)


# --------------------------------------------------------------------------------------- checks
def check_finite(named: dict[str, torch.Tensor], mask: torch.Tensor, packing: Packing) -> dict[str, torch.Tensor]:
    """Raise on a non-finite value at a masked-in token; zero the masked-out ones.

    One device sync for all tensors together (the ``any`` below), not one per tensor.
    """
    keep = mask.bool()
    bad = {name: ~torch.isfinite(x.detach()) & keep for name, x in named.items()}
    if bad and bool(torch.stack([b.any() for b in bad.values()]).any()):
        for name, b in bad.items():
            if b.any():
                flat_idx = int(torch.nonzero(b)[0])
                sample = int(packing.segment_ids[flat_idx])
                start = sum(packing.sizes[:sample])
                raise NonFiniteLogProbError(
                    f"{name}: non-finite value {named[name][flat_idx].item()} at sample {sample}, token "
                    f"{flat_idx - start} ({int(b.sum())} such tokens in the batch); the loss cannot use it"
                )
    return {name: torch.where(keep, x, torch.zeros_like(x)) for name, x in named.items()}


# ----------------------------------------------------------------------------- ratios and weights
def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-LOG_RATIO_BOUND (no inf, no overflow in squares)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of ``log_ratio`` clamped to +-LOG_RATIO_BOUND, with the gradient of exp at the clamped
    point (straight through the clamp): value ``exp(c)``, derivative ``exp(c) * d log_ratio``.

    A plain clamp would pass no gradient beyond the bound; with this one a weight ``w / r`` formed
    from the same clamped ``r`` turns the term into exactly ``w`` times the score.
    """
    clamped = log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(clamped + (log_ratio - log_ratio.detach()))


def masked_log_ratio(log_p: torch.Tensor, log_q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p - log q on masked-in tokens, 0 elsewhere (so masked tokens have ratio 1)."""
    return torch.where(mask.bool(), log_p - log_q, torch.zeros_like(log_p))


def sequence_log_weights(log_ratio: torch.Tensor, packing: Packing, mask: torch.Tensor) -> torch.Tensor:
    """log of the sequence ratio prod_t p_t/q_t over masked tokens, per sample [N]; 0 if empty."""
    packing.check("log_ratio", log_ratio)
    return packing.sum(log_ratio * mask.to(log_ratio.dtype))


def geometric_log_weights(log_ratio: torch.Tensor, packing: Packing, mask: torch.Tensor) -> torch.Tensor:
    """Mean log-ratio over the masked tokens, per sample [N] (log of the geometric mean); 0 if empty."""
    packing.check("log_ratio", log_ratio)
    return packing.mean(log_ratio, mask)


def level_log_weights(level: str, log_ratio: torch.Tensor, packing: Packing, mask: torch.Tensor) -> torch.Tensor:
    """Log importance ratio at ``level``, one value per token [T] (sample-level ones broadcast)."""
    if level == "token":
        packing.check("log_ratio", log_ratio)
        return log_ratio
    if level == "sequence":
        return packing.expand(sequence_log_weights(log_ratio, packing, mask))
    if level == "geometric":
        return packing.expand(geometric_log_weights(log_ratio, packing, mask))
    raise ValueError(f"is_level must be one of {', '.join(IS_LEVELS)}; got {level!r}")


@dataclass
class Correction:
    """Result of applying TIS/MIS to weights given as log-weights."""

    weights: torch.Tensor  # corrected weights (0 where masked)
    keep: torch.Tensor  # 1.0 where the token stays in the loss, 0.0 where MIS dropped it
    truncated: torch.Tensor  # 1.0 where TIS changed the weight


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    if not (0.0 <= low < high < math.inf):
        raise ValueError(f"IS bounds need 0 <= low < high < inf, got low={low}, high={high}")
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def correct_log_weights(log_weights: torch.Tensor, correction: str, low: float, high: float) -> Correction:
    """TIS (``truncate``: clamp to [low, high]) or MIS (``mask``: zero outside [low, high]).

    Works in log space after the safety clamp, so weights of any magnitude are handled and the
    bounds are inclusive for both variants: a weight exactly at ``high`` is kept unchanged.
    """
    lw = log_weights.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    weights = torch.exp(lw)
    ones = torch.ones_like(weights)
    zeros = torch.zeros_like(weights)
    if correction == "none":
        return Correction(weights, ones, zeros)
    log_low, log_high = _log_bounds(low, high)
    if correction == "truncate":
        clamped = torch.exp(lw.clamp(log_low, log_high))
        return Correction(clamped, ones, (clamped != weights).to(weights.dtype))
    if correction == "mask":
        inside = (weights >= low) & (weights <= high)
        return Correction(torch.where(inside, weights, zeros), inside.to(weights.dtype), zeros)
    raise ValueError(f"is_correction must be one of {', '.join(IS_CORRECTIONS)}; got {correction!r}")


# ------------------------------------------------------------------------------------- objectives
def ppo_clip_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``max(-r A, -clip(r) A)`` (optionally dual-clipped); returns (loss, clipped)."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = bounded_exp(log_ratio)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_high) * advantages
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(ratio.dtype)
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c (dual-clip bound) must be > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipped


@dataclass
class PolicyObjective:
    """Per-token terms of one objective evaluation, all [T] unless noted.

    ``loss`` is what the reducer should average (importance weights and MIS zeros applied; tokens
    outside the loss mask are left to the reducer). Everything except ``loss`` is detached.
    """

    loss: torch.Tensor
    ratio: torch.Tensor  # the clipped ratio r (pi_theta / anchor; per sample for GSPO)
    clipped: torch.Tensor  # 1.0 where the PPO clip was active
    is_weight: torch.Tensor  # multiplicative factor applied to the clipped objective
    keep: torch.Tensor  # 0.0 where MIS removed the token
    truncated: torch.Tensor  # 1.0 where TIS changed the weight
    behaviour_log_ratio: torch.Tensor  # log pi_old - log pi_rollout (0 outside the mask)
    sequence_log_weights: torch.Tensor  # [N] unclipped log sequence weights pi_old / pi_rollout


def policy_objective(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    packing: Packing,
    *,
    mode: str,
    is_level: str = "token",
    correction: str = "none",
    is_low: float = 0.0,
    is_high: float = 2.0,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    loss_level: str = "token",
) -> PolicyObjective:
    """Evaluate the on_policy / copris / decoupled objective on packed data (see module doc).

    ``rollout_log_probs`` may be None only in ``on_policy`` mode (then the behaviour diagnostics
    are zero).
    """
    if mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {', '.join(IS_MODES)}; got {mode!r}")
    if loss_level not in LOSS_LEVELS:
        raise ValueError(f"loss_level must be one of {', '.join(LOSS_LEVELS)}; got {loss_level!r}")
    if rollout_log_probs is None and mode != "on_policy":
        raise ValueError(f"is_mode={mode} needs the rollout log-probs of every token; none were given")
    for name, x in (("log_probs", log_probs), ("old_log_probs", old_log_probs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        packing.check(name, x)
    named = {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages}
    if rollout_log_probs is not None:
        packing.check("rollout_log_probs", rollout_log_probs)
        named["rollout_log_probs"] = rollout_log_probs
    clean = check_finite(named, loss_mask, packing)
    log_probs, old_log_probs, advantages = clean["log_probs"], clean["old_log_probs"], clean["advantages"]
    old_log_probs = old_log_probs.detach()
    rollout = clean.get("rollout_log_probs")
    rollout = rollout.detach() if rollout is not None else old_log_probs

    behaviour_log_ratio = masked_log_ratio(old_log_probs, rollout, loss_mask)
    anchor = rollout if mode == "copris" else old_log_probs
    token_log_ratio = masked_log_ratio(log_probs, anchor, loss_mask)
    if loss_level == "sequence":
        clip_log_ratio = packing.expand(geometric_log_weights(token_log_ratio, packing, loss_mask))
    else:
        clip_log_ratio = token_log_ratio
    token_loss, clipped = ppo_clip_loss(clip_log_ratio, advantages, eps_clip, eps_clip_high, eps_clip_c)

    ones = torch.ones_like(token_loss)
    if mode == "on_policy" or (mode == "copris" and correction == "none"):
        weight = Correction(ones.detach(), ones.detach(), torch.zeros_like(ones).detach())
    elif mode == "decoupled":
        weight = correct_log_weights(
            level_log_weights(is_level, behaviour_log_ratio, packing, loss_mask), correction, is_low, is_high)
    else:
        weight = _copris_correction(clip_log_ratio, token_log_ratio, packing, loss_mask, is_level, correction,
                                    is_low, is_high)
    is_weight = weight.weights.detach()
    keep = weight.keep.detach()

    return PolicyObjective(
        loss=token_loss * is_weight,
        ratio=safe_exp(clip_log_ratio.detach()),
        # tokens that MIS removed from the loss are not counted as clipped (slime counts kept ones)
        clipped=clipped.detach() * keep,
        is_weight=is_weight,
        keep=keep,
        truncated=weight.truncated.detach(),
        behaviour_log_ratio=behaviour_log_ratio,
        sequence_log_weights=sequence_log_weights(behaviour_log_ratio, packing, loss_mask),
    )


def _copris_correction(
    clip_log_ratio: torch.Tensor, token_log_ratio: torch.Tensor, packing: Packing, loss_mask: torch.Tensor,
    is_level: str, correction: str, is_low: float, is_high: float,
) -> Correction:
    """copris with TIS/MIS: the factor ``sg(c(rho) / r)`` on each token's PPO term.

    ``rho`` is pi_theta / pi_rollout at ``is_level``, ``c`` the truncation or mask and ``r`` the
    ratio the PPO term multiplies (the token ratio, or GSPO's per-sample geometric mean), formed
    with the same bound as ``bounded_exp``. Where PPO passes a gradient (unclipped branch) the
    term becomes ``-c(rho) A`` with gradient ``-c(rho) A grad log r``: the corrected weight times
    the score, whatever the level. At token level ``rho = r``. At sequence and geometric level
    dividing by the token's own ``r`` rather than by ``rho`` is what keeps the gradient bounded by
    the bounds: ``c(rho) / rho`` times a token ratio of order 1 grows like ``low / rho`` when
    ``rho`` is tiny. Clipped tokens keep zero gradient (their value is ``clip(r) c(rho) / r``
    times ``-A``).
    """
    current = level_log_weights(is_level, token_log_ratio.detach(), packing, loss_mask)
    corrected = correct_log_weights(current, correction, is_low, is_high)
    return Correction(corrected.weights / safe_exp(clip_log_ratio.detach()), corrected.keep, corrected.truncated)


def reduce_loss(x: torch.Tensor, loss_mask: torch.Tensor, packing: Packing, how: str = "sample_mean") -> torch.Tensor:
    """Average a per-token loss: ``sample_mean`` (GRPO: mean over samples of each sample's token
    mean) or ``token_mean`` (DAPO: mean over all masked tokens of the batch)."""
    m = loss_mask.to(x.dtype)
    if how == "sample_mean":
        return packing.mean(x, m).sum() / max(packing.num_samples, 1)
    if how == "token_mean":
        return (x * m).sum() / m.sum().clamp_min(1)
    raise ValueError(f"how must be sample_mean or token_mean; got {how!r}")


def approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_type: str,
              importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Schulman's per-token KL estimators k1 / k2 / k3 (= low_var_kl, clamped to +-10)."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kl_type!r}; use k1, k2, k3 or low_var_kl")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-10, 10)
    return kl


# ---------------------------------------------------------------------------------- collectives
def collective_device(group: torch.distributed.ProcessGroup | None = None,
                      hint: torch.device | str | None = None) -> torch.device | str:
    """Device for a small collective: NCCL reduces CUDA tensors only, so ranks whose data lives on
    the host (or that have no data, e.g. other pipeline stages) join with a CUDA tensor."""
    if hint is not None and torch.device(hint).type != "cpu":
        return hint
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_backend(group) == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"
