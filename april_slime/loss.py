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
``april_is_low``, ``april_is_high``, ``april_loss_level``; ``april_slime.settings.for_job``), read and
checked once per ``args`` object. PPO clip bounds are slime's ``--eps-clip`` / ``--eps-clip-high`` / ``--eps-clip-c``.

Layout. slime hands the loss per-sample lists. With context parallelism (CP) the log-probs,
advantages and rollout log-probs are CP-local slices while ``loss_masks`` cover the whole response.
Sequence-level quantities need whole responses, so both hooks start with the same packing step
(``read_samples``): it gathers every sample with slime's own CP helpers and packs the whole
responses once (``april_slime.training.packed.PackedSamples``) into a ``SlimeMicrobatch``. Data then
flows one way: batch -> packed samples -> off-policy math (``april_slime.training.offpolicy``) ->
loss and metrics, the per-token results sliced back to the local layout that slime's
``sum_of_sample_mean`` expects. Without CP (or without slime) both layouts coincide.

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
(``april_prox_log_probs: loglinear``, ``april_slime.training.proximal``). ``policy_loss`` answers
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
  ``april_is_mode: copris`` with ``april_is_level: sequence`` only; ``vcpo.check_settings`` refuses
  everything else. The metrics
  keep their keys (``april/ratio_*`` is then the unclipped sequence ratio, ``pg_clipfrac`` 0).

The TIS hook refuses both VCPO settings: it only sees the recomputed log-probs.

Per-token policy versions reach the loss only through the repository's slime patch. They are read
from ``batch["april_token_versions_rle"]`` (one ``[[version, count], ...]`` list per sample) or,
failing that, from ``batch["metadata"][i]["april_token_versions_rle"]`` (``Sample.train_metadata``).
Staleness is measured against ``metadata[i]["april_policy_version"]`` (the policy version the step
trains) when present, otherwise against the newest token version in the micro-batch. Without
versions the staleness metrics are left out; the loss itself never depends on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from april_slime import settings, vcpo
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import METRIC_PREFIX, OPOB_GROUP_KEY, POLICY_VERSION_KEY, TOKEN_VERSIONS_KEY
from april_slime.training import loss_metrics, offpolicy
from april_slime.training.baseline import OpobResult, SampleGroups, opob_policy_loss, per_sample_rewards
from april_slime.training.loss_metrics import without_masked
from april_slime.training.packed import PackedSamples, concat_samples, response_log_probs_from_logits
from april_slime.training.proximal import loglinear_proximal_log_probs
from april_slime.training.settings import LossSettings

STALENESS_BUCKETS = loss_metrics.STALENESS_BUCKETS
TokenVersions = tuple[list[torch.Tensor | None], list[int | None]]  # per-sample versions, reference versions


def config_for(args: Any) -> LossSettings:
    """The job's loss settings (``april_slime.settings.for_job``)."""
    return settings.for_job(args).loss


# ------------------------------------------------------------------------------------ layout
def _context_parallel_size() -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    try:
        from megatron.core import mpu
    except ImportError:
        return 1
    return mpu.get_context_parallel_world_size()


