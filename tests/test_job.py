"""The seam: slime's ``args`` read once per job into a frozen ``SlimeJob`` (``april_slime.job``).

``SlimeArgs`` names every argument the plugin reads under slime's own name; a misspelled name would
silently read its default forever, so each is checked against what slime's own parser (and
Megatron's, for the few Megatron arguments) defines.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from april_slime.core.config import AprilConfigError
from april_slime.job import describe, read_settings
from april_slime.slime_args import LATER_SLIME_ARGUMENTS, SlimeArgs
from tests.support.job_args import MEGATRON_DEFAULTS, job_args


def test_every_argument_the_plugin_reads_is_one_slime_or_megatron_defines(tmp_path):
    args = job_args(tmp_path, {})
    names = {f.name for f in dataclasses.fields(SlimeArgs)}
    unknown = sorted(n for n in names if not hasattr(args, n) and n not in LATER_SLIME_ARGUMENTS)
    assert unknown == []
    assert not LATER_SLIME_ARGUMENTS & set(vars(args)), "the pinned slime now defines them: drop them from the list"
    assert {"num_layers", "moe_router_topk", "pipeline_model_parallel_size"} <= set(MEGATRON_DEFAULTS) & names


def test_the_job_is_read_once_and_then_left_alone(tmp_path):
    args = job_args(tmp_path, {"policy": "april"}, "--rollout-temperature", "0.7")
    job = describe(args)
    assert describe(args) is job
    assert job.rollout.policy == "april" and job.slime.rollout_temperature == 0.7
    assert job.sampling_params["temperature"] == 0.7 and "max_new_tokens" not in job.sampling_params
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.slime = SlimeArgs()  # type: ignore[misc]
    with pytest.raises(TypeError):
        job.sampling_params["temperature"] = 1.0  # type: ignore[index]
    other = job_args(tmp_path / "other", {"policy": "copris"})
    assert describe(other) is not job and describe(other).rollout.policy == "copris"


def test_a_refusal_fires_when_the_job_is_first_described(tmp_path):
    with pytest.raises(AprilConfigError, match="^april_concurrency: must be >= n_samples_per_prompt"):
        describe(job_args(tmp_path, {"concurrency": 2}))  # groups of 4


def test_absent_arguments_take_slimes_defaults_and_derived_values_follow():
    slime = SlimeArgs.read(SimpleNamespace(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=16,
                                           over_sampling_batch_size=8, rollout_top_p=0.9))
    assert slime.rollout_seed == 42 and slime.eps_clip == 0.2 and slime.save is None
    assert slime.steps_per_rollout == 2
    assert slime.explicit_over_sampling is None  # slime fills it with the batch size when unset
    assert slime.sampling_params()["custom_params"] == {"return_top_p_token_ids": True}
    assert SlimeArgs(kl_coef=0.1).recomputes_log_probs_anyway and not SlimeArgs().recomputes_log_probs_anyway


def test_generate_functions_get_a_copy_of_slimes_args_pointing_at_the_front(tmp_path):
    args = job_args(tmp_path, {})
    view = describe(args).args_for_functions("127.0.0.1", 4567)
    assert (view.sglang_router_ip, view.sglang_router_port, view.partial_rollout) == ("127.0.0.1", 4567, False)
    assert view is not args and args.sglang_router_port != 4567
    assert view.rollout_batch_size == args.rollout_batch_size


def test_the_settings_alone_skip_the_jobs_cross_checks(tmp_path):
    args = job_args(tmp_path, {"concurrency": 2})
    assert read_settings(args).rollout.concurrency == 2
