"""slime loss hooks built on :mod:`april_slime.training.offpolicy`.

Two entry points, loaded by slime from their import paths:

* ``policy_loss`` for ``--loss-type custom_loss --custom-loss-function-path april_slime.loss.policy_loss``:
  the whole policy loss (on_policy / copris / decoupled, token or GSPO sequence level, TIS/MIS at
  token / sequence / geometric level), entropy and KL terms, and the metrics.
* ``tis`` for ``--use-tis --custom-tis-function-path april_slime.loss.tis``: the lighter hook that
  reweights the PPO loss slime has already computed. slime clips around the recomputed log-probs,
  so this hook implements the ``decoupled`` mode (weight = pi_old / pi_rollout, corrected); with
  ``--get-mismatch-metrics`` and without ``--use-tis`` it only reports metrics.

Settings are the job's ``LossSettings`` (``april_is_mode``, ``april_is_level``, ``april_is_correction``,
``april_is_low``, ``april_is_high``, ``april_loss_level``; ``april_slime.job.describe``), read and
checked once per job. PPO clip bounds are slime's ``--eps-clip`` / ``--eps-clip-high`` / ``--eps-clip-c``.

Both start with the packing step of ``april_slime.loss_batch`` (``read_samples``: whole responses,
packed once, whatever the context-parallel layout), which also reads the per-token policy versions
and finds the proximal log-probs; the off-policy math is ``april_slime.training.offpolicy``'s.

Metrics (``april_slime.training.loss_metrics`` owns how each is laid out). slime sums every metric
over micro-batches and data-parallel ranks and divides by the step's sample count (or its token
count with ``--calculate-per-token-loss``), so each metric here is a per-token quantity passed
through ``sum_of_sample_mean``. Quantities of a sample (``trained_frac``, ``seq_weight``,
``seq_weight_sq``, ``ratio_max``) read "sum over trained samples / slime's divisor" in both modes,
so ``X / trained_frac`` is the mean over trained samples and
``seq_weight**2 / (trained_frac * seq_weight_sq)`` the step's ESS ratio (log-weights clamped to
+-20 before exp). ``ess_ratio_microbatch`` and the ``is_weight_q*`` quantiles are per micro-batch;
``kl_rollout_train_k3`` is the k3 estimate of KL(rollout || train); per staleness bucket
``tokens`` / ``ratio_mass`` give the bucket's mean behaviour ratio (docs/loss.md, "Metrics").

Proximal log-probs: slime's recomputed ones when the batch has them; otherwise the training
forward's own (one optimizer step per rollout, or copris) or the log-linear interpolation
(``april_prox_log_probs: loglinear``; ``april_slime.loss_batch``). ``policy_loss`` answers
slime's question whether it needs the recompute (``reuses_train_log_probs``, asked through
``patches/slime-skip-proximal-recompute.patch``).

VCPO (``april_slime.vcpo``; needs ``april_slime.vcpo.before_train_step`` as slime's
before-train-step hook, which creates the job's ``vcpo.runtime()``):

* ``april_vcpo_lr_scaling``: every micro-batch adds the unclipped sequence log-weights
  ``sum_t m_t (log pi_theta - log pi_rollout)`` (pi_theta = the policy of this forward, in every
  mode) to the step's ESS statistics; the optimizer step reduces them across ranks and scales the
  learning rate. Nothing else in the loss changes.
* ``april_vcpo_baseline``: the policy-gradient term is ``opob_policy_loss`` (sequence-level
  corrected weight times the response NLL, summed or length-normalised, a plain sum over samples
  that slime's loss scaling turns into the step mean), with the off-policy optimal baseline folded
  into the gradients micro-batch by micro-batch (``april_slime.training.baseline``). Defined for
  ``april_is_mode: copris`` with ``april_is_level: sequence`` only; ``april_slime.job_checks.check_vcpo``
  refuses everything else at job start. The metrics keep their keys (``april/ratio_*`` is then the
  unclipped sequence ratio, ``pg_clipfrac`` 0).

The TIS hook refuses both VCPO settings: it only sees the recomputed log-probs.

Every refusal here that needs only the settings and slime's arguments also runs at job start
(``april_slime.job_checks``), with the same line. The hooks keep theirs as guards of what the
arguments cannot show: a before-train-step hook of the user's own that does not call the plugin's, a
batch without what the flags promised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from april_slime import job_checks, vcpo
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import METRIC_PREFIX, OPOB_GROUP_KEY, TOKEN_VERSIONS_KEY
from april_slime.job import describe
from april_slime.loss_batch import SlimeMicrobatch, read_batch, read_samples, token_versions
from april_slime.training import loss_metrics, offpolicy, staleness
from april_slime.training.baseline import OpobResult, SampleGroups, opob_policy_loss, per_sample_rewards
from april_slime.training.loss_metrics import without_masked
from april_slime.training.packed import PackedSamples, concat_samples
from april_slime.training.settings import LossSettings

__all__ = ["SlimeMicrobatch", "config_for", "policy_loss", "read_samples", "reuses_train_log_probs", "tis",
           "token_versions"]


def config_for(args: Any) -> LossSettings:
    """The job's loss settings (``april_slime.job.describe``)."""
    return describe(args).loss


