"""``april-slime bench real``'s logic, on the emulated twin (virtual clock) and hand-built traces:
arms, the workload's fixed lengths, the rotating rounds, the per-step breakdown, the speed-up and
its band. The command on real SGLang engines: tests/real/test_bench_real_engines.py."""

import asyncio
import json
import math

import numpy as np
import pytest

from april_slime.core.config import AprilConfigError
from april_slime.core.step_metrics import TimelinePoint
from april_workbench.bench.real import cli as real_cli
from april_workbench.bench.real.rounds import Arm, parse_arm, run_rounds
from april_workbench.bench.real.stacks import EmulatedStack
from april_workbench.bench.real.stats import block_band, speedup, summarize
from april_workbench.bench.real.trace import CallRecord, breakdown
from april_workbench.bench.real.workload import (
    FixedLengthPrompts,
    LengthSource,
    RealWorkload,
    read_lengths,
)
from april_workbench.bench.spec import ENGINE_PRESETS
from april_workbench.emulator import run_virtual
from tests.support.bench_predict import predict

TINY = RealWorkload("tiny", rollout_batch_size=2, n_samples_per_prompt=2, eos_rate=1 / 16, max_response_len=64)


def _spec(engines: int = 2):
    from dataclasses import replace

    return replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=engines)


# ====================================================================== arms
def test_arms_parse_label_and_refuse_what_a_job_would():
    arm = parse_arm("copris@s2[refill_batch=1,april_concurrency=8]")
    assert arm == Arm("copris", 2, (("refill_batch", 1), ("concurrency", 8)))
    assert arm.label == "copris@s2[refill_batch=1,concurrency=8]"
    assert parse_arm(arm.label) == arm
    assert parse_arm("april").config_values() == {"policy": "april", "max_staleness": None}
    with pytest.raises(ValueError, match="on-policy"):
        parse_arm("sync@s2")
    with pytest.raises(ValueError, match="policy must be one of"):
        parse_arm("fastest")
    with pytest.raises(AprilConfigError, match="april_polcy"):
        parse_arm("copris[polcy=sync]")
    with pytest.raises(AprilConfigError, match="april_refill_batch"):
        parse_arm("copris[refill_batch=0]")
    with pytest.raises(ValueError, match="@s<k>"):
        parse_arm("copris@2")
    assert real_cli._split_arms("sync,copris[refill_batch=1;concurrency=4],april@s2") == [
        "sync", "copris[refill_batch=1;concurrency=4]", "april@s2"]


# ====================================================================== lengths
def test_law_lengths_are_fixed_by_the_workload_and_within_the_budget():
    a, b = LengthSource(TINY), LengthSource(TINY)
    draws = [a.sample(i, j) for i in range(200) for j in range(2)]
    assert draws == [b.sample(i, j) for i in range(200) for j in range(2)]
    assert all(1 <= x <= 64 for x in draws) and 64 in draws  # geometric, mean 16, capped
    assert 10 < np.mean(draws) < 20
    other = LengthSource(RealWorkload("t", eos_rate=1 / 16, max_response_len=64, seed=1))
    assert draws != [other.sample(i, j) for i in range(200) for j in range(2)]
    # a prompt's spread makes long samples come in groups: the group max varies more
    spread = LengthSource(RealWorkload("s", n_samples_per_prompt=8, eos_rate=1 / 16, max_response_len=10_000,
                                       prompt_spread=1.0))
    flat = LengthSource(RealWorkload("f", n_samples_per_prompt=8, eos_rate=1 / 16, max_response_len=10_000))
    group_means = lambda src: [np.mean([src.sample(i, j) for j in range(8)]) for i in range(300)]  # noqa: E731
    assert np.std(group_means(spread)) > 2 * np.std(group_means(flat))
    prompts = FixedLengthPrompts(TINY)
    group = prompts.next_groups(1, 0)[0]
    assert [t.max_new_tokens for t in group.trajectories] == [a.sample(0, 0), a.sample(0, 1)]
    assert all(3 <= x < 2000 for x in group.prompt_ids)


