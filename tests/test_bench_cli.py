"""``april-slime bench`` command line: bad input names what is wrong; short runs say what they are."""

import pytest

from april_workbench.bench import EngineSpec, Workload, apply_overrides
from april_workbench.bench.cli import main
from april_workbench.bench.spec import ENGINE_PRESETS


def test_set_with_a_value_of_the_wrong_type_names_key_and_value(capsys):
    assert main(["--set", "concurrency=abc", "--show-engine"]) == 2
    err = capsys.readouterr().err
    assert "concurrency" in err and "'abc'" in err and "integer" in err
    assert main(["--set", "mem_fraction_static=lots", "--show-engine"]) == 2
    assert "mem_fraction_static" in capsys.readouterr().err
    assert main(["--set", "no_such_key=1", "--show-engine"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_set_values_are_typed_and_range_errors_name_the_setting():
    w, s = apply_overrides(Workload(name="x"), ENGINE_PRESETS["h100-qwen3-4b"],
                           ["concurrency=768", "sweep_values=8192,16384", "policies=sync,copris",
                            "max_staleness=none", "decode_t0=2e-3"])
    assert w.concurrency == 768 and w.sweep_values == (8192.0, 16384.0)
    assert w.policies == ("sync", "copris") and w.max_staleness is None
    assert s.decode_t0 == 2e-3
    with pytest.raises(ValueError, match="concurrency=0"):
        apply_overrides(Workload(name="x"), ENGINE_PRESETS["h100-qwen3-4b"], ["concurrency=0"])


def test_steps_must_be_positive(capsys):
    assert main(["--steps", "0", "--show-engine"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_http_time_scale_must_be_positive(capsys):
    assert main(["--mode", "http", "--time-scale", "0", "--show-engine"]) == 2
    err = capsys.readouterr().err
    assert "--time-scale" in err and "Traceback" not in err


def test_one_step_runs_without_blaming_a_hidden_warmup_and_quick_says_smoke_test(capsys):
    assert main(["--quick", "--steps", "1", "--policies", "sync", "--set", "rollout_batch_size=2",
                 "--set", "max_response_len=2048"]) == 0
    out, err = capsys.readouterr()
    assert "warmup_steps" not in err
    assert out.startswith("SMOKE TEST (--quick)")
    assert "cold start included" in out


def test_engine_spec_file_replaces_the_preset_values(tmp_path, capsys):
    path = tmp_path / "spec.json"
    path.write_text('{"base_preset": "h100-qwen3-8b", "decode_t0": 0.02, "kv_capacity_tokens": 99999}')
    assert main(["--engine-spec", str(path), "--show-engine"]) == 0
    out = capsys.readouterr().out
    assert '"kv_capacity_tokens": 99999' in out and '"decode_t0": 0.02' in out
    assert EngineSpec.load(str(path)).model == "Qwen3-8B"
    path.write_text('{"decode_t0": "fast"}')
    assert main(["--engine-spec", str(path), "--show-engine"]) == 2
    assert "decode_t0" in capsys.readouterr().err
