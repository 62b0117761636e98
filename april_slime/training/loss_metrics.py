"""The loss hooks' metrics as per-token tensors that slime's metric reduction turns into exact step values.

slime sums every metric a loss returns over micro-batches and data-parallel ranks and divides by
the step's sample count (``sum_of_sample_mean``: each sample's token mean), or, with
``--calculate-per-token-loss``, by its token count (a plain token sum, where a sample without a
trained token counts as one token). A quantity of the sample (its sequence weight, whether it has
a trained token) is therefore spread over the sample's tokens in the first mode and put on one of
its tokens in the second (``per_sample``): either way the logged value is "sum over trained
samples / slime's divisor", and ratios of two such values are exact in both modes.

Everything here takes and returns whole-response packed tensors (``offpolicy.Packing``); the
loss hooks slice them to slime's local layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from april_slime.training import offpolicy
from april_slime.training.ess import effective_sample_size
from april_slime.training.staleness import staleness_buckets, token_lags

__all__ = ["IS_WEIGHT_QUANTILES", "STALENESS_BUCKETS", "is_weight_quantiles", "kl_rollout_train",
           "per_sample", "staleness_metrics", "weight_metrics", "without_masked"]

STALENESS_BUCKETS = ("stale0", "stale1", "stale2", "stale3+")
IS_WEIGHT_QUANTILES = (0.05, 0.5, 0.95, 0.99)


def without_masked(values: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """``values`` with 0 at the tokens the loss mask drops (``trained`` False). slime's reduction
    multiplies each value by the mask, and a NaN or inf there (a placeholder log-prob at a tool
    token, an overflowed ratio) times 0 is NaN: a masked token's value must be left out, not
    multiplied away."""
    return torch.where(trained.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def per_sample(values: torch.Tensor, packing: offpolicy.Packing, mask: torch.Tensor,
               per_token_loss: bool) -> torch.Tensor:
    """[T] tensor carrying one value per sample [N] so that slime's reducer sums the values of the
    samples with a trained token: spread over the sample's tokens (per-sample mean reduction) or
    on its first trained token (per-token reduction)."""
    m = mask.to(values.dtype)
    if not per_token_loss:
        return packing.expand(values) * (packing.sum(m) > 0).to(values.dtype)[packing.segment_ids]
    first = torch.zeros_like(m)
    trained = mask.bool()
    if bool(trained.any()):
        positions = torch.arange(m.numel(), device=m.device)
        big = torch.full_like(positions, m.numel())
        starts = torch.full((packing.num_samples,), m.numel(), dtype=positions.dtype, device=m.device)
        starts = starts.scatter_reduce(0, packing.segment_ids, torch.where(trained, positions, big), reduce="amin")
        has = starts < m.numel()
        first[starts[has]] = 1.0
    return first * packing.expand(values)


def weight_metrics(packing: offpolicy.Packing, mask: torch.Tensor, sequence_log_weights: torch.Tensor,
                   per_token_loss: bool) -> dict[str, torch.Tensor]:
    """The unclipped sequence weights w = prod pi / mu of the micro-batch: ``trained_frac``,
    ``seq_weight`` and ``seq_weight_sq`` (per sample, see ``per_sample``; the step's ESS ratio is
    ``seq_weight**2 / (trained_frac * seq_weight_sq)`` while every |log w| <= 20, the clamp of
    ``offpolicy.safe_exp``), and the micro-batch's own ESS ratio on every token."""
    seq_w = offpolicy.safe_exp(sequence_log_weights.detach())
    valid = packing.sum(mask.to(seq_w.dtype)) > 0
    microbatch = effective_sample_size(sequence_log_weights, valid=valid, reduce=False)
    return {
        "trained_frac": per_sample(torch.ones_like(seq_w), packing, mask, per_token_loss),
        "seq_weight": per_sample(seq_w, packing, mask, per_token_loss),
        "seq_weight_sq": per_sample(seq_w.square(), packing, mask, per_token_loss),
        "ess_ratio_microbatch": torch.full_like(mask, microbatch.ess_ratio, dtype=seq_w.dtype),
    }


def kl_rollout_train(rollout_log_probs: torch.Tensor, train_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(rollout || train) from the rollout's own samples:
    ``r - 1 - log r`` with ``r = pi_train / pi_rollout`` (>= 0, unbiased for the KL)."""
    return offpolicy.approx_kl(rollout_log_probs.detach(), train_log_probs.detach(), "k3")


def is_weight_quantiles(log_ratio: torch.Tensor, mask: torch.Tensor,
                        quantiles: Sequence[float] = IS_WEIGHT_QUANTILES) -> dict[str, torch.Tensor]:
    """Quantiles of the token importance weights ``exp(log_ratio)`` over the micro-batch's trained
    tokens, each on every token ([T]): reduced by slime, the sample-weighted mean over micro-batches
    of each micro-batch's quantile. Taken in log space, so weights beyond the exp clamp keep their order."""
    trained = log_ratio.detach()[mask.bool()].to(torch.float64)
    out = {}
    for q in quantiles:
        value = offpolicy.safe_exp(torch.quantile(trained, q)) if trained.numel() else 0.0
        out[f"is_weight_q{round(q * 100):02d}"] = torch.full_like(mask, float(value), dtype=log_ratio.dtype)
    return out


def staleness_metrics(per_sample_versions: Sequence[torch.Tensor | None], references: Sequence[int | None],
                      packing: offpolicy.Packing, behaviour_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token staleness against each sample's reference policy version (the newest token version of
    the micro-batch where a sample has none): the off-policy token fraction, the mean staleness,
    and per bucket the token fraction and its behaviour-ratio mass."""
    device = behaviour_ratio.device
    lags, known = token_lags(per_sample_versions, references, packing)
    lags, known = lags.to(device), known.to(device)
    bucket = staleness_buckets(lags, len(STALENESS_BUCKETS))
    dtype = behaviour_ratio.dtype
    out = {
        "offpolicy_token_frac": (known & (lags > 0)).to(dtype),
        "staleness_mean": lags.to(dtype) * known.to(dtype),
    }
    for b, name in enumerate(STALENESS_BUCKETS):
        in_bucket = (known & (bucket == b)).to(dtype)
        out[f"{name}/tokens"] = in_bucket
        out[f"{name}/ratio_mass"] = in_bucket * behaviour_ratio
    return out