# ---------------------------------------------------------------------- policy-loss terms
def _stale_token_weights(config: LossSettings, mb: SlimeMicrobatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights, stale) per packed token for ``april_stale_token_lag``, or None when it is off."""
    if config.stale_token_lag is None:
        return None
    if mb.versions is None:
        raise ValueError(f"april_stale_token_lag needs the per-token versions ({TOKEN_VERSIONS_KEY}) of the "
                         "samples; this micro-batch has none")
    lags, known = staleness.token_lags(*mb.versions, mb.packing)
    weights, stale = staleness.stale_token_weights(lags, known, config.stale_token_lag, config.stale_token_weight,
                                                   dtype=mb.whole.old_log_probs.dtype)
    device = mb.whole.old_log_probs.device
    return weights.to(device), stale.to(device)


def reuses_train_log_probs(args: Any, num_microbatches: list[int]) -> bool:
    """Asked by slime's trainer (``patches/slime-skip-proximal-recompute.patch``) before it runs its
    separate log-prob forward: True when this loss takes pi_prox from its own training forward
    (one optimizer step per rollout, ``april_prox_log_probs: auto | loglinear``) or interpolates it
    (``loglinear``), and nothing else of slime's step needs the recomputed log-probs."""
    job = describe(args)
    if job.loss.prox_log_probs == "recompute":
        return False
    if len(num_microbatches) != 1 and job.loss.prox_log_probs != "loglinear":
        return False
    return not job.slime.recomputes_log_probs_anyway


