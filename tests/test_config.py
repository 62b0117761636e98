"""Settings: parsing from slime args / YAML, validation with one-line reasons."""

from types import SimpleNamespace

import pytest
import yaml

from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.job import for_job, read_settings
from april_slime.job_checks import check_job, check_rollout_shape
from april_slime.settings import JobSettings, settings_table_markdown
from april_slime.slime_args import SlimeArgs
from april_slime.training import baseline, offpolicy
from april_slime.training import settings as loss_settings
from april_slime.training.settings import LossSettings


def test_defaults_are_valid():
    config = AprilConfig()
    config.validate()
    assert config.policy == "copris"
    assert config.resolved_concurrency(32, 8) == 256


def test_from_args_reads_prefixed_attributes_and_ignores_unset():
    args = SimpleNamespace(april_policy="april", april_over_sampling_factor=3, april_max_staleness=None,
                           rollout_batch_size=4)
    config = read_settings(args).rollout
    assert config.policy == "april"
    assert config.over_sampling_factor == 3.0 and isinstance(config.over_sampling_factor, float)
    assert config.max_staleness is None


def test_yaml_strings_are_coerced(tmp_path):
    # slime sets every YAML key of --custom-config-path as an attribute of args, values as YAML typed them
    path = tmp_path / "april.yaml"
    path.write_text("april_policy: copris\napril_concurrency: '64'\napril_adaptive_concurrency: 'true'\n"
                    "april_is_high: 5\n")
    args = SimpleNamespace(**yaml.safe_load(path.read_text()))
    job = read_settings(args)
    assert job.rollout.concurrency == 64
    assert job.rollout.adaptive_concurrency is True
    assert job.loss.is_high == 5.0


