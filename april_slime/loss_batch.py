"""How the loss hooks read slime's micro-batch: the packing step both hooks share.

Layout. slime hands the loss per-sample lists. With context parallelism (CP) the log-probs,
advantages and rollout log-probs are CP-local slices while ``loss_masks`` cover the whole response.
Sequence-level quantities need whole responses, so both hooks (``april_slime.loss``) start with the
same packing step (``read_samples``): it gathers every sample with slime's own CP helpers and packs
the whole responses once (``april_slime.training.packed.PackedSamples``) into a ``SlimeMicrobatch``.
Data then flows one way: batch -> packed samples -> off-policy math -> loss and metrics, the
per-token results sliced back to the local layout that slime's ``sum_of_sample_mean`` expects.
Without CP (or without slime) both layouts coincide.

Proximal log-probs: slime's recomputed ones when the batch has them; otherwise the training
forward's own (one optimizer step per rollout, or copris) or the log-linear interpolation
(``april_prox_log_probs: loglinear``, ``april_slime.training.proximal``). Every combination of
settings and slime arguments that would leave the loss without them is refused at job start
(``april_slime.job_checks.check_custom_loss``); the checks here guard the same conditions where the
loss is called outside such a job, and name what the batch lacks.

Per-token policy versions reach the loss only through the repository's slime patch. They are read
from ``batch["april_token_versions_rle"]`` (one ``[[version, count], ...]`` list per sample) or,
failing that, from ``batch["metadata"][i]["april_token_versions_rle"]`` (``Sample.train_metadata``).
Staleness is measured against ``metadata[i]["april_policy_version"]`` (the policy version the step
trains) when present, otherwise against the newest token version in the micro-batch. Without
versions the staleness metrics are left out; the loss itself never depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from april_slime import job_checks, vcpo
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import POLICY_VERSION_KEY, TOKEN_VERSIONS_KEY
from april_slime.job import SlimeJob
from april_slime.training import loss_metrics, offpolicy, staleness
from april_slime.training.packed import PackedSamples, response_log_probs_from_logits
from april_slime.training.proximal import loglinear_proximal_log_probs
from april_slime.training.settings import LossSettings

TokenVersions = tuple[list[torch.Tensor | None], list[int | None]]  # per-sample versions, reference versions


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


def current_log_probs(job: SlimeJob, batch: dict,
                      logits: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """log pi_theta of every response token and the token entropies, per sample (CP-local)."""
    helpers = _slime_log_prob_helpers()
    if helpers is not None:  # slime's own helpers take slime's arguments
        get_log_probs_and_entropy, top_p_kwargs = helpers
        _, out = get_log_probs_and_entropy(
            logits, args=job.args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=True, **top_p_kwargs(job.args, batch))
        return out["log_probs"], out["entropy"]
    if job.slime.rollout_top_p != 1.0:
        raise NotImplementedError("rollout top-p replay needs slime's log-prob helper; slime is not importable here")
    return response_log_probs_from_logits(
        logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        temperature=job.slime.rollout_temperature, with_entropy=True)


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
            versions.append(staleness.expand_version_runs(r, int(n)))
        except ValueError as exc:
            raise ValueError(f"sample {i}: {TOKEN_VERSIONS_KEY} does not match its response: {exc}") from exc
    return versions, references



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


def read_batch(job: SlimeJob, batch: dict, logits: torch.Tensor) -> SlimeMicrobatch:
    """``policy_loss``'s reading of slime's batch: the current log-probs and entropies from
    ``logits``, the proximal and rollout log-probs the mode needs, then ``read_samples``."""
    config = job.loss
    response_lengths = [int(n) for n in batch["response_lengths"]]
    log_probs, entropy = current_log_probs(job, batch, logits)
    old_log_probs = batch.get("log_probs") or None
    rollout_log_probs = batch.get("rollout_log_probs") or None
    versions = token_versions(batch, response_lengths)
    if config.is_mode != "on_policy" and rollout_log_probs is None:
        raise AprilConfigError(f"april_is_mode: {config.is_mode} needs rollout log-probs in the batch; the rollout "
                               "must return them (SGLang return_logprob) for every response token")
    if old_log_probs is None:
        old_log_probs = _proximal_without_recompute(job.slime.steps_per_rollout, config, log_probs,
                                                    rollout_log_probs, versions)
    return read_samples(
        response_lengths, batch.get("total_lengths"), loss_masks=batch["loss_masks"], old_log_probs=old_log_probs,
        old_name="log_probs", log_probs=log_probs, entropy=entropy, rollout_log_probs=rollout_log_probs,
        advantages=batch["advantages"],
        ref_log_probs=batch["ref_log_probs"] if job.slime.use_kl_loss else None,
        versions=versions, metadata=batch.get("metadata"))


def _proximal_without_recompute(steps: int, config: LossSettings, log_probs: list[torch.Tensor],
                                rollout_log_probs: list[torch.Tensor] | None,
                                versions: TokenVersions | None) -> list[torch.Tensor]:
    """pi_prox when slime did not recompute it (``april_slime.training.proximal``): the training
    forward's own log-probs with one optimizer step per rollout, or with copris (which anchors on
    the rollout: pi_prox only feeds its metrics); the log-linear interpolation otherwise. ``steps``:
    slime's optimizer steps per rollout."""
    if not job_checks.needs_proximal(config, steps) or steps == 1:
        if config.is_mode == "decoupled" and config.prox_log_probs == "recompute":
            raise AprilConfigError("april_is_mode: decoupled with april_prox_log_probs: recompute needs slime's "
                                   "recomputed proximal log-probs; drop --use-rollout-logprobs")
        return [lp.detach() for lp in log_probs]
    if config.prox_log_probs != "loglinear":
        raise AprilConfigError(job_checks.proximal_missing_message(config.is_mode, steps))
    rt = vcpo.runtime()
    if rt is None:
        raise AprilConfigError(job_checks.LOGLINEAR_NEEDS_HOOK)
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
