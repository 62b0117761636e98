"""``april-slime bench real --quick`` end to end on the real tier's SGLang CPU engines (``--url``:
the tier's shared router): every arm steps on the real engines, the emulated twin runs beside it
from a spec, and the JSON holds what the docs quote: per-step breakdowns whose parts add up, the
engines' own latency under the client's (SGLang's ``e2e_latency``), the client's CPU. Nothing here is
bounded by a clock; the speed figures come from the full command (docs/bench.md)."""

import json
import math

from april_workbench.bench.real.cli import main as real_main
from tests.support.bench_predict import predict


def test_bench_real_quick_runs_every_arm_on_the_real_engines(real_stack, tmp_path, capsys):
    before = real_stack.weight_version()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"base_preset": "h100-qwen3-4b", "decode_t0": 0.003, "decode_per_request": 1.5e-4,
                                "decode_per_kv_token": 2e-7, "prefill_t0": 0.007, "prefill_per_token": 3e-6,
                                "kv_capacity_tokens": 32768, "max_running_requests": 64}))
    out = tmp_path / "real.json"
    rc = real_main(["--url", real_stack.router_url, "--quick", "--engine-spec", str(spec), "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    real_stack.wait_idle()
    assert real_stack.weight_version() >= before  # the bench's versions never go back
    data = json.loads(out.read_text())
    (entry,) = data["workloads"].values()
    arms = data["arms"]
    assert arms[0] == "sync" and {"april", "copris", "april@s2", "copris@s2"} <= set(arms)
    assert set(entry["real"]) == set(entry["emulated"]) == set(arms)
    steps = entry["steps"]["real"]
    engines = {u.rstrip("/") for u in real_stack.engine_urls}
    for arm in arms:
        assert len(steps[arm]) == 3
        assert steps[arm][0]["breakdown"]["calls"] > 0, f"{arm}: the first step made no call"
        for record in steps[arm]:
            b = record["breakdown"]
            assert math.isclose(b["target_s"] + b["drain_s"], b["step_s"], rel_tol=1e-9)
            assert b["step_s"] > 0 and record["returned_tokens"] > 0
            assert 0 <= b["engine_idle_s"] <= len(engines) * b["target_s"] + 1e-9
            if b["calls"] == 0:
                # a step the buffer filled alone: the groups the last drain completed were enough
                # (copris keeps N' in flight, so its surplus can be a whole batch); only a policy
                # that buffers may do that
                assert arm != "sync" and b["in_flight"] == 0, (arm, b)
                continue
            assert b["in_flight"] > 0
            assert b["transit_ms"] is not None  # SGLang reports e2e_latency on every reply
            assert b["client_cpu_s"] > 0
    assert entry["real"]["sync"]["speedup"]["ratio"] == 1.0
    assert "SMOKE TEST" in capsys.readouterr().out


def test_a_slime_rollout_dump_of_the_real_engines_drives_a_prediction(real_stack, tmp_path, capsys):
    """Item: a job's speed-up from its lengths. A rollout step of a slime job on the real engines
    (the plugin at sync, the tiny model's own stop tokens), saved by slime's own
    ``save_debug_rollout_data``, is read back as the job's groups and predicted from."""
    from april_workbench.bench.real.slime_dump import slime_rollout_dump
    from april_workbench.bench.real.workload import read_lengths

    (dump,) = slime_rollout_dump(real_stack.router_url, real_stack.model_path, tmp_path / "job", batch=3, n=2,
                                 max_len=48, engines=len(real_stack.engine_urls), rollouts=1)
    real_stack.wait_idle()
    groups = read_lengths(dump)
    assert sorted(len(g) for g in groups) == [2, 2, 2]
    assert all(1 <= x <= 48 for g in groups for x in g)
    entry = predict(dump, tmp_path, engines=2, rounds=5)
    assert (entry["workload"]["rollout_batch_size"], entry["workload"]["n_samples_per_prompt"]) == (3, 2)
    assert set(entry["emulated"]) == {"sync", "april", "copris"}
    capsys.readouterr()
