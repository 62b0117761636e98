"""Every refusal of a job that needs only its settings and slime's arguments, in one place.

``check_job`` runs every check that needs nothing else, once per job, when the seam
(``april_slime.job.describe``) first reads the job: in a job with the plugin's data source that is
slime's rollout manager building it, which slime does before it starts the trainer and before the
first rollout, so a setting the plugin cannot serve stops the job there, with one line naming the
key. ``check_rollout`` adds what only the plugin's rollout needs of slime's arguments, run by the
same data source.

A refusal here is one the running job would otherwise meet for certain: a hook slime calls with
these arguments, a log-prob slime does not compute under them. Where the outcome depends on a user's
own code (a before-train-step hook or advantage function of their own, which may call the plugin's),
only the run-time guard decides.

What needs the running job is refused where it is first known (docs/settings.md, "Refusals"): the
data-parallel layout VCPO's baseline meets (``april_slime.vcpo.before_train_step``, once Megatron's
process groups exist), what the engines return (the rollout's first step), the model's layers (the
baseline's per-sample gradient hooks) and the batches' contents (the loss hooks).

The module imports neither torch nor slime: it runs in slime's rollout manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from april_slime.core.config import MASKING_POST_PROCESS, AprilConfig, AprilConfigError
from april_slime.training.settings import LossSettings

if TYPE_CHECKING:
    from april_slime.slime_args import SlimeArgs

# the import paths a job names for the plugin's hooks (april_slime.SLIME_FLAGS lists them all)
CUSTOM_LOSS_PATH = "april_slime.loss.policy_loss"
TIS_HOOK_PATH = "april_slime.loss.tis"
VCPO_HOOK_PATH = "april_slime.vcpo.before_train_step"
OPOB_ADVANTAGES_PATH = "april_slime.vcpo.opob_advantages"


def check_job(slime: SlimeArgs, rollout: AprilConfig, loss: LossSettings) -> None:
    """The start-time refusals of every job that uses the plugin: its settings (the rollout's and the
    loss's, already valid each on its own) combined with slime arguments they cannot serve
    (``AprilConfigError``, one line naming the key)."""
    check_rollout_shape(slime, rollout)
    check_custom_loss(slime, loss)
    check_tis_hook(slime, loss)
    check_vcpo_hooks(slime, loss)
    check_vcpo(slime, loss)


def check_rollout(slime: SlimeArgs) -> None:
    """What the plugin's rollout needs of slime's own arguments (its data source runs this at start)."""
    from april_slime import slime_compat

    slime_compat.check_job(slime)
    if slime.rollout_max_response_len is None:
        raise AprilConfigError("rollout_max_response_len: must be set; it is the response budget that "
                               "partial rollouts are resumed against")


# ------------------------------------------------------------------------------- the rollout
GROUP_NORMALISED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")


def check_rollout_shape(slime: SlimeArgs, c: AprilConfig) -> None:
    """The rollout settings against slime's batch: a whole group must fit in flight and alive, and
    slime's group normalisation must not count masked samples."""
    normalises = slime.advantage_estimator in GROUP_NORMALISED_ESTIMATORS and slime.rewards_normalization
    if c.mask_failed_samples and normalises and slime.custom_reward_post_process_path is None:
        raise AprilConfigError("april_mask_failed_samples: slime's group reward normalisation would count the masked "
                               f"samples; set --custom-reward-post-process-path {MASKING_POST_PROCESS}")
    batch, n = slime.rollout_batch_size, slime.n_samples_per_prompt
    if batch is not None and batch < 1:
        raise AprilConfigError(f"rollout_batch_size: must be >= 1, got {batch}")
    if n is not None and n < 1:
        raise AprilConfigError(f"n_samples_per_prompt: must be >= 1, got {n}")
    if c.policy == "copris" and c.concurrency is not None and n is not None and c.concurrency < n:
        raise AprilConfigError(f"april_concurrency: must be >= n_samples_per_prompt ({n}) so one whole group can "
                               f"be in flight, got {c.concurrency}")
    if c.max_live_episodes is not None and n is not None and c.max_live_episodes < n:
        raise AprilConfigError(f"april_max_live_episodes: must be >= n_samples_per_prompt ({n}) so one whole "
                               f"group can be alive, got {c.max_live_episodes}")


# ------------------------------------------------------------------------------- what slime computes
def needs_proximal(loss: LossSettings, steps: int) -> bool:
    """Whether the custom loss reads the proximal log-probs pi_prox: decoupled clips around them, and
    on_policy is anchored on them when the rollout has several optimizer steps."""
    return loss.is_mode == "decoupled" or (loss.is_mode == "on_policy" and steps > 1)


# ------------------------------------------------------------------------------- the loss hooks
def check_custom_loss(slime: SlimeArgs, loss: LossSettings) -> None:
    """What the custom loss (``april_slime.loss.policy_loss``) cannot serve, and where it would find
    no proximal log-probs (docs/loss.md, "The proximal log-probs")."""
    if loss.is_mode == "decoupled" and slime.use_rollout_logprobs:
        raise AprilConfigError("april_is_mode: decoupled needs the recomputed proximal log-probs; drop slime's "
                               "--use-rollout-logprobs")
    if slime.custom_loss_function_path != CUSTOM_LOSS_PATH:
        return
    if slime.advantage_estimator == "cispo":
        raise AprilConfigError("april_is_mode: the custom loss implements PPO/GSPO objectives, not CISPO; "
                               "use slime's policy_loss with april_slime.loss.tis instead")
    if slime.use_opsm:
        raise AprilConfigError("april_is_mode: --use-opsm is not supported by the custom loss")
    steps = slime.steps_per_rollout
    if not needs_proximal(loss, steps) or steps == 1:
        return  # none needed, or the training forward's own (one optimizer step per rollout)
    rollout_only = bool(slime.use_rollout_logprobs)  # slime recomputes nothing
    if rollout_only and loss.prox_log_probs != "loglinear":
        raise AprilConfigError(proximal_missing_message(loss.is_mode, steps))
    interpolates = loss.prox_log_probs == "loglinear" and (rollout_only or not slime.recomputes_log_probs_anyway)
    if interpolates and slime.custom_megatron_before_train_step_hook_path is None:
        raise AprilConfigError(LOGLINEAR_NEEDS_HOOK)


def proximal_missing_message(is_mode: str, steps: int) -> str:
    return (f"april_is_mode: {is_mode} with {steps} optimizer steps per rollout needs the proximal log-probs: "
            "let slime recompute them (drop --use-rollout-logprobs) or set april_prox_log_probs: loglinear")


LOGLINEAR_NEEDS_HOOK = ("april_prox_log_probs: loglinear needs the step of the rollout: add "
                        f"--custom-megatron-before-train-step-hook-path {VCPO_HOOK_PATH}")


def check_tis_hook(slime: SlimeArgs, loss: LossSettings) -> None:
    """The TIS hook (``april_slime.loss.tis``), which slime calls with --use-tis or
    --get-mismatch-metrics: it implements decoupled PPO and sees only the recomputed log-probs."""
    if slime.custom_tis_function_path != TIS_HOOK_PATH:
        return
    if not (slime.use_tis or slime.get_mismatch_metrics):
        return
    if loss.vcpo_lr_scaling or loss.vcpo_baseline:
        raise AprilConfigError(TIS_REFUSES_VCPO)
    if slime.use_tis:
        check_tis_mode(loss.is_mode)


TIS_REFUSES_VCPO = ("april_vcpo_lr_scaling / april_vcpo_baseline: the TIS hook only sees the recomputed "
                    f"log-probs and cannot feed VCPO; use the custom loss {CUSTOM_LOSS_PATH}")


def check_tis_mode(is_mode: str) -> None:
    """With --use-tis the hook reweights slime's PPO loss, which clips around the recomputed log-probs."""
    if is_mode == "decoupled":
        return
    hint = ("on_policy ignores rollout log-probs: drop --use-tis" if is_mode == "on_policy" else
            "copris clips against the rollout log-probs: use --use-rollout-logprobs without --use-tis, or the "
            f"custom loss {CUSTOM_LOSS_PATH} for copris with TIS/MIS")
    raise AprilConfigError(f"april_is_mode: the TIS hook implements decoupled PPO; {hint}")


# ------------------------------------------------------------------------------------ VCPO
VCPO_NEEDS_HOOK = ("april_vcpo_lr_scaling / april_vcpo_baseline: the VCPO state of the job is created by the "
                   f"before-train-step hook; add --custom-megatron-before-train-step-hook-path {VCPO_HOOK_PATH}")
GROUP_SCOPE_NEEDS_ADVANTAGES = (
    "april_vcpo_baseline_scope: group needs each sample's prompt group, which "
    f"{OPOB_ADVANTAGES_PATH} (--custom-advantage-function-path) writes to the sample's metadata "
    "and patches/slime-forward-train-metadata.patch hands to the loss; or set "
    "april_vcpo_baseline_scope: global")


def check_vcpo_hooks(slime: SlimeArgs, loss: LossSettings) -> None:
    """VCPO's state lives in the before-train-step hook, and the group scope reads the prompt groups
    that ``opob_advantages`` writes: a job that names no such hook cannot run them. (A hook of the
    user's own may call the plugin's; the loss refuses at its first micro-batch if it did not.)"""
    if not (loss.vcpo_lr_scaling or loss.vcpo_baseline):
        return
    if slime.custom_megatron_before_train_step_hook_path is None:
        raise AprilConfigError(VCPO_NEEDS_HOOK)
    if (loss.vcpo_baseline and loss.vcpo_baseline_scope == "group"
            and slime.custom_advantage_function_path is None):
        raise AprilConfigError(GROUP_SCOPE_NEEDS_ADVANTAGES)


def check_vcpo(slime: SlimeArgs, config: LossSettings, dp_size: int = 1) -> None:
    """Refuse, in one ``AprilConfigError``, every setup the enabled VCPO controls cannot serve. At
    start ``dp_size`` is 1; ``april_slime.vcpo.before_train_step`` runs it again with the data-parallel
    size Megatron's process groups have (the group scope's layouts on several ranks)."""
    if not (config.vcpo_lr_scaling or config.vcpo_baseline):
        return
    loss_type = slime.loss_type
    if loss_type is not None and loss_type != "custom_loss":
        raise AprilConfigError(
            "april_vcpo_lr_scaling / april_vcpo_baseline: VCPO is fed by the custom loss; set --loss-type custom_loss "
            f"--custom-loss-function-path {CUSTOM_LOSS_PATH} (got --loss-type {loss_type})")
    if not config.vcpo_baseline:
        return
    estimator = slime.advantage_estimator
    checks = [
        (slime.pipeline_model_parallel_size or 1) > 1,
        (slime.context_parallel_size or 1) > 1,
        bool(slime.overlap_grad_reduce),
        bool(slime.use_kl_loss),
        float(slime.entropy_coef or 0.0) != 0.0,
        bool(slime.recompute_loss_function),
        config.is_mode != "copris",
        config.is_level != "sequence",
        config.loss_level != "token" or estimator in ("gspo", "cispo"),
        config.vcpo_length_norm and bool(slime.calculate_per_token_loss),
    ]
    reasons = [
        "pipeline parallelism (only the last stage sees the rewards)",
        "context parallelism (sequences split across ranks)",
        "--overlap-grad-reduce (gradients must stay local until the baseline is applied)",
        "--use-kl-loss (the baseline is defined for the pure policy-gradient loss)",
        "a non-zero --entropy-coef (same reason)",
        "--recompute-loss-function (the loss would register its micro-batch twice)",
        f"april_is_mode={config.is_mode} (the baseline is derived for the importance-weighted REINFORCE "
        "estimator against the rollout log-probs: set april_is_mode: copris; decoupled and on_policy clip "
        "around the recomputed policy, which has no per-trajectory baseline)",
        f"april_is_level={config.is_level} (one weight per trajectory: set april_is_level: sequence)",
        f"april_loss_level={config.loss_level} / --advantage-estimator {estimator} (the baselined loss is "
        "REINFORCE, not a GSPO or CISPO objective)",
        "april_vcpo_length_norm with --calculate-per-token-loss (the loss would be divided by the lengths twice)",
    ]
    bad = [r for c, r in zip(checks, reasons) if c]
    if config.vcpo_baseline_scope == "group":
        bad += _group_scope_problems(slime, dp_size)
    if bad:
        raise AprilConfigError("april_vcpo_baseline: not supported with " + "; ".join(bad))


def groups_across_ranks(slime: SlimeArgs, dp_size: int) -> bool:
    """Whether slime's static schedule spreads each prompt group over the data-parallel ranks:
    micro-batches smaller than a group go to the ranks round-robin (VCPO's one sample per
    micro-batch among them), so every rank holds a part of every group, at the same micro-batches."""
    n = slime.n_samples_per_prompt
    mbs = slime.micro_batch_size
    return bool(dp_size > 1 and n and mbs and mbs < n)


def _group_scope_problems(slime: SlimeArgs, dp_size: int) -> list[str]:
    """The group scope folds each prompt group when its last sample's backward has run, so a
    group must lie in consecutive micro-batches that hold no other group: on one rank, or, spread
    over the data-parallel ranks (``groups_across_ranks``), at the same micro-batches of each."""
    n = slime.n_samples_per_prompt
    mbs = slime.micro_batch_size
    gbs = slime.global_batch_size
    out = []
    hint = "; or set april_vcpo_baseline_scope: global"
    if slime.use_dynamic_batch_size:
        out.append("april_vcpo_baseline_scope: group with --use-dynamic-batch-size (its packing mixes prompt "
                   f"groups in a micro-batch): use --micro-batch-size 1 or {n or 'n_samples_per_prompt'}{hint}")
    elif n and mbs and n % mbs:
        out.append(f"april_vcpo_baseline_scope: group with --micro-batch-size {mbs} (it must divide "
                   f"--n-samples-per-prompt {n} so that no micro-batch holds two prompt groups){hint}")
    elif groups_across_ranks(slime, dp_size):
        if n % (mbs * dp_size):
            out.append(f"april_vcpo_baseline_scope: group with --micro-batch-size {mbs} on {dp_size} data-parallel "
                       f"ranks (--n-samples-per-prompt {n} must be a multiple of {mbs * dp_size}, or equal "
                       f"--micro-batch-size, so that each prompt group lies at the same micro-batches of every "
                       f"rank){hint}")
        if slime.balance_data:
            out.append(f"april_vcpo_baseline_scope: group with --micro-batch-size {mbs} < --n-samples-per-prompt "
                       f"{n} and --balance-data on {dp_size} data-parallel ranks (its partition puts a group's "
                       f"micro-batches at different positions on the ranks){hint}")
    if n and gbs and gbs % n:
        out.append(f"april_vcpo_baseline_scope: group with --global-batch-size {gbs} (not a multiple of "
                   f"--n-samples-per-prompt {n}: a group would be split between optimizer steps){hint}")
    return out
