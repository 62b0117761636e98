"""Per-token policy versions in the loss: expanded from their runs, the lag of each token behind the
policy that trains it, the stale tokens' weights (``april_stale_token_lag``) and the staleness
buckets of the metrics.

Pure torch; tokens are packed as everywhere in the training wing (``offpolicy.Packing``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from april_slime.training.offpolicy import Packing


def expand_version_runs(runs: Sequence[Sequence[int]] | torch.Tensor, length: int) -> torch.Tensor:
    """Per-token policy versions [length] from run-length pairs ``[[version, count], ...]``.

    The counts must add up to ``length`` (the response length): a mismatch means versions and
    tokens are not aligned, which is a data error, so it raises.
    """
    pairs = torch.as_tensor(runs, dtype=torch.long).reshape(-1, 2) if len(runs) else torch.zeros(0, 2, dtype=torch.long)
    if bool((pairs[:, 1] < 0).any()):
        raise ValueError(f"version runs with a negative count: {pairs.tolist()}")
    total = int(pairs[:, 1].sum())
    if total != length:
        raise ValueError(f"version runs cover {total} tokens but the response has {length}")
    return torch.repeat_interleave(pairs[:, 0], pairs[:, 1])


def token_lags(per_sample_versions: Sequence[torch.Tensor | None], references: Sequence[int | None],
               packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (packed): its version lag behind its sample's reference version (the newest token
    version of the batch where a sample has none), clamped at 0, and whether its version is known
    (False for a sample without versions, whose lag reads 0)."""
    lengths = list(packing.sizes)
    if not lengths:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    known = torch.cat([torch.full((n,), v is not None, dtype=torch.bool) for v, n in zip(per_sample_versions, lengths)])
    flat = torch.cat([v.to(torch.long) if v is not None else torch.zeros(n, dtype=torch.long)
                      for v, n in zip(per_sample_versions, lengths)])
    newest = int(flat[known].max()) if bool(known.any()) else 0
    reference = torch.cat([torch.full((n,), newest if ref is None else int(ref), dtype=torch.long)
                           for ref, n in zip(references, lengths, strict=True)])
    return (reference - flat).clamp_min(0) * known, known


def stale_token_weights(lags: torch.Tensor, known: torch.Tensor, max_lag: int, weight: float,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, stale): ``weight`` for the tokens whose known lag exceeds ``max_lag``, 1 for the
    others; ``stale`` (1.0 / 0.0) marks the former. Applied to the per-token policy loss, apart
    from (and after) the importance correction: 0 masks the old tokens, (0, 1) down-weights them."""
    stale = known & (lags > max_lag)
    ones = torch.ones(lags.shape, dtype=dtype)
    weights = torch.where(stale, ones * float(weight), ones)
    return weights, stale.to(dtype)


def staleness_buckets(staleness: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket index per token: staleness 0 .. num_buckets-2 exactly, the last bucket for the rest."""
    if num_buckets < 1:
        raise ValueError("num_buckets must be >= 1")
    return staleness.clamp(0, num_buckets - 1)


def staleness_stats(
    ratio: torch.Tensor, staleness: torch.Tensor, loss_mask: torch.Tensor, num_buckets: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bucket: (masked token count, sum of ``ratio`` over those tokens), both [num_buckets]."""
    bucket = staleness_buckets(staleness.to(torch.long), num_buckets)
    m = loss_mask.to(ratio.dtype)
    counts = torch.zeros(num_buckets, dtype=ratio.dtype, device=ratio.device).index_add(0, bucket, m)
    sums = torch.zeros(num_buckets, dtype=ratio.dtype, device=ratio.device).index_add(0, bucket, ratio.detach() * m)
    return counts, sums
