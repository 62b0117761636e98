"""The bench's multi-turn workload: episodes run by the core (``EpisodeRunner`` through
``RolloutScheduler(episodes=...)``) with the in-process agent, on the virtual clock.

Structural facts only, none of which a broken path meets by accident: every trained episode made
exactly its planned turns with exactly its planned tokens, tool results masked between them;
every step trains exactly ``rollout_batch_size`` whole groups, none twice; copris never has more
than N' calls in flight (and reaches N', so the bound is not vacuous); tool latencies advance the
virtual clock; the single-turn twin trains the same tokens per sample. No timing is asserted.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from april_workbench.bench import ENGINE_PRESETS, Workload
from april_workbench.bench.band import Variant
from april_workbench.bench.multiturn import EpisodeDriver, plan_episode
from april_workbench.bench.multiturn_report import flat_twin, run_pair_band
from april_workbench.bench.runner import run_policy
from april_workbench.cli import main as cli_main
from april_workbench.emulator import SyntheticLM, run_virtual

TOOL_TOKENS = 8


def tiny(**kw) -> Workload:
    args = dict(name="tiny-multi-turn", length="short:median_tokens=60,truncation_fraction=0.05",
                max_response_len=200, prompt_len=16, rollout_batch_size=4, n_samples_per_prompt=4, steps=4,
                warmup_steps=1, policies=("sync", "april", "copris"), timeline_interval_s=0.25,
                load_poll_interval_s=1.0, turns_min=2, turns_max=4, tool_median_s=1.5, tool_sigma=0.8,
                tool_tokens=TOOL_TOKENS)
    args.update(kw)
    return Workload(**args)


SPEC = replace(ENGINE_PRESETS["h100-qwen3-4b"], num_engines=2, kv_capacity_tokens=12_000, train_fixed_s=0.5,
               train_s_per_token=0.0, decode_t0=0.03, prefill_t0=0.001)


class RecordingDriver(EpisodeDriver):
    """Keeps every step's trained groups for the checks."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.trained: list[list] = []

    def step_done(self, before, returned, buffered, next_version):
        self.trained.append(list(returned))
        return super().step_done(before, returned, buffered, next_version)


def run(policy: str, workload: Workload, **kw):
    async def go():
        model = SyntheticLM(seed=workload.seed, length=workload.length_model())
        driver = RecordingDriver(workload, model, workload.max_response_len)
        result = await run_policy(policy, policy, workload, SPEC, driver=driver, **kw)
        return result, driver
    return run_virtual(go())


