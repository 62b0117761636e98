"""Every refusal that needs only the settings and slime's arguments stops the job at start.

Each case parses a job's command line with slime's own parser (``tests.support.job_args``), the
plugin's settings in its ``--custom-config-path`` YAML, and runs what slime's rollout manager runs
when it builds the plugin's data source (``april_slime.data_source.load_config``): no engine, no
trainer, no rollout. The refusal is one line that starts with the key it names.
"""

from __future__ import annotations

import re

import pytest

from april_slime import job_checks
from april_slime.core.config import AprilConfigError
from april_slime.data_source import AprilDataSource, load_config
from tests.support.job_args import job_args

pytest.importorskip("slime.utils.arguments", reason="the checks parse a job's command line with slime's own parser")

VCPO_HOOK = ("--custom-megatron-before-train-step-hook-path", "april_slime.vcpo.before_train_step")
OPOB_ADVANTAGES = ("--custom-advantage-function-path", "april_slime.vcpo.opob_advantages")
TIS_HOOK = ("--custom-tis-function-path", "april_slime.loss.tis")
TWO_STEPS = ("--global-batch-size", "8")  # 4 prompts x 4 samples in two optimizer steps
VCPO_JOB = (*VCPO_HOOK, *OPOB_ADVANTAGES, "--use-rollout-logprobs")
BASELINE = {"vcpo_baseline": True}

# (settings, argv, Megatron's arguments, the key the line starts with, what it says)
REFUSALS = {
    # the rollout's settings against slime's batch
    "concurrency below one group": ({"policy": "copris", "concurrency": 2}, (), {}, "april_concurrency",
                                    r"must be >= n_samples_per_prompt \(4\)"),
    "live episodes below one group": ({"max_live_episodes": 3}, (), {}, "april_max_live_episodes",
                                      r"must be >= n_samples_per_prompt \(4\)"),
    "masking under group normalisation": ({"mask_failed_samples": True}, ("--advantage-estimator", "grpo"), {},
                                          "april_mask_failed_samples", "--custom-reward-post-process-path"),
    # what the plugin's rollout reads of slime's arguments
    "top-p out of range": ({}, ("--rollout-top-p", "1.5"), {}, "rollout_top_p", r"must lie in \(0, 1\]"),
    "routing replay without the model's shape": ({}, ("--use-rollout-routing-replay",), {},
                                                 "use_rollout_routing_replay", "needs num_layers"),
    # the custom loss
    "decoupled without the recompute": ({"is_mode": "decoupled"}, ("--use-rollout-logprobs",), {},
                                        "april_is_mode", "decoupled needs the recomputed proximal"),
    "CISPO under the custom loss": ({}, ("--advantage-estimator", "cispo"), {}, "april_is_mode", "not CISPO"),
    "OPSM under the custom loss": ({}, ("--use-opsm",), {}, "april_is_mode", "--use-opsm is not supported"),
    "on_policy steps without proximal log-probs": ({"is_mode": "on_policy"}, (*TWO_STEPS, "--use-rollout-logprobs"),
                                                   {}, "april_is_mode",
                                                   "2 optimizer steps per rollout needs the proximal log-probs"),
    "loglinear without the step of the rollout": ({"prox_log_probs": "loglinear"}, TWO_STEPS, {},
                                                  "april_prox_log_probs", "needs the step of the rollout"),
    # the TIS hook on slime's own loss
    "TIS hook with VCPO": ({"vcpo_lr_scaling": True}, ("--loss-type", "policy_loss", "--use-tis", *TIS_HOOK,
                                                       *VCPO_HOOK), {},
                           "april_vcpo_lr_scaling / april_vcpo_baseline", "the TIS hook only sees"),
    "TIS hook reweighting copris": ({"is_mode": "copris"}, ("--loss-type", "policy_loss", "--use-tis", *TIS_HOOK), {},
                                    "april_is_mode", "the TIS hook implements decoupled PPO; copris"),
    "TIS hook reweighting on_policy": ({"is_mode": "on_policy"}, ("--loss-type", "policy_loss", "--use-tis",
                                                                  *TIS_HOOK), {},
                                       "april_is_mode", "drop --use-tis"),
    # VCPO
    "VCPO without its hook": ({"vcpo_lr_scaling": True}, (), {}, "april_vcpo_lr_scaling / april_vcpo_baseline",
                              "before-train-step hook"),
    "group baseline without the prompt groups": (BASELINE, (*VCPO_HOOK, "--use-rollout-logprobs"), {},
                                                 "april_vcpo_baseline_scope", "--custom-advantage-function-path"),
    "VCPO on slime's loss": ({"vcpo_lr_scaling": True}, ("--loss-type", "policy_loss", *VCPO_HOOK), {},
                             "april_vcpo_lr_scaling / april_vcpo_baseline", "set --loss-type custom_loss"),
    "baseline with pipeline parallelism": (BASELINE, VCPO_JOB, {"pipeline_model_parallel_size": 2},
                                           "april_vcpo_baseline", "pipeline parallelism"),
    "baseline with context parallelism": (BASELINE, VCPO_JOB, {"context_parallel_size": 2}, "april_vcpo_baseline",
                                          "context parallelism"),
    "baseline with --overlap-grad-reduce": (BASELINE, VCPO_JOB, {"overlap_grad_reduce": True}, "april_vcpo_baseline",
                                            "--overlap-grad-reduce"),
    "baseline with an entropy bonus": (BASELINE, (*VCPO_JOB, "--entropy-coef", "0.01"), {}, "april_vcpo_baseline",
                                       "entropy-coef"),
    "baseline with the loss recomputed": (BASELINE, (*VCPO_JOB, "--recompute-loss-function"), {},
                                          "april_vcpo_baseline", "--recompute-loss-function"),
    "baseline under decoupled": ({**BASELINE, "is_mode": "decoupled"}, (*VCPO_HOOK, *OPOB_ADVANTAGES), {},
                                 "april_vcpo_baseline", "april_is_mode=decoupled"),
    "baseline at token level": ({**BASELINE, "is_level": "token"}, VCPO_JOB, {}, "april_vcpo_baseline",
                                "april_is_level=token"),
    "baseline under GSPO": (BASELINE, (*VCPO_JOB, "--advantage-estimator", "gspo"), {}, "april_vcpo_baseline",
                            "--advantage-estimator gspo"),
    "baseline length-normalised per token": (BASELINE, (*VCPO_JOB, "--calculate-per-token-loss"), {},
                                             "april_vcpo_baseline", "divided by the lengths twice"),
    "group baseline with dynamic batches": (BASELINE, (*VCPO_JOB, "--use-dynamic-batch-size",
                                                       "--max-tokens-per-gpu", "4096"), {},
                                            "april_vcpo_baseline", "--use-dynamic-batch-size"),
    "group baseline with micro-batches across groups": (BASELINE, (*VCPO_JOB, "--micro-batch-size", "3"), {},
                                                        "april_vcpo_baseline", "must divide --n-samples-per-prompt 4"),
    "group baseline with groups split across steps": (BASELINE, (*VCPO_JOB, "--global-batch-size", "6"), {},
                                                      "april_vcpo_baseline", "--global-batch-size 6"),
}


