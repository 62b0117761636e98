"""Settings: parsing from slime args / YAML, validation with one-line reasons."""

from types import SimpleNamespace

import pytest
import yaml

from april_slime.config import AprilConfig, AprilConfigError, settings_table_markdown


def test_defaults_are_valid():
    config = AprilConfig()
    config.validate()
    assert config.policy == "copris"
    assert config.resolved_concurrency(32, 8) == 256


def test_from_args_reads_prefixed_attributes_and_ignores_unset():
    args = SimpleNamespace(april_policy="april", april_over_sampling_factor=3, april_max_staleness=None,
                           rollout_batch_size=4)
    config = AprilConfig.from_args(args)
    assert config.policy == "april"
    assert config.over_sampling_factor == 3.0 and isinstance(config.over_sampling_factor, float)
    assert config.max_staleness is None


def test_yaml_strings_are_coerced(tmp_path):
    # slime sets every YAML key of --custom-config-path as an attribute of args, values as YAML typed them
    path = tmp_path / "april.yaml"
    path.write_text("april_policy: copris\napril_concurrency: '64'\napril_adaptive_concurrency: 'true'\n"
                    "april_is_high: 5\n")
    args = SimpleNamespace(**yaml.safe_load(path.read_text()))
    config = AprilConfig.from_args(args)
    assert config.concurrency == 64
    assert config.adaptive_concurrency is True
    assert config.is_high == 5.0


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
        AprilConfig.from_dict(values)
    message = str(err.value)
    assert message.startswith(key + ":")
    assert "\n" not in message


def test_cross_checks_with_slime_args():
    config = AprilConfig.from_dict({"concurrency": 4})
    with pytest.raises(AprilConfigError, match="april_concurrency"):
        config.check_against_slime(SimpleNamespace(rollout_batch_size=8, n_samples_per_prompt=8))
    config.check_against_slime(SimpleNamespace(rollout_batch_size=8, n_samples_per_prompt=4))
    with pytest.raises(AprilConfigError, match="april_is_mode"):
        AprilConfig.from_dict({"is_mode": "decoupled"}).check_against_slime(
            SimpleNamespace(use_rollout_logprobs=True))


def test_round_trip_and_table_lists_every_key():
    config = AprilConfig.from_dict({"policy": "sync", "max_staleness": 2})
    assert AprilConfig.from_dict(config.to_dict(prefixed=True)) == config
    table = settings_table_markdown()
    for key in config.to_dict(prefixed=True):
        assert f"`{key}`" in table


def test_readme_settings_table_is_current():
    # the README's table is generated from the fields: regenerate it with `april-slime settings`
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert settings_table_markdown() in readme