def segments(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each maximal run of equal values."""
    out: list[tuple[int, int]] = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_every_trained_episode_made_its_planned_turns_and_steps_train_whole_groups(policy):
    w = tiny()
    concurrency = 10  # copris: fewer calls in flight than the step's 16 episodes, so N' binds
    result, driver = run(policy, w, concurrency=concurrency if policy == "copris" else None)
    plans, log = driver.prompts.plans, driver.agent.log
    seen: set[str] = set()
    for step, groups in zip(result.steps, driver.trained):
        assert len(groups) == w.rollout_batch_size
        assert step.metrics["april/returned_groups"] == w.rollout_batch_size
        for group in groups:
            assert group.uid not in seen, f"group {group.uid} trained twice"
            seen.add(group.uid)
            assert len(group.trajectories) == w.n_samples_per_prompt
            for t in group.trajectories:
                plan, record = plans[t.uid], log[t.uid]
                assert w.turns_min <= plan.turns <= w.turns_max
                assert record.turns == plan.turns and record.call_tokens == plan.lengths
                # the member: turn, tool result, turn, ... with the tool's tokens masked out
                assert segments(t.loss_mask) == [x for n in plan.lengths for x in ((0, TOOL_TOKENS), (1, n))][1:]
                assert len(t.response_ids) == len(t.logprobs) == sum(c for _, c in t.version_runs)
                assert all(v <= step.version for v, _ in t.version_runs)
                # every tool of the episode slept on the loop's clock between its calls
                assert record.ended - record.started >= sum(plan.tool_s) - 1e-9
        if policy == "sync":
            # sync trains only episodes begun in the step, so the step lasts at least as long as
            # the tools of its slowest episode: tool time is virtual time
            assert step.rollout_s >= max(log[t.uid].tool_s for g in groups for t in g.trajectories)
    assert sum(log[uid].tool_s for uid in log) <= driver.episodes.counters.tool_seconds + 1e-6
    inflight = [s.metrics["april/inflight_max"] for s in result.steps]
    if policy == "copris":
        assert max(inflight) == concurrency, "copris never reached N': the bound was not tested"
        running = [r + q for r, q in zip(result.timeline["running"], result.timeline["waiting"])]
        assert max(running) <= concurrency  # the engines' own count agrees
    if policy != "sync":
        assert sum(s.metrics["april/episodes/suspended"] for s in result.steps) > 0, "no call crossed a step"


def test_the_single_turn_twin_trains_each_episodes_tokens_in_one_response():
    w = tiny(steps=2)
    _, multi = run("sync", w)
    _, flat = run("sync", flat_twin(w))
    assert flat.episodes is None  # plain trajectories, no runner
    members = {t.uid: t for g in flat.trained[0] + flat.trained[1] for t in g.trajectories}
    assert members.keys() == {t.uid for g in multi.trained[0] + multi.trained[1] for t in g.trajectories}
    for uid, t in members.items():
        assert t.num_calls == 1 and t.response_length == multi.prompts.plans[uid].model_tokens


def test_plans_are_fixed_by_seed_prompt_and_sample():
    w = tiny(turns_min=1, turns_max=6)
    model = SyntheticLM(seed=w.seed, length=w.length_model())
    prompt = list(range(1, 17))
    plans = [plan_episode(w, model, prompt, i, j, w.max_response_len) for i in range(20) for j in range(4)]
    assert plans == [plan_episode(w, model, prompt, i, j, w.max_response_len) for i in range(20) for j in range(4)]
    assert {p.turns for p in plans} == set(range(1, 7))
    assert all(len(p.tool_s) == p.turns - 1 and min(p.lengths) >= 1 and max(p.lengths) <= 200 for p in plans)
    with pytest.raises(ValueError, match="turns_min"):
        tiny(turns_min=5, turns_max=3)
    with pytest.raises(ValueError, match="turns_max"):
        replace(tiny(), turns_max=0)
    with pytest.raises(ValueError, match="tool_median_s"):
        tiny(tool_median_s=0.0)


def test_band_pairs_both_workloads_and_reuses_the_twin_for_tool_variants():
    w = tiny(steps=2, policies=("sync", "copris"))
    variants = [Variant("seed 0 (nominal)", 0), Variant("long tools", 0, workload={"tool_median_s": 3.0})]
    band = run_pair_band(w, SPEC, variants)
    flat_runs = band["single_turn"]["runs"]
    assert flat_runs["long tools"] == flat_runs["seed 0 (nominal)"]  # no tool in the twin: not run twice
    assert band["multi_turn"]["runs"]["long tools"] != band["multi_turn"]["runs"]["seed 0 (nominal)"]
    gain = band["comparison"]["copris"]
    m, s = band["multi_turn"]["policies"]["copris"], band["single_turn"]["policies"]["copris"]
    assert gain["gain"]["nominal"] == pytest.approx(m["ratio_to_sync"] / s["ratio_to_sync"])


def test_cli_runs_the_pair_and_writes_both(tmp_path, capsys):
    out = tmp_path / "mt.json"
    code = cli_main(["bench", "multi-turn", "--quick", "--json", str(out), "--set", "rollout_batch_size=2",
                     "--set", "n_samples_per_prompt=4", "--set", "prompt_len=16", "--set", "max_response_len=200",
                     "--set", "length=short:median_tokens=60", "--set", "steps=2", "--set", "num_engines=2",
                     "--set", "tool_tokens=8"])
    assert code == 0
    text = capsys.readouterr().out
    assert "single turn, equal tokens" in text and "multi-turn gain over single turn" in text
    data = json.loads(out.read_text())
    assert set(data) >= {"multi_turn", "single_turn", "comparison", "episodes"}
    assert data["multi_turn"]["results"]["copris"]["episode_calls_per_step"] > 0
    assert data["single_turn"]["workload"]["flat_episodes"] is True