class _Layout:
    """Moves per-sample tensors between slime's CP-local slices and whole responses."""

    def __init__(self, total_lengths: list[int] | None, response_lengths: list[int]):
        self.total_lengths = total_lengths
        self.response_lengths = [int(n) for n in response_lengths]
        self.cp_size = _context_parallel_size()
        if self.cp_size > 1 and total_lengths is None:
            raise ValueError("context parallelism needs the samples' total_lengths")

    def gather(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.cp_size == 1:
            return list(local)
        from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

        return [all_gather_with_cp(x, t, r) for x, t, r in zip(local, self.total_lengths, self.response_lengths,
                                                                 strict=True)]

    def to_local(self, whole_flat: torch.Tensor, packing: offpolicy.Packing) -> torch.Tensor:
        """A flat whole-response tensor -> the flat CP-local tensor slime's reducer expects."""
        if self.cp_size == 1:
            return whole_flat
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

        parts = [slice_log_prob_with_cp(x, t, r) for x, t, r in zip(packing.split(whole_flat), self.total_lengths,
                                                                    self.response_lengths, strict=True)]
        return torch.cat(parts) if parts else whole_flat[:0]


# ------------------------------------------------------------------------------ log-probs
def _slime_log_prob_helpers():
    """slime's TP/CP-aware helpers when running inside a slime trainer, else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs
    except ImportError:
        return None
    return get_log_probs_and_entropy, get_rollout_top_p_logprob_kwargs


def current_log_probs(args: Any, batch: dict, logits: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """log pi_theta of every response token and the token entropies, per sample (CP-local)."""
    helpers = _slime_log_prob_helpers()
    if helpers is not None:
        get_log_probs_and_entropy, top_p_kwargs = helpers
        _, out = get_log_probs_and_entropy(
            logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=True, **top_p_kwargs(args, batch))
        return out["log_probs"], out["entropy"]
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        raise NotImplementedError("rollout top-p replay needs slime's log-prob helper; slime is not importable here")
    return response_log_probs_from_logits(
        logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        temperature=getattr(args, "rollout_temperature", 1.0), with_entropy=True)


# ------------------------------------------------------------------------------ versions
def token_versions(batch: dict, response_lengths: list[int]) -> TokenVersions | None:
    """Per-sample token versions (None where a sample has none) and reference versions, or None."""
    runs = batch.get(TOKEN_VERSIONS_KEY)
    metadata = batch.get("metadata")
    if runs is None and metadata:
        runs = [(m or {}).get(TOKEN_VERSIONS_KEY) for m in metadata]
    if runs is None or all(r is None for r in runs):
        return None
    references = [(m or {}).get(POLICY_VERSION_KEY) for m in metadata] if metadata else [None] * len(runs)
    versions = []
    for i, (r, n) in enumerate(zip(runs, response_lengths, strict=True)):
        if r is None:
            versions.append(None)
            continue
        try:
            versions.append(offpolicy.expand_version_runs(r, int(n)))
        except ValueError as exc:
            raise ValueError(f"sample {i}: {TOKEN_VERSIONS_KEY} does not match its response: {exc}") from exc
    return versions, references


def _stale_token_weights(config: LossSettings, mb: SlimeMicrobatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights, stale) per packed token for ``april_stale_token_lag``, or None when it is off."""
    if config.stale_token_lag is None:
        return None
    if mb.versions is None:
        raise ValueError(f"april_stale_token_lag needs the per-token versions ({TOKEN_VERSIONS_KEY}) of the "
                         "samples; this micro-batch has none")
    lags, known = offpolicy.token_lags(*mb.versions, mb.packing)
    weights, stale = offpolicy.stale_token_weights(lags, known, config.stale_token_lag, config.stale_token_weight,
                                                   dtype=mb.whole.old_log_probs.dtype)
    device = mb.whole.old_log_probs.device
    return weights.to(device), stale.to(device)


# --------------------------------------------------------------------------- packing step
@dataclass(frozen=True)
class SlimeMicrobatch:
    """One micro-batch as a loss hook receives it from slime, read once.

    ``whole`` holds every sample's whole response, packed, for the off-policy math. The lists are
    the per-sample tensors as slime hands them (CP-local slices under context parallelism, except
    ``loss_masks``, which cover whole responses), for the terms slime's reducer takes as they are;
    ``layout`` slices per-token results of the whole responses back to that local layout.
    """

    layout: _Layout
    whole: PackedSamples
    loss_masks: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    log_probs: list[torch.Tensor] | None = None  # the current policy (with grad); None in the TIS hook
    entropy: list[torch.Tensor] | None = None
    rollout_log_probs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    total_lengths: list[int] | None = None
    versions: TokenVersions | None = None  # per-token policy versions (``token_versions``)
    metadata: list[dict | None] | None = None  # each sample's metadata (``batch["metadata"]``)

    @property
    def packing(self) -> offpolicy.Packing:
        return self.whole.packing

    def to_local(self, x: torch.Tensor) -> torch.Tensor:
        """A flat whole-response tensor -> the flat CP-local tensor slime's reducer expects."""
        return self.layout.to_local(x, self.whole.packing)

    def local_staleness_metrics(self, behaviour_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
        """The staleness metrics of the whole responses (``loss_metrics.staleness_metrics``), local."""
        out = loss_metrics.staleness_metrics(*self.versions, self.packing, behaviour_ratio)
        return {k: self.to_local(v) for k, v in out.items()}


def read_samples(
    response_lengths: list[int],
    total_lengths: list[int] | None,
    *,
    loss_masks: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    old_name: str,
    log_probs: list[torch.Tensor] | None = None,
    entropy: list[torch.Tensor] | None = None,
    rollout_log_probs: list[torch.Tensor] | None = None,
    advantages: list[torch.Tensor] | None = None,
    ref_log_probs: list[torch.Tensor] | None = None,
    versions: TokenVersions | None = None,
    metadata: list[dict | None] | None = None,
) -> SlimeMicrobatch:
    """The packing step both hooks share: gather the CP-local per-sample tensors into whole
    responses (a collective over the CP group, in the same order on every rank), check them
    against the response lengths and pack them once. ``old_name`` names ``old_log_probs`` in
    errors as the hook's input calls them."""
    layout = _Layout(total_lengths, response_lengths)
    whole = PackedSamples.pack(
        layout.response_lengths,
        loss_masks=list(loss_masks),
        log_probs=layout.gather(log_probs) if log_probs is not None else None,
        old_log_probs=layout.gather(old_log_probs),
        advantages=layout.gather(advantages) if advantages is not None else None,
        rollout_log_probs=layout.gather(rollout_log_probs) if rollout_log_probs is not None else None,
        old_name=old_name,
    )
    return SlimeMicrobatch(
        layout=layout, whole=whole, loss_masks=loss_masks, old_log_probs=old_log_probs, log_probs=log_probs,
        entropy=entropy, rollout_log_probs=rollout_log_probs, advantages=advantages, ref_log_probs=ref_log_probs,
        total_lengths=total_lengths, versions=versions, metadata=metadata)


def read_batch(args: Any, config: LossSettings, batch: dict, logits: torch.Tensor) -> SlimeMicrobatch:
    """``policy_loss``'s reading of slime's batch: the current log-probs and entropies from
    ``logits``, the proximal and rollout log-probs the mode needs, then ``read_samples``."""
    response_lengths = [int(n) for n in batch["response_lengths"]]
    log_probs, entropy = current_log_probs(args, batch, logits)
    old_log_probs = batch.get("log_probs") or None
    rollout_log_probs = batch.get("rollout_log_probs") or None
    versions = token_versions(batch, response_lengths)
    if config.is_mode != "on_policy" and rollout_log_probs is None:
        raise AprilConfigError(f"april_is_mode: {config.is_mode} needs rollout log-probs in the batch; the rollout "
                               "must return them (SGLang return_logprob) for every response token")
    if old_log_probs is None:
        old_log_probs = _proximal_without_recompute(args, config, log_probs, rollout_log_probs, versions)
    return read_samples(
        response_lengths, batch.get("total_lengths"), loss_masks=batch["loss_masks"], old_log_probs=old_log_probs,
        old_name="log_probs", log_probs=log_probs, entropy=entropy, rollout_log_probs=rollout_log_probs,
        advantages=batch["advantages"],
        ref_log_probs=batch["ref_log_probs"] if getattr(args, "use_kl_loss", False) else None,
        versions=versions, metadata=batch.get("metadata"))


def _proximal_without_recompute(args: Any, config: LossSettings, log_probs: list[torch.Tensor],
                                rollout_log_probs: list[torch.Tensor] | None,
                                versions: TokenVersions | None) -> list[torch.Tensor]:
    """pi_prox when slime did not recompute it (``april_slime.training.proximal``): the training
    forward's own log-probs with one optimizer step per rollout, or with copris (which anchors on
    the rollout: pi_prox only feeds its metrics); the log-linear interpolation otherwise."""
    steps = vcpo.steps_per_rollout(args)
    needs_prox = config.is_mode == "decoupled" or (config.is_mode == "on_policy" and steps > 1)
    if not needs_prox or steps == 1:
        if config.is_mode == "decoupled" and config.prox_log_probs == "recompute":
            raise AprilConfigError("april_is_mode: decoupled with april_prox_log_probs: recompute needs slime's "
                                   "recomputed proximal log-probs; drop --use-rollout-logprobs")
        return [lp.detach() for lp in log_probs]
    if config.prox_log_probs != "loglinear":
        raise AprilConfigError(
            f"april_is_mode: {config.is_mode} with {steps} optimizer steps per rollout needs the proximal log-probs: "
            "let slime recompute them (drop --use-rollout-logprobs) or set april_prox_log_probs: loglinear")
    rt = vcpo.runtime()
    if rt is None:
        raise AprilConfigError("april_prox_log_probs: loglinear needs the step of the rollout: add "
                               "--custom-megatron-before-train-step-hook-path april_slime.vcpo.before_train_step")
    if versions is None or rollout_log_probs is None or any(v is None for v in versions[0]):
        raise AprilConfigError("april_prox_log_probs: loglinear needs every sample's per-token policy versions "
                               "(april_slime's rollout with patches/slime-forward-train-metadata.patch)")
    per_sample, references = versions
    out = []
    for i, (lp, rlp, v, ref) in enumerate(zip(log_probs, rollout_log_probs, per_sample, references, strict=True)):
        if ref is None:
            raise AprilConfigError(f"april_prox_log_probs: loglinear: sample {i} has no {POLICY_VERSION_KEY}")
        v = v.to(lp.device)
        out.append(loglinear_proximal_log_probs(rlp.to(lp.device), lp, v, int(ref), rt.step_id, steps).to(lp.dtype))
    return out


def reuses_train_log_probs(args: Any, num_microbatches: list[int]) -> bool:
    """Asked by slime's trainer (``patches/slime-skip-proximal-recompute.patch``) before it runs its
    separate log-prob forward: True when this loss takes pi_prox from its own training forward
    (one optimizer step per rollout, ``april_prox_log_probs: auto | loglinear``) or interpolates it
    (``loglinear``), and nothing else of slime's step needs the recomputed log-probs."""
    config = config_for(args)
    if config.prox_log_probs == "recompute":
        return False
    if len(num_microbatches) != 1 and config.prox_log_probs != "loglinear":
        return False
    # what else reads slime's recomputed log-probs (as slime's own can_reuse_log_probs_in_loss lists it)
    return not (getattr(args, "kl_coef", 0) or getattr(args, "use_critic", False)
                or getattr(args, "keep_old_actor", False) or getattr(args, "use_opd", False)
                or (getattr(args, "use_routing_replay", False)
                    and not getattr(args, "use_rollout_routing_replay", False)))


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
    config = config_for(args)
    loss_level = "sequence" if getattr(args, "advantage_estimator", None) == "gspo" else config.loss_level

    mb = read_batch(args, config, batch, logits)
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
            is_low=config.is_low, is_high=config.is_high, eps_clip=args.eps_clip,
            eps_clip_high=getattr(args, "eps_clip_high", None), eps_clip_c=getattr(args, "eps_clip_c", None),
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
    loss = pg_loss - getattr(args, "entropy_coef", 0.0) * entropy_loss

    metrics: dict[str, torch.Tensor] = {}
    if getattr(args, "use_kl_loss", False):
        ref = concat_samples(mb.ref_log_probs).to(local_log_probs)
        importance = torch.exp(local_log_probs - local_old) if getattr(args, "use_unbiased_kl", False) else None
        kl_loss = token_mean(offpolicy.approx_kl(local_log_probs, ref, args.kl_loss_type, importance))
        loss = loss + args.kl_loss_coef * kl_loss
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

    per_token_loss = bool(getattr(args, "calculate_per_token_loss", False))
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
        raise AprilConfigError(
            "april_vcpo_lr_scaling / april_vcpo_baseline: the VCPO state of the job is created by the "
            "before-train-step hook; add --custom-megatron-before-train-step-hook-path "
            "april_slime.vcpo.before_train_step")
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

    Settings were checked by ``vcpo.check_settings`` when the runtime was created: copris mode,
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
            raise AprilConfigError(
                "april_vcpo_baseline_scope: group needs each sample's prompt group, which "
                "april_slime.vcpo.opob_advantages (--custom-advantage-function-path) writes to the sample's metadata "
                "and patches/slime-forward-train-metadata.patch hands to the loss; or set "
                "april_vcpo_baseline_scope: global")
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
    config = config_for(args)
    if config.vcpo_lr_scaling or config.vcpo_baseline:
        raise AprilConfigError("april_vcpo_lr_scaling / april_vcpo_baseline: the TIS hook only sees the recomputed "
                               "log-probs and cannot feed VCPO; use the custom loss april_slime.loss.policy_loss")
    apply = bool(getattr(args, "use_tis", False))
    if apply and config.is_mode != "decoupled":
        hint = ("on_policy ignores rollout log-probs: drop --use-tis" if config.is_mode == "on_policy" else
                "copris clips against the rollout log-probs: use --use-rollout-logprobs without --use-tis, or the "
                "custom loss april_slime.loss.policy_loss for copris with TIS/MIS")
        raise AprilConfigError(f"april_is_mode: the TIS hook implements decoupled PPO; {hint}")
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
                                      bool(getattr(args, "calculate_per_token_loss", False))),
        **loss_metrics.is_weight_quantiles(behaviour, mask),
    }
    trained = mask.bool()
    metrics = {METRIC_PREFIX + k: mb.to_local(without_masked(v, trained)).detach().clone()
               for k, v in per_token.items()}
    if mb.versions is not None:
        staleness = mb.local_staleness_metrics(behaviour_ratio)
        metrics.update({METRIC_PREFIX + k: v.detach().clone() for k, v in staleness.items()})
    return pg_loss, loss_masks, metrics