@pytest.mark.parametrize(
    "values, key",
    [
        ({"policy": "fast"}, "april_policy"),
        ({"concurrency": 0}, "april_concurrency"),
        ({"concurrency": 2.5}, "april_concurrency"),
        ({"over_sampling_factor": 0.5}, "april_over_sampling_factor"),
        ({"over_sampling_factor": float("nan")}, "april_over_sampling_factor"),
        ({"max_staleness": -1}, "april_max_staleness"),
        ({"stale_action": "ignore"}, "april_stale_action"),
        ({"is_low": 3.0, "is_high": 2.0}, "april_is_high"),
        ({"vcpo_rho_on": 1.5}, "april_vcpo_rho_on"),
        ({"adaptive_concurrency": "maybe"}, "april_adaptive_concurrency"),
        ({"no_such_key": 1}, "april_no_such_key"),
        ({"max_concurrency": 1, "min_concurrency": 4}, "april_max_concurrency"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(values, key):
    with pytest.raises(AprilConfigError) as err:
        JobSettings.from_dict(values)
    message = str(err.value)
    assert message.startswith(key + ":")
    assert "\n" not in message


def test_cross_checks_with_slime_args():
    config = AprilConfig.from_dict({"concurrency": 4})
    with pytest.raises(AprilConfigError, match="april_concurrency"):
        check_rollout_shape(SlimeArgs(rollout_batch_size=8, n_samples_per_prompt=8), config)
    check_rollout_shape(SlimeArgs(rollout_batch_size=8, n_samples_per_prompt=4), config)
    with pytest.raises(AprilConfigError, match="april_is_mode"):
        job = JobSettings.from_dict({"is_mode": "decoupled"})
        check_job(SlimeArgs(use_rollout_logprobs=True), job.rollout, job.loss)
    # the live-episode cap holds whole groups: below one group nothing could ever open
    capped = AprilConfig.from_dict({"max_live_episodes": 6})
    with pytest.raises(AprilConfigError, match=r"april_max_live_episodes: must be >= n_samples_per_prompt \(8\)"):
        check_rollout_shape(SlimeArgs(rollout_batch_size=8, n_samples_per_prompt=8), capped)
    check_rollout_shape(SlimeArgs(rollout_batch_size=8, n_samples_per_prompt=6), capped)


def test_round_trip_and_table_lists_every_key():
    config = JobSettings.from_dict({"policy": "sync", "max_staleness": 2, "is_high": 3.0})
    assert JobSettings.from_dict(config.to_dict(prefixed=True)) == config
    table = settings_table_markdown()
    for key in config.to_dict(prefixed=True):
        assert f"`{key}`" in table


def test_docs_settings_table_is_current():
    # docs/settings.md's table is generated from the fields: regenerate it with `april-slime settings`
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text(encoding="utf-8")
    assert settings_table_markdown() in page


# ------------------------------------------------------------------ misspelled and unprefixed keys
def _args_from_yaml(tmp_path, text, **slime_args):
    """args as slime leaves them: its own arguments, then every key of --custom-config-path set on it."""
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    args = SimpleNamespace(custom_config_path=str(path), rollout_batch_size=8, rollout_temperature=1.0,
                           **slime_args)
    for key, value in (yaml.safe_load(path.read_text()) or {}).items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("text, key, closest", [
    ("april_polcy: april\n", "april_polcy", "april_policy"),
    ("april_max_stalenes: 2\n", "april_max_stalenes", "april_max_staleness"),
    ("policy: april\n", "policy", "april_policy"),
    ("max_staleness: 2\n", "max_staleness", "april_max_staleness"),
    ("aprl_policy: april\n", "aprl_policy", "april_policy"),
    ("april-policy: april\n", "april-policy", "april_policy"),
    ("April_Policy: april\n", "April_Policy", "april_policy"),
    ("polcy: april\n", "polcy", "april_policy"),
    ("april_is_hihg: 3\n", "april_is_hihg", "april_is_high"),
])
def test_a_misspelled_or_unprefixed_key_stops_the_job_naming_the_closest(tmp_path, text, key, closest):
    with pytest.raises(AprilConfigError) as err:
        read_settings(_args_from_yaml(tmp_path, text))
    message = str(err.value)
    assert message.startswith(f"{key}:") and message.endswith(closest) and "\n" not in message


def test_an_unknown_april_attribute_stops_the_job_also_without_a_yaml():
    # set by a launcher or an extra-args provider rather than the custom YAML
    with pytest.raises(AprilConfigError, match=r"^april_polcy: unknown setting; closest valid name: april_policy$"):
        read_settings(SimpleNamespace(april_polcy="april"))


def test_slimes_own_args_and_users_own_yaml_keys_pass(tmp_path):
    text = ("april_policy: april\nrollout_temperature: 0.7\nreward_model_url: http://rm\n"
            "my_reward_threshold: 0.5\ntimeout: 30\n")
    config = read_settings(_args_from_yaml(tmp_path, text)).rollout
    assert config.policy == "april"


def test_an_unreadable_custom_yaml_still_checks_april_attributes(tmp_path):
    args = SimpleNamespace(custom_config_path=str(tmp_path / "gone.yaml"), policy="april")
    assert read_settings(args).rollout.policy == "copris"  # cannot know `policy` came from the YAML
    args.april_polcy = "april"
    with pytest.raises(AprilConfigError, match="^april_polcy:"):
        read_settings(args)


# ------------------------------------------------------------------ absurd values and impossible combinations
def test_an_empty_setting_in_the_yaml_stops_the_job(tmp_path):
    with pytest.raises(AprilConfigError, match=r"^april_policy: must not be empty$"):
        read_settings(_args_from_yaml(tmp_path, "april_policy:\n"))
    # an optional setting left empty is unset, as documented
    assert read_settings(_args_from_yaml(tmp_path, "april_max_staleness:\n")).rollout.max_staleness is None


@pytest.mark.parametrize("values, key", [
    ({"request_timeout_s": float("inf")}, "april_request_timeout_s"),
    ({"request_timeout_s": "inf"}, "april_request_timeout_s"),
    ({"retry_backoff_s": float("inf")}, "april_retry_backoff_s"),
    ({"retry_backoff_s": 10.0, "max_retries": 20}, "april_retry_backoff_s"),
    ({"max_retries": 1000}, "april_max_retries"),
    ({"vcpo_lr_scale_max": 1e9}, "april_vcpo_lr_scale_max"),
    ({"vcpo_lr_scale_max": float("inf")}, "april_vcpo_lr_scale_max"),
    ({"over_sampling_factor": 1e9}, "april_over_sampling_factor"),
    ({"policy": ""}, "april_policy"),
    ({"policy": None}, "april_policy"),
    ({"buffer_dir": ""}, "april_buffer_dir"),
    ({"policy": "sync", "adaptive_concurrency": True}, "april_adaptive_concurrency"),
    ({"policy": "april", "adaptive_concurrency": True}, "april_adaptive_concurrency"),
    ({"max_concurrency": 64}, "april_max_concurrency"),
    ({"adaptive_concurrency": True, "concurrency": 64, "max_concurrency": 32}, "april_concurrency"),
    ({"adaptive_concurrency": True, "concurrency": 4, "min_concurrency": 8}, "april_concurrency"),
])
def test_absurd_values_and_impossible_combinations_are_refused_by_name(values, key):
    with pytest.raises(AprilConfigError) as err:
        JobSettings.from_dict(values)
    assert str(err.value).startswith(key + ":") and "\n" not in str(err.value)


def test_sane_edges_pass():
    JobSettings.from_dict({"vcpo_lr_scale_max": 10.0, "max_retries": 20, "retry_backoff_s": 0.05,
                           "over_sampling_factor": 100.0, "request_timeout_s": 86400.0})
    JobSettings.from_dict({"adaptive_concurrency": True, "concurrency": 64, "min_concurrency": 8,
                           "max_concurrency": 512})


def test_vcpo_settings_imply_vcpos_objective_unless_set():
    """VCPO's rules are derived for sequence-level importance weights truncated at 8 (the baseline
    also for copris's estimator): its settings make that the objective where the job does not
    choose one, and keep what the job sets."""
    plain = JobSettings.from_dict({}).loss
    assert (plain.is_mode, plain.is_level, plain.is_high) == ("decoupled", "token", 2.0)
    lr = JobSettings.from_dict({"vcpo_lr_scaling": True}).loss
    assert (lr.is_mode, lr.is_level, lr.is_correction, lr.is_high) == ("decoupled", "sequence", "truncate", 8.0)
    both = JobSettings.from_dict({"april_vcpo_baseline": True, "april_vcpo_lr_scaling": True}).loss
    assert (both.is_mode, both.is_level, both.is_high) == ("copris", "sequence", 8.0)
    chosen = JobSettings.from_dict({"vcpo_lr_scaling": True, "is_level": "token", "is_high": 2.0}).loss
    assert (chosen.is_level, chosen.is_high) == ("token", 2.0)
    off = JobSettings.from_dict({"vcpo_lr_scaling": False}).loss
    assert (off.is_level, off.is_high) == ("token", 2.0)
    # as slime hands them over: the attributes the job set
    from_args = read_settings(SimpleNamespace(april_vcpo_baseline=True)).loss
    assert (from_args.is_mode, from_args.is_level, from_args.is_high) == ("copris", "sequence", 8.0)


# ------------------------------------------------------------------ settings by wing, checked once per job
def test_each_setting_has_one_wing_and_the_training_wing_checks_its_own_vocabulary():
    rollout = {f for f in AprilConfig.__dataclass_fields__}
    loss = LossSettings.names()
    assert rollout and loss and not rollout & loss
    assert set(JobSettings.from_dict({}).to_dict()) == rollout | loss
    # the loss functions accept exactly the values the settings accept (one definition)
    assert offpolicy.IS_MODES is loss_settings.IS_MODES and offpolicy.LOSS_LEVELS is loss_settings.LOSS_LEVELS
    assert baseline.VCPO_BASELINE_SCOPES is loss_settings.VCPO_BASELINE_SCOPES
    with pytest.raises(AprilConfigError, match="^april_is_mode: must be one of on_policy, copris, decoupled"):
        JobSettings.from_dict({"is_mode": "clipped"})
    with pytest.raises(AprilConfigError, match="^april_is_mode: not a rollout setting$"):
        AprilConfig.from_dict({"is_mode": "copris"})  # the rollout's settings alone do not take the loss's


@pytest.mark.parametrize("slime_args, message", [
    (dict(advantage_estimator="cispo"), "^april_is_mode: the custom loss implements PPO/GSPO objectives, not CISPO"),
    (dict(use_opsm=True), "^april_is_mode: --use-opsm is not supported by the custom loss$"),
])
def test_what_the_custom_loss_cannot_serve_is_refused_when_the_job_first_asks_for_its_settings(slime_args, message):
    args = SimpleNamespace(loss_type="custom_loss", custom_loss_function_path="april_slime.loss.policy_loss",
                           april_is_mode="copris", **slime_args)
    with pytest.raises(AprilConfigError, match=message):
        for_job(args)
    # with slime's own loss (april_slime.loss.tis as its TIS hook) the same arguments are served
    args.custom_loss_function_path = None
    assert for_job(args).loss.is_mode == "copris"