@pytest.mark.parametrize("settings, argv, megatron, key, says", REFUSALS.values(), ids=REFUSALS.keys())
def test_each_refusal_stops_the_job_at_start_with_one_line_naming_the_key(tmp_path, settings, argv, megatron, key,
                                                                          says):
    args = job_args(tmp_path, settings, *argv, **megatron)
    with pytest.raises(AprilConfigError) as refused:
        load_config(args)
    message = str(refused.value)
    assert message.startswith(f"{key}:") and "\n" not in message, message
    assert re.search(says, message), message


def test_the_readme_job_and_a_whole_vcpo_job_pass(tmp_path):
    config = load_config(job_args(tmp_path / "readme", {"policy": "copris", "concurrency": 16, "max_staleness": 4,
                                                        "is_mode": "decoupled", "is_high": 2.0}))
    assert config.policy == "copris"
    load_config(job_args(tmp_path / "vcpo", {"vcpo_baseline": True, "vcpo_lr_scaling": True}, *VCPO_JOB,
                         "--micro-batch-size", "2", "--disable-rewards-normalization"))
    load_config(job_args(tmp_path / "loglinear", {"prox_log_probs": "loglinear"}, *TWO_STEPS, *VCPO_HOOK))
    load_config(job_args(tmp_path / "tis", {"is_mode": "decoupled"}, "--loss-type", "policy_loss", "--use-tis",
                         *TIS_HOOK))


def test_the_data_source_refuses_before_it_reads_a_prompt(tmp_path):
    """The loss's refusals reach the job where slime's rollout manager builds the data source, before
    the trainer exists and before the first rollout (the prompt file is never opened)."""
    args = job_args(tmp_path, {"prox_log_probs": "loglinear"}, *TWO_STEPS, "--prompt-data", str(tmp_path / "none"))
    with pytest.raises(AprilConfigError, match="^april_prox_log_probs: loglinear needs the step of the rollout"):
        AprilDataSource(args)


def test_the_tis_hooks_guard_says_the_start_time_line(tmp_path):
    """A job that reaches the TIS hook without the start-time check seeing it (a hook of the user's own
    that calls the plugin's) is stopped by the hook's guard with the same line."""
    import torch

    from april_slime import loss

    with pytest.raises(AprilConfigError) as at_start:
        load_config(job_args(tmp_path / "start", {"is_mode": "copris"}, "--loss-type", "policy_loss", "--use-tis",
                             *TIS_HOOK))
    wrapped = job_args(tmp_path / "wrapped", {"is_mode": "copris"}, "--loss-type", "policy_loss", "--use-tis",
                       "--custom-tis-function-path", "users.own.tis")
    load_config(wrapped)  # the check cannot tell what the user's hook calls
    tokens = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(AprilConfigError) as in_the_hook:
        loss.tis(wrapped, pg_loss=tokens, train_log_probs=[tokens], rollout_log_probs=[tokens],
                 loss_masks=[torch.ones(3)])
    assert str(in_the_hook.value) == str(at_start.value)
    assert job_checks.TIS_HOOK_PATH == "april_slime.loss.tis"