def test_episode_plans_have_turns_tools_and_a_budget_that_fits():
    w = RealWorkload("mt", rollout_batch_size=2, n_samples_per_prompt=2, eos_rate=1 / 8, max_response_len=32,
                     turns_min=2, turns_max=3, tool_tokens=5)
    prompts = FixedLengthPrompts(w)
    group = prompts.next_groups(1, 0)[0]
    for t in group.trajectories:
        plan = prompts.plans[t.uid]
        assert 2 <= plan.turns <= 3 and len(plan.tool_attempts) == plan.turns - 1
        assert all(1 <= x <= 32 for x in plan.lengths)
        assert t.max_new_tokens == plan.model_tokens + 5 * (plan.turns - 1)


def test_lengths_files_read_jsonl_and_slime_dumps(tmp_path):
    jsonl = tmp_path / "lengths.jsonl"
    jsonl.write_text('12\n{"response_length": 5, "group_index": 7}\n{"response_length": 9, "group_index": 7}\n'
                     '{"lengths": [1, 2, 3]}\n\n')
    assert sorted(map(sorted, read_lengths(jsonl))) == [[1, 2, 3], [5, 9], [12]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('3\n{"response_length": -1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a response length must be an integer >= 1"):
        read_lengths(bad)
    bad.write_text("3\nnot json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        read_lengths(bad)
    with pytest.raises(ValueError, match="does not exist"):
        read_lengths(tmp_path / "missing.jsonl")
    torch = pytest.importorskip("torch")
    dump = tmp_path / "3.pt"  # what slime's --save-debug-rollout-data writes: {"rollout_id", "samples"}
    torch.save({"rollout_id": 3, "samples": [{"response_length": n, "group_index": n // 10}
                                             for n in (11, 12, 21, 22, 23)]}, dump)
    assert sorted(map(sorted, read_lengths(dump))) == [[11, 12], [21, 22, 23]]
    torch.save({"rollout_id": 3}, dump)
    with pytest.raises(ValueError, match="not a slime rollout dump"):
        read_lengths(dump)
    # a job's lengths drive a workload: its groups, cycled, at the file's budget
    w = real_cli.with_lengths(RealWorkload("job", n_samples_per_prompt=2), str(jsonl))
    assert w.max_response_len == 12 and w.lengths_file == str(jsonl)
    src = LengthSource(w)
    assert {tuple(src.sample(i, j) for j in range(2)) for i in range(3)} == {(1, 2), (5, 9), (12, 12)}


# ====================================================================== the breakdown
def test_breakdown_of_a_hand_built_step():
    a, b = "http://e0", "http://e1"
    calls = [CallRecord(a, 10.0, 11.0, 4, 5, 0.9, "stop"), CallRecord(a, 10.0, 12.0, 4, 9, 1.8, "stop"),
             CallRecord(b, 10.5, 11.5, 4, 5, 0.7, "stop")]
    timeline = [TimelinePoint(0.0, 2, 3, True), TimelinePoint(2.0, 0, 3, False)]
    parts = breakdown(calls, 10.0, 2.5, 2.0, timeline, [a, b])
    assert parts["target_s"] + parts["drain_s"] == parts["step_s"] == 2.5
    # e0 busy all of [0, 2]; e1 idle for [0, 0.5] and [1.5, 2]
    assert parts["engine_idle_s"] == pytest.approx(1.0)
    # in flight: 2 on [0, .5], 3 on [.5, 1], 2 on [1, 1.5], 1 on [1.5, 2]: mean 2
    assert parts["in_flight"] == pytest.approx(2.0)
    # free slots of a limit of 3 while work waited: 1, 0, 1, 2 on those quarters: mean 1
    assert parts["free_slots"] == pytest.approx(1.0)
    assert parts["transit_ms"] == pytest.approx(1e3 * np.mean([0.1, 0.2, 0.3]))
    assert parts["calls"] == 3


# ====================================================================== the band
def test_speedup_is_the_ratio_of_totals_with_a_band_that_holds_it():
    assert speedup([2, 2, 2, 2], [1, 1, 1, 1]) == {"ratio": 2.0, "low": 2.0, "high": 2.0}
    rng = np.random.default_rng(1)
    base = rng.uniform(2, 4, 30)
    arm = base / 1.5 * rng.uniform(0.6, 1.4, 30)
    s = speedup(base, arm, block=4)
    assert s["low"] < s["ratio"] < s["high"]
    assert s["ratio"] == pytest.approx(base.sum() / arm.sum())
    assert block_band([1, 1, 2, 2], [1, 1, 1, 1], 2) == (1.0, 2.0)
    assert math.isnan(speedup([1.0], [1.0])["low"])


# ====================================================================== rounds on the emulated twin
def test_rounds_rotate_the_arms_and_every_arm_trains_the_workloads_samples():
    arms = [Arm("sync"), Arm("april"), Arm("copris"), Arm("copris", 1)]
    order: list[tuple[int, str]] = []
    lengths = LengthSource(TINY)

    def on_step(record, runner):
        order.append((record.round, record.arm))
        for group in runner.last_groups:
            index = int(group.uid[1:])
            for t in group.trajectories:
                # every trained sample is exactly its drawn length, however often it was resumed
                assert t.response_length == lengths.sample(index, t.index_in_group), t.uid
        b = record.breakdown
        assert b["target_s"] + b["drain_s"] == pytest.approx(b["step_s"])
        assert record.version == record.round  # each arm counts its own policy versions

    async def go():
        stack = EmulatedStack(_spec())
        await stack.start()
        try:
            return await run_rounds(stack, TINY, arms, 4, measure_cpu=False, on_step=on_step)
        finally:
            await stack.close()

    runs = run_virtual(go())
    labels = [a.label for a in arms]
    for r in range(4):
        assert [arm for rnd, arm in order if rnd == r] == labels[r % 4:] + labels[:r % 4]
    assert all(len(v) == 4 for v in runs.values())
    assert sum(x.returned_tokens for x in runs["sync"]) == sum(
        lengths.sample(i, j) for i in range(8) for j in range(2))  # sync trains prompts 0..7 in order
    summary = summarize(runs, "sync", warmup=1, block=2)
    assert summary["sync"]["speedup"]["ratio"] == 1.0
    assert all(s["steps_counted"] == 3 for s in summary.values())


def test_a_multi_turn_comparison_runs_episodes_with_tools_on_the_twin():
    w = RealWorkload("mt", rollout_batch_size=2, n_samples_per_prompt=2, eos_rate=1 / 8, max_response_len=32,
                     turns_min=2, turns_max=3, tool_tokens=4, tool_workers=2, tool_median_s=0.5)

    async def go():
        stack = EmulatedStack(_spec())
        await stack.start()
        try:
            return await run_rounds(stack, w, [Arm("sync"), Arm("copris")], 3, measure_cpu=False)
        finally:
            await stack.close()

    runs = run_virtual(go())
    for records in runs.values():
        assert all(r.returned_tokens > 0 for r in records)
        assert sum(r.breakdown["calls"] for r in records) > 2 * 3 * 2  # several calls per episode


def test_emulated_only_prediction_for_a_job_writes_its_json(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"base_preset": "h100-qwen3-4b", "num_engines": 2}))
    lengths = tmp_path / "job.jsonl"
    lengths.write_text("\n".join(json.dumps({"lengths": [5 + 7 * i % 40, 9, 30 + i]}) for i in range(20)))
    out = tmp_path / "out.json"
    rc = real_cli.main(["--emulated-only", "--engine-spec", str(spec), "--quick", "--lengths", str(lengths),
                        "--arms", "sync,copris[refill_batch=1],april", "--rounds", "4", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (entry,) = data["workloads"].values()
    assert entry["workload"]["lengths_file"] == str(lengths) and entry["real"] is None
    assert set(entry["emulated"]) == {"sync", "copris[refill_batch=1]", "april"}
    assert entry["emulated"]["sync"]["speedup"]["ratio"] == 1.0
    assert "SMOKE TEST" in capsys.readouterr().out
    assert real_cli.main(["--emulated-only", "--quick"]) == 2  # a prediction needs a spec
    assert real_cli.main(["--workloads", "nope"]) == 2


def test_predict_takes_the_jobs_shape_from_its_dump(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    dump = tmp_path / "7.pt"
    torch.save({"rollout_id": 7, "samples": [{"response_length": 3 + (g * 5 + j * 11) % 60, "group_index": g}
                                             for g in range(6) for j in range(4)]}, dump)
    entry = predict(dump, tmp_path, engines=1, rounds=6)
    w = entry["workload"]
    assert (w["rollout_batch_size"], w["n_samples_per_prompt"], w["lengths_file"]) == (6, 4, str(dump))
    assert set(entry["emulated"]) == {"sync", "april", "copris"}
    assert "x sync" in capsys.readouterr().out


def test_the_emulated_transport_adds_the_measured_transit_to_generates_and_aborts():
    from april_workbench.emulator import EmulatorCluster

    async def go(transit):
        cluster = EmulatorCluster(1)
        await cluster.start()
        transport = cluster.transport(transit_s=transit)
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            await transport.request("POST", cluster.engine_urls[0], "/generate",
                                    {"input_ids": [5, 6, 7, 8], "rid": "r",
                                     "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}, 60)
            generate = loop.time() - t0
            t0 = loop.time()
            await transport.request("GET", cluster.engine_urls[0], "/v1/loads", None, 60)
            return generate, loop.time() - t0
        finally:
            await cluster.close()

    plain, loads = run_virtual(go(0.0))
    slow, loads_slow = run_virtual(go(0.25))
    assert slow == pytest.approx(plain + 0.25) and loads == loads_slow == 0.0


def test_the_documents_count_what_the_json_holds():
    from april_workbench.bench.real import report

    def arm(ratio, low, high):
        return {"speedup": {"ratio": ratio, "low": low, "high": high}, "step_s": 1.0}

    data = {"baseline": "sync", "workloads": {
        "a": {"workload": {"role": "tuned"},
              "real": {"sync": arm(1, 1, 1), "april": arm(1.4, 1.3, 1.5), "copris": arm(1.5, 1.4, 1.6)},
              "emulated": {"sync": arm(1, 1, 1), "april": arm(1.52, 0, 0), "copris": arm(1.70, 0, 0)}},
        "b": {"workload": {"role": "held-out"},
              "real": {"sync": arm(1, 1, 1), "april": arm(1.3, 1.2, 1.4), "copris": arm(1.2, 1.0, 1.25)},
              "emulated": {"sync": arm(1, 1, 1), "april": arm(1.35, 0, 0), "copris": arm(1.5, 0, 0)}}}}
    # inside the band, or within 10%: 1.52 is outside 1.3-1.5 but within 10% of 1.4; 1.70 is neither
    assert report.predicted(data["workloads"]["a"]["real"]["april"], data["workloads"]["a"]["emulated"]["april"])
    assert not report.predicted(data["workloads"]["a"]["real"]["copris"], data["workloads"]["a"]["emulated"]["copris"])
    text = report.checks(data)
    assert "copris >= april >= sync: 1 of 2" in text
    assert "2 of 4 arms" in text and "0 of the 1 held-out workloads (none)" in text
    assert "b: copris >= april >= sync does not hold at bound none (copris 1.20x, april 1.30x)" in text
    assert "a (tuned): the emulated copris 1.70x is +13% from the measured 1.50x" in text
    second = json.loads(json.dumps(data))
    second["workloads"]["a"]["real"]["april"] = arm(1.7, 1.55, 1.8)
    repeat = report.repeat(data, second)
    assert "Bands overlapping: 3 of 4 arms." in repeat and "**no**" in repeat
    assert "| a | 1.40x (1.30-1.50) / 1.52x |" in report.readme(data)
