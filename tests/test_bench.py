"""The benchmark: time model, ideal throughput, both run modes, the JSON output and the CLI."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from april_workbench import bench
from april_workbench.bench import (
    ENGINE_PRESETS,
    Workload,
    apply_overrides,
    ideal_throughput,
    length_stats,
    plan,
    run_benchmark,
)
from april_workbench.cli import main as cli_main
from april_workbench.emulator import SyntheticLM

REQUIRED = {"throughput_tokens_per_s": float, "utilization": float, "offpolicy_token_fraction": float,
            "max_staleness": int, "recomputed_tokens": int, "discarded_tokens": int}


def tiny_workload(**kw):
    args = dict(name="tiny", length="short:median_tokens=150,truncation_fraction=0.05",
                max_response_len=600, prompt_len=16, rollout_batch_size=8, n_samples_per_prompt=4,
                steps=1, warmup_steps=0, policies=("copris",), timeline_interval_s=0.5,
                load_poll_interval_s=1.0)
    args.update(kw)
    return Workload(**args)


def tiny_spec(**kw):
    # Slow decode steps and near-free prefills keep the HTTP run's per-request latencies (a few
    # wall milliseconds each on a loaded 2-core machine) small next to the emulated step time.
    args = dict(num_engines=2, kv_capacity_tokens=12_000, train_fixed_s=0.5, train_s_per_token=0.0,
                decode_t0=0.03, prefill_t0=0.001)
    args.update(kw)
    return replace(ENGINE_PRESETS["h100-qwen3-4b"], **args)


# ---------------------------------------------------------------------------- time model
def test_kv_capacity_and_step_costs_follow_the_hardware():
    spec = ENGINE_PRESETS["h100-qwen3-4b"]
    assert spec.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2  # 144 KiB in bf16
    expected = int((2 * 80e9 * 0.7 - 8.05e9) // spec.kv_bytes_per_token)
    assert spec.kv_capacity() == expected
    tm = spec.time_model()
    bandwidth = 2 * 3.35e12 * 0.75
    assert tm.decode_per_kv_token == pytest.approx(spec.kv_bytes_per_token / bandwidth)
    assert tm.decode_t0 == pytest.approx(spec.step_overhead_s + spec.tp_overhead_s + 8.05e9 / bandwidth)
    # more memory for the KV pool, more capacity; pinned values win over derived ones
    assert replace(spec, mem_fraction_static=0.8).kv_capacity() > spec.kv_capacity()
    assert replace(spec, decode_t0=0.02).time_model().decode_t0 == 0.02
    assert replace(spec, kv_capacity_tokens=1234).kv_capacity() == 1234
    # the 8B model has the same KV layout but twice the weights: slower steps, less KV room
    big = ENGINE_PRESETS["h100-qwen3-8b"]
    assert big.time_model().decode_t0 > tm.decode_t0 and big.kv_capacity() < spec.kv_capacity()


def test_impossible_engine_specs_are_rejected():
    with pytest.raises(ValueError, match="no KV capacity"):
        replace(ENGINE_PRESETS["h100-qwen3-8b"], gpus_per_engine=1, mem_fraction_static=0.2)
    with pytest.raises(ValueError):
        replace(ENGINE_PRESETS["h100-qwen3-4b"], bandwidth_efficiency=0.0)
    with pytest.raises(ValueError):
        replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=0)


def test_length_stats_match_the_emulator_streams():
    w = tiny_workload(length="dapo-math-qwen3-4b-16k", max_response_len=16384, prompt_len=256,
                      n_samples_per_prompt=8)
    stats = length_stats(w, num_prompts=128)
    model = SyntheticLM(seed=w.seed, length=w.length_model())
    prompts = bench.SyntheticPrompts(w.prompt_len, 8, w.max_response_len)
    sampled = np.array([model.response_length(prompts.prompt_ids(i), i * 8 + j, w.max_response_len)
                        for i in range(128) for j in range(8)])
    # same samples, quantile-averaged instead of one draw each: agree up to sampling noise
    assert stats.mean == pytest.approx(sampled.mean(), rel=0.06)
    assert stats.truncated_fraction == pytest.approx((sampled >= w.max_response_len).mean(), abs=0.03)
    # a request holds L/2 on average over its life, but a running slot is length-biased: long
    # requests occupy slots for longer, so the slot average exceeds half the mean length
    assert stats.kv_per_slot > stats.mean / 2 + 0.25 * sampled.std() ** 2 / sampled.mean()


def test_ideal_throughput_is_the_kv_limited_bound():
    spec = ENGINE_PRESETS["h100-qwen3-4b"]
    w = Workload(name="x")
    stats = length_stats(w)
    ideal = ideal_throughput(spec, w, stats)
    tm = spec.time_model()
    slot = w.prompt_len + stats.kv_per_slot
    batch = spec.kv_capacity() / slot
    # below the CUDA-graph limit and the compute/weight-read crossover: the matmuls are hidden
    assert batch < tm.graph_max_batch and batch * tm.decode_flops_per_request < tm.decode_overlap_s
    step = tm.decode_t0 + tm.decode_per_request * batch + tm.decode_per_kv_token * batch * slot
    p = w.prompt_len
    prefill = tm.prefill_per_token * p + tm.prefill_per_token_pair * p * (p + 1) / 2
    per_token = step / batch + prefill / stats.mean
    assert ideal["tokens_per_s"] == pytest.approx(spec.num_engines / per_token)
    # longer budgets, longer requests, fewer of them fit: the bound drops with the context
    longer = ideal_throughput(spec, replace(w, max_response_len=40960), length_stats(w, 40960))
    assert longer["tokens_per_s"] < ideal["tokens_per_s"]
    assert longer["kv_limited_concurrency"] < ideal["kv_limited_concurrency"]


def test_plans_and_overrides():
    labels = [p.label for p in plan(bench.WORKLOADS["context-sweep"])]
    assert labels[:3] == ["sync@8k", "april@8k", "copris@8k"] and "copris@40k" in labels
    labels = [p.label for p in plan(bench.WORKLOADS["concurrency-sweep"])]
    assert labels[0] == "copris@N=128" and labels[-1] == "copris-adaptive"
    w, s = apply_overrides(Workload(name="x"), ENGINE_PRESETS["h100-qwen3-4b"],
                           ["concurrency=768", "mem_fraction_static=0.8", "policies=sync,copris"])
    assert (w.concurrency, s.mem_fraction_static, w.policies) == (768, 0.8, ("sync", "copris"))
    with pytest.raises(ValueError, match="unknown key"):
        apply_overrides(w, s, ["no_such_key=1"])
    with pytest.raises(ValueError):
        apply_overrides(w, s, ["policies=fastest"])


# ---------------------------------------------------------------------------- both modes
def test_virtual_and_http_modes_agree():
    """The same tiny copris step over real HTTP (emulator clock at half wall speed) and on the
    virtual clock: throughput and utilisation within 5%."""
    # What wall time adds to the HTTP run is the client's own work on the critical path, mostly
    # the burst of requests that opens the step (each a new connection, all sent before the
    # engines see the first one) and the abort round trip that closes it; a loaded machine
    # stretches it several times over. N' = one batch of samples (32 instead of the default 64)
    # halves that burst: with the process stopped nine tenths of the time in short slices, the
    # HTTP run stayed within 2-3% of the virtual one where N' = 64 lost 6-7%. The step still
    # ends by aborting the requests in flight (31 of them on the virtual clock).
    w, spec = tiny_workload(concurrency=32), tiny_spec()
    virtual = run_benchmark(w, spec, mode="virtual").summaries["copris"]
    http = run_benchmark(w, spec, mode="http", time_scale=0.5).summaries["copris"]
    assert virtual["throughput_tokens_per_s"] > 0 and virtual["generated_tokens"] > 0
    for key in ("throughput_tokens_per_s", "utilization"):
        assert http[key] == pytest.approx(virtual[key], rel=0.05), key


def test_multi_step_run_resumes_partials_across_weight_versions():
    w = tiny_workload(steps=3, warmup_steps=1, policies=("sync", "copris"))
    result = run_benchmark(w, tiny_spec(), mode="virtual")
    sync, copris = result.summaries["sync"], result.summaries["copris"]
    assert sync["offpolicy_token_fraction"] == 0.0 and sync["max_staleness"] == 0
    # copris carries aborted partials into the next step, where a new weight version finishes them
    assert copris["offpolicy_token_fraction"] > 0.0 and copris["max_staleness"] >= 1
    assert copris["throughput_tokens_per_s"] > sync["throughput_tokens_per_s"]
    for s in (sync, copris):
        assert 0.0 < s["utilization"] <= 1.5 and 0.0 <= s["bubble_fraction"] <= 1.0
        assert s["steps_per_hour"] > 0 and s["steps_measured"] == 2


# ---------------------------------------------------------------------------- CLI and JSON
def test_cli_quick_path_writes_the_json_schema_and_the_figure(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli_main(["bench", "dapo16k", "--quick", "--steps", "2",
                   "--set", "length=short:median_tokens=100", "--set", "max_response_len=400",
                   "--set", "rollout_batch_size=4", "--set", "n_samples_per_prompt=4",
                   "--set", "prompt_len=16", "--set", "num_engines=2",
                   "--json", str(out), "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "copris-adaptive" in printed and "tok/s" in printed
    data = json.loads(out.read_text())
    assert set(data) == {"workload", "results"}
    assert data["workload"]["name"] == "dapo16k" and data["workload"]["mode"] == "virtual"
    # --quick runs each partial-rollout policy unbounded and at max_staleness 2
    partial = ("april", "copris", "copris-adaptive")
    assert set(data["results"]) == {"sync", *partial, *(f"{p}@s2" for p in partial)}
    assert all(data["results"][f"{p}@s2"]["bound"] == 2 and data["results"][f"{p}@s2"]["token_staleness_max"] <= 2
               for p in partial)
    for policy, entry in data["results"].items():
        for key, kind in REQUIRED.items():
            assert isinstance(entry[key], kind), (policy, key, entry[key])
            assert math.isfinite(entry[key])
    assert png.stat().st_size > 10_000


def test_cli_settings_and_errors(capsys):
    assert cli_main(["settings"]) == 0
    assert "| `april_policy` |" in capsys.readouterr().out
    assert cli_main(["no-such-command"]) == 2
    assert cli_main(["bench", "--set", "nonsense=1"]) == 2
    assert cli_main(["bench", "--show-engine", "--engine-preset", "h100-qwen3-8b"]) == 0
    assert '"kv_capacity_tokens"' in capsys.readouterr().out
