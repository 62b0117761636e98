"""Reference custom losses for slime's ``--custom-loss-function-path`` slot (test helper).

``policy_loss`` is the copris / decoupled objective of docs/loss.md, written from that page in
float64, per sample, with nothing from april_slime: slime's ``loss_function`` calls it with the
same micro-batches, metadata and reducer as the plugin's loss, so the two can be compared where
slime itself has no equivalent (copris with TIS/MIS, sequence and geometric levels). It reads the
same ``april_*`` settings as the plugin and the PPO bounds from slime's ``--eps-clip*``. Its
metrics are prefixed ``ref/``; ``ref/stale*`` are the staleness buckets of ``batch["metadata"]``.

``recording_policy_loss`` is the plugin's loss, recording what each micro-batch hands it.
"""

from __future__ import annotations

import torch
from slime.backends.megatron_utils import loss as slime_loss

STALENESS_BUCKETS = ("stale0", "stale1", "stale2", "stale3+")


def _correct(w: torch.Tensor, correction: str, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c(w), kept): truncation clamps, the mask zeroes the weight and drops the token / sample."""
    if correction == "none":
        return w, torch.ones_like(w)
    inside = (w >= low) & (w <= high)
    if correction == "truncate":
        return w.clamp(low, high), torch.ones_like(w)
    return torch.where(inside, w, torch.zeros_like(w)), inside.to(w.dtype)


def _at_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-weight at ``level``: the token's own, or the sample's sum / mean broadcast."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum()
    if level == "geometric":
        total = total / mask.sum().clamp_min(1)
    return total.expand_as(log_ratio)


def _versions(metadata: dict, n: int) -> torch.Tensor:
    return torch.cat([torch.full((count,), version, dtype=torch.float64)
                      for version, count in metadata["april_token_versions_rle"]]) if n else torch.zeros(0)


def policy_loss(args, batch, logits, sum_of_sample_mean):
    mode, level, correction = args.april_is_mode, args.april_is_level, args.april_is_correction
    low, high = args.april_is_low, args.april_is_high
    eps_low, eps_high = args.eps_clip, args.eps_clip_high
    _, out = slime_loss.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=False)
    old_all = batch.get("log_probs")
    metadata = batch.get("metadata") or [None] * len(out["log_probs"])
    parts = {k: [] for k in ("loss", "clipped", "weight", "truncated", "masked",
                             *(f"{b}/{q}" for b in STALENESS_BUCKETS for q in ("tokens", "ratio_mass")))}
    for i, lp32 in enumerate(out["log_probs"]):
        lp = lp32.double()
        mask = batch["loss_masks"][i].double()
        adv = batch["advantages"][i].double()
        rollout = batch["rollout_log_probs"][i].double()
        # without the recompute (--use-rollout-logprobs) the current policy stands in for pi_old
        old = old_all[i].double() if old_all else lp.detach()
        anchor = rollout if mode == "copris" else old
        ratio = torch.exp(lp - anchor)
        unclipped, clipped = -ratio * adv, -ratio.clamp(1 - eps_low, 1 + eps_high) * adv
        ppo = torch.maximum(unclipped, clipped)
        if mode == "copris":
            # c(rho) / r, rho = pi_theta / pi_rollout at the level, as a constant factor
            rho = torch.exp(_at_level((lp - rollout).detach(), mask, level))
            corrected, kept = _correct(rho, correction, low, high)
            weight = corrected / ratio.detach()
        else:
            rho = torch.exp(_at_level(old - rollout, mask, level))
            corrected, kept = _correct(rho, correction, low, high)
            weight = corrected
        parts["loss"].append(ppo * weight)
        parts["clipped"].append((clipped > unclipped).double() * kept)
        parts["weight"].append(weight.detach())
        parts["truncated"].append((corrected != rho).double() * (correction == "truncate"))
        parts["masked"].append(1 - kept)
        if metadata[i] is not None:
            staleness = metadata[i]["april_policy_version"] - _versions(metadata[i], len(lp))
            behaviour = torch.exp(old - rollout)
            for b, name in enumerate(STALENESS_BUCKETS):
                in_bucket = (staleness >= b) if b == len(STALENESS_BUCKETS) - 1 else (staleness == b)
                parts[f"{name}/tokens"].append(in_bucket.double())
                parts[f"{name}/ratio_mass"].append(in_bucket.double() * behaviour)
    flat = {k: torch.cat(v) for k, v in parts.items() if v}
    pg_loss = sum_of_sample_mean(flat.pop("loss"))
    metrics = {"loss": pg_loss.detach(), "pg_loss": pg_loss.detach(),
               "pg_clipfrac": sum_of_sample_mean(flat.pop("clipped"))}
    metrics.update({f"ref/{k}": sum_of_sample_mean(v) for k, v in flat.items()})
    return pg_loss, {k: v.detach().float() for k, v in metrics.items()}


RECORDED: list[dict] = []


def recording_policy_loss(args, batch, logits, sum_of_sample_mean):
    from april_slime.loss import policy_loss as plugin_policy_loss

    RECORDED.append({"metadata": batch.get("metadata"), "tokens": [t.tolist() for t in batch["unconcat_tokens"]]})
    return plugin_policy_loss(args, batch, logits, sum_of_sample_mean)