# ---------------------------------------------------------------------------- custom loss
def policy_loss(
    args: Any,
    batch: dict,
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime custom loss: ``(loss, metrics)`` with metrics as detached 0-dim tensors.

    ``batch`` is slime's micro-batch: per-sample lists ``advantages``, ``log_probs`` (recomputed
    before the step; absent with ``--use-rollout-logprobs``), ``rollout_log_probs``,
    ``loss_masks``, ``response_lengths``, ``total_lengths``, ``unconcat_tokens``, optionally
    ``ref_log_probs`` and the token versions described in the module doc.
    """
    job = describe(args)
    config, slime_args = job.loss, job.slime
    loss_level = "sequence" if slime_args.advantage_estimator == "gspo" else config.loss_level

    mb = read_batch(job, batch, logits)
    whole, packing, mask = mb.whole, mb.packing, mb.whole.loss_mask
    stale = None  # april_stale_token_lag's (weights, stale) per token (refused with vcpo_baseline)
    if config.vcpo_baseline:
        opob = _opob_loss(mb, logits)
        objective = opob.objective(whole.log_probs, whole.old_log_probs, whole.rollout_log_probs, mask)
        pg_loss = opob.loss
    else:
        objective = offpolicy.policy_objective(
            whole.log_probs, whole.old_log_probs, whole.rollout_log_probs, whole.advantages, mask, packing,
            mode=config.is_mode, is_level=config.is_level, correction=config.is_correction,
            is_low=config.is_low, is_high=config.is_high, eps_clip=slime_args.eps_clip,
            eps_clip_high=slime_args.eps_clip_high, eps_clip_c=slime_args.eps_clip_c,
            loss_level=loss_level,
        )
        stale = _stale_token_weights(config, mb)
        pg_loss = sum_of_sample_mean(mb.to_local(objective.loss if stale is None else objective.loss * stale[0]))
    if config.vcpo_lr_scaling:
        _observe_ess(whole, opob.seq_log_ratios if config.vcpo_baseline else None, config.is_high)

    keep_local = mb.to_local(objective.keep)
    trained_local = mb.to_local(mask).bool()

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        """slime's reduction of a per-token value, the loss-masked tokens' values left out."""
        return sum_of_sample_mean(without_masked(values, trained_local))

    local_log_probs = concat_samples(mb.log_probs)
    local_old = concat_samples(mb.old_log_probs).to(local_log_probs)
    entropy_loss = sum_of_sample_mean(concat_samples(mb.entropy) * keep_local)
    loss = pg_loss - slime_args.entropy_coef * entropy_loss

    metrics: dict[str, torch.Tensor] = {}
    if slime_args.use_kl_loss:
        ref = concat_samples(mb.ref_log_probs).to(local_log_probs)
        importance = torch.exp(local_log_probs - local_old) if slime_args.use_unbiased_kl else None
        kl_loss = token_mean(offpolicy.approx_kl(local_log_probs, ref, slime_args.kl_loss_type, importance))
        loss = loss + slime_args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if local_log_probs.numel() == 0:
        # keeps every parameter in the graph so the backward collectives still run on this rank
        loss = loss + 0 * logits.sum()

    # slime's convention: ppo_kl is measured from the ratio's anchor, and the train/rollout gap
    # compares the rollout with the anchor, or with the current policy where the rollout *is* the
    # anchor (copris here, --use-rollout-logprobs in slime).
    local_rollout = (concat_samples(mb.rollout_log_probs).to(local_log_probs) if mb.rollout_log_probs is not None
                     else None)
    anchored_on_rollout = config.is_mode == "copris" and local_rollout is not None
    local_anchor = local_rollout if anchored_on_rollout else local_old
    metrics.update({
        "loss": loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": token_mean(mb.to_local(objective.clipped)),
        "ppo_kl": token_mean(local_anchor - local_log_probs),
    })
    if local_rollout is not None:
        compared = local_log_probs.detach() if anchored_on_rollout else local_old
        metrics["train_rollout_logprob_abs_diff"] = token_mean((compared - local_rollout).abs())

    if local_rollout is not None:
        metrics[METRIC_PREFIX + "kl_rollout_train_k3"] = token_mean(
            loss_metrics.kl_rollout_train(local_rollout, local_log_probs))

    per_token_loss = bool(slime_args.calculate_per_token_loss)
    behaviour_ratio = offpolicy.safe_exp(objective.behaviour_log_ratio)
    per_token = {
        "ratio_mean": objective.ratio,
        "ratio_max": loss_metrics.per_sample(packing.max(objective.ratio, mask), packing, mask, per_token_loss),
        "is_weight_mean": objective.is_weight,
        "truncated_frac": objective.truncated,
        "masked_frac": 1.0 - objective.keep,
        "behaviour_ratio_mean": behaviour_ratio,
        **loss_metrics.weight_metrics(packing, mask, objective.sequence_log_weights, per_token_loss),
        **loss_metrics.is_weight_quantiles(objective.behaviour_log_ratio, mask),
    }
    if stale is not None:
        per_token["stale_token_frac"] = stale[1]
    local_metrics = {k: mb.to_local(v) for k, v in per_token.items()}
    if mb.versions is not None:
        local_metrics.update(mb.local_staleness_metrics(behaviour_ratio))
    for key, value in local_metrics.items():
        metrics[METRIC_PREFIX + key] = token_mean(value.to(local_log_probs.dtype))
    return loss, {k: torch.as_tensor(v, device=logits.device).detach().clone().float() for k, v in metrics.items()}


policy_loss.reuses_train_log_probs = reuses_train_log_probs  # type: ignore[attr-defined]  # asked by slime (patch)


# ------------------------------------------------------------------------------------ VCPO
def _vcpo_runtime() -> vcpo.VcpoRuntime:
    rt = vcpo.runtime()
    if rt is None:
        raise AprilConfigError(job_checks.VCPO_NEEDS_HOOK)
    return rt


def _observe_ess(whole: PackedSamples, seq_log_weights: torch.Tensor | None, is_high: float) -> None:
    """Feed this micro-batch's unclipped sequence log-weights log pi_theta - log pi_rollout to the
    step's ESS statistics (local; reduced across ranks once, at the optimizer step).

    pi_theta is the policy of this forward, whatever the mode: the full importance weight of the
    gradient is pi_theta / pi_rollout, which clipping, truncation or the decoupled split only
    modify; on the first optimizer step of a rollout it equals pi_old / pi_rollout. Samples
    without a loss-masked token do not enter the gradient and are left out. With
    --recompute-loss-function the loss runs twice per micro-batch, which observes every sample
    twice: ESS / N is invariant to that. The clipped-weight ESS beside it (logged, not used by the
    rule, as in VCPO's released code) takes the same samples' weights truncated at ``is_high``.
    """
    if whole.rollout_log_probs is None:
        raise AprilConfigError("april_vcpo_lr_scaling needs rollout log-probs in the batch (SGLang "
                               "return_logprob) to measure the effective sample size")
    packing, mask = whole.packing, whole.loss_mask
    if seq_log_weights is None:
        seq_log_weights = offpolicy.sequence_log_weights(
            offpolicy.masked_log_ratio(whole.log_probs.detach(), whole.rollout_log_probs, mask), packing, mask)
    has_tokens = packing.sum(mask.to(seq_log_weights.dtype)) > 0
    clipped = seq_log_weights.clamp(max=math.log(is_high))
    _vcpo_runtime().lr_scaler.observe(seq_log_weights, valid=has_tokens, clipped_log_weights=clipped)


def _opob_loss(mb: SlimeMicrobatch, logits: torch.Tensor) -> OpobResult:
    """VCPO's baselined policy-gradient term for this micro-batch (``opob_policy_loss``).

    Settings were checked by ``job_checks.check_vcpo`` at job start: copris mode,
    sequence-level weights, no context parallelism (local = whole responses here), and copris
    mode has already required the rollout log-probs. The rewards are the raw ones
    ``vcpo.opob_advantages`` wrote, the prompt groups come from the metadata it wrote.
    """
    rt = _vcpo_runtime()
    if rt.opob is None:
        raise AprilConfigError("april_vcpo_baseline: the before-train-step hook has not attached the model's "
                               "per-sample gradient hooks")
    groups = None
    if rt.opob.options.scope == "group":
        entries = [(m or {}).get(OPOB_GROUP_KEY) for m in (mb.metadata or [None] * len(mb.log_probs))]
        if any(e is None for e in entries):
            raise AprilConfigError(job_checks.GROUP_SCOPE_NEEDS_ADVANTAGES)
        groups = SampleGroups([e["group"] for e in entries], [e["size"] for e in entries],
                              [e["reward_std"] for e in entries])
    # The layers' activations hold whole samples (prompt and response) back to back, then padding.
    stream = offpolicy.Packing.from_lengths(mb.total_lengths, device=logits.device)
    return opob_policy_loss(
        mb.log_probs, mb.rollout_log_probs, list(mb.whole.loss_mask.split([lp.numel() for lp in mb.log_probs])),
        per_sample_rewards(list(mb.advantages)), stream.packed_segment_ids(logits.shape[1]),
        accumulator=rt.opob, groups=groups, options=rt.opob.options)


# ------------------------------------------------------------------------------- TIS hook
def tis(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    total_lengths: list[int] | None = None,
    response_lengths: list[int] | None = None,
    train_metadata: list[dict | None] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """slime TIS hook: ``(pg_loss, loss_masks, metrics)``.

    ``pg_loss`` is slime's flat per-token PPO loss (CP-local), ``train_log_probs`` the recomputed
    log-probs pi_old, ``rollout_log_probs`` the behaviour log-probs. With ``--use-tis`` the loss is
    multiplied by the corrected weight c(pi_old / pi_rollout) at ``april_is_level``; MIS also drops
    the rejected tokens from the returned masks (slime then leaves them out of every numerator).
    ``train_metadata`` (each sample's ``Sample.train_metadata``, passed by the repository's slime
    patch) gives the staleness metrics, as in the custom loss.
    Without ``--use-tis`` (``--get-mismatch-metrics``) nothing but the metrics changes. Metrics are
    flat per-token tensors, which slime reduces with its pre-rejection ``sum_of_sample_mean``.
    """
    job = describe(args)
    config = job.loss
    if config.vcpo_lr_scaling or config.vcpo_baseline:
        raise AprilConfigError(job_checks.TIS_REFUSES_VCPO)
    apply = bool(job.slime.use_tis)
    if apply:
        job_checks.check_tis_mode(config.is_mode)
    if response_lengths is None:
        response_lengths = [m.numel() for m in loss_masks]
    response_lengths = [int(n) for n in response_lengths]
    # train_metadata is what patches/slime-forward-train-metadata.patch passes to this hook
    mb = read_samples(response_lengths, total_lengths, loss_masks=loss_masks, old_log_probs=train_log_probs,
                      old_name="train_log_probs", rollout_log_probs=rollout_log_probs,
                      versions=token_versions({"metadata": train_metadata}, response_lengths))
    whole, packing, mask = mb.whole, mb.packing, mb.whole.loss_mask
    clean = offpolicy.check_finite({"train_log_probs": whole.old_log_probs,
                                    "rollout_log_probs": whole.rollout_log_probs}, mask, packing)
    behaviour = offpolicy.masked_log_ratio(clean["train_log_probs"], clean["rollout_log_probs"], mask)

    correction = config.is_correction if apply else "none"
    weights = offpolicy.correct_log_weights(offpolicy.level_log_weights(config.is_level, behaviour, packing, mask),
                                            correction, config.is_low, config.is_high)

    if apply:
        pg_loss = pg_loss * mb.to_local(weights.weights).to(pg_loss.dtype)
        if correction == "mask":
            loss_masks = [m * k.to(m.dtype) for m, k in zip(loss_masks, packing.split(weights.keep), strict=True)]

    sequence_log_weights = offpolicy.sequence_log_weights(behaviour, packing, mask)
    behaviour_ratio = offpolicy.safe_exp(behaviour)
    per_token = {
        "behaviour_ratio_mean": behaviour_ratio,
        "is_weight_mean": weights.weights,
        "truncated_frac": weights.truncated,
        "masked_frac": 1.0 - weights.keep,
        "kl_rollout_train_k3": loss_metrics.kl_rollout_train(whole.rollout_log_probs, whole.old_log_probs),
        **loss_metrics.weight_metrics(packing, mask, sequence_log_weights,
                                      bool(job.slime.calculate_per_token_loss)),
        **loss_metrics.is_weight_quantiles(behaviour, mask),
    }
    trained = mask.bool()
    metrics = {METRIC_PREFIX + k: mb.to_local(without_masked(v, trained)).detach().clone()
               for k, v in per_token.items()}
    if mb.versions is not None:
        staleness = mb.local_staleness_metrics(behaviour_ratio)
        metrics.update({METRIC_PREFIX + k: v.detach().clone() for k, v in staleness.items()})
    return pg_loss, loss_masks, metrics
