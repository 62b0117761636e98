"""slime contract of ``april_slime.rollout``: settings from slime's args, the samples handed to
slime's trainer, the data source's checkpoints, slime's reward / filter / evaluation paths.

Runs against the real slime when it is importable, else against ``slime_standin`` (the same
tests, the same assertions). SGLang is the emulator, over real HTTP on loopback.
"""

from __future__ import annotations

import importlib
import json

import pytest
import yaml

from april_slime import rollout
from april_slime.core.config import AprilConfigError
from april_slime.core.jsonfile import StateFileError
from april_slime.core.keys import POLICY_VERSION_KEY, TOKEN_VERSIONS_KEY
from april_slime.job import describe
from april_slime.slime_args import SlimeArgs
from tests.support import slime_standin
from tests.support.slime_jobs import (
    make_args,
    point_at,
    restart_from_n_loses_and_repeats_nothing,
    rollout_until_partial,
)
from tests.support.state_files import read_plain_state


# ------------------------------------------------------------------ functions slime loads by path
async def group_parity_reward(args, samples, **kwargs):
    # a group reward: 1 for samples longer than their group's mean
    mean = sum(s.response_length for s in samples) / len(samples)
    return [float(s.response_length > mean) for s in samples]


CALLS: list = []


def keep_mixed_rewards(args, samples, **kwargs):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    rewards = [s.get_reward_value(args) for s in samples]
    CALLS.append(rewards)
    keep = len(set(rewards)) > 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


# ------------------------------------------------------------------ fixtures
# slime_mode and cluster: tests/conftest.py (from tests.support.slime_jobs)
@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Q{i:03d}", "label": str(2 * i)}) + "\n")
    return path


def check_train_output(output, args, version):
    """What slime's trainer needs from every sample (RolloutManager._convert_samples_to_train_data)."""
    Sample = importlib.import_module("slime.utils.types").Sample
    groups = output.samples
    assert len(groups) == args.rollout_batch_size
    seen_index, group_indices = set(), []
    for group in groups:
        assert len(group) == args.n_samples_per_prompt
        assert len({s.group_index for s in group}) == 1
        group_indices.append(group[0].group_index)
        prompt_len = len(group[0].tokens) - group[0].response_length
        for s in group:
            assert isinstance(s, Sample)
            assert s.index not in seen_index
            seen_index.add(s.index)
            assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
            assert 0 < s.response_length <= args.rollout_max_response_len
            assert len(s.tokens) == prompt_len + s.response_length
            assert s.tokens[:prompt_len] == group[0].tokens[:prompt_len]  # same prompt ids in a group
            assert len(s.rollout_log_probs) == s.response_length
            assert all(lp <= 0.0 for lp in s.rollout_log_probs)
            assert s.loss_mask == [1] * s.response_length
            assert s.reward is not None
            assert s.response == " ".join(str(t) for t in s.tokens[prompt_len:])
            runs = s.train_metadata[TOKEN_VERSIONS_KEY]
            assert sum(c for _, c in runs) == s.response_length
            assert all(v <= version for v, _ in runs)
            assert s.train_metadata[POLICY_VERSION_KEY] == version
            call_versions = [int(v) for v in s.weight_versions]  # one per generate call
            assert len(call_versions) == s.metadata["april_num_calls"]
            assert call_versions == sorted(call_versions)
            assert set(call_versions) >= {v for v, _ in runs}
            assert s.metadata[TOKEN_VERSIONS_KEY] == runs
            if s.status is Sample.Status.TRUNCATED:
                assert s.response_length == args.rollout_max_response_len
    assert len(set(group_indices)) == len(group_indices)
    indices = [g[0].index for g in groups]
    assert indices == sorted(indices)  # slime sorts groups by sample index
    assert output.metrics["april/policy_version"] == version


# ------------------------------------------------------------------ settings
def test_settings_come_from_custom_config_yaml(slime_mode, tmp_path, prompts):
    path = tmp_path / "april.yaml"
    path.write_text(yaml.safe_dump({"april_policy": "copris", "april_concurrency": 24,
                                    "april_max_staleness": 2, "april_resume_priority": "fifo"}))
    args = make_args(tmp_path, prompts, april_policy=None, april_over_sampling_factor=None)
    for key, value in yaml.safe_load(path.read_text()).items():  # what slime does with the file
        setattr(args, key, value)
    source = rollout.AprilDataSource(args)
    assert (source.config.policy, source.config.concurrency) == ("copris", 24)
    assert source.buffer.max_staleness == 2 and source.buffer.priority == "fifo"


@pytest.mark.parametrize("overrides, key", [
    ({"april_policy": "fastest"}, "april_policy:"),
    ({"april_concurrency": 0}, "april_concurrency:"),
    ({"rollout_top_p": 0.0}, "rollout_top_p:"),
    ({"use_rollout_routing_replay": True}, "use_rollout_routing_replay:"),  # no num_layers / moe_router_topk
    ({"rollout_max_response_len": None}, "rollout_max_response_len:"),
    ({"custom_generate_function_path": "x.y"}, "custom_generate_function_path:"),
])
def test_a_bad_value_stops_the_job_with_one_line(slime_mode, tmp_path, prompts, overrides, key):
    with pytest.raises(AprilConfigError) as err:
        rollout.AprilDataSource(make_args(tmp_path, prompts, **overrides))
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message


@pytest.mark.parametrize("yaml_text, message", [
    ("policy: april\n", "policy: plugin settings take the april_ prefix; closest valid name: april_policy"),
    ("april_polcy: april\n", "april_polcy: unknown setting; closest valid name: april_policy"),
    ("april_policy:\n", "april_policy: must not be empty"),
])
def test_a_misspelled_custom_config_key_stops_the_job(slime_mode, tmp_path, prompts, yaml_text, message):
    path = tmp_path / "april.yaml"
    path.write_text(yaml_text)
    args = make_args(tmp_path, prompts, custom_config_path=str(path))
    del args.april_policy
    for key, value in yaml.safe_load(yaml_text).items():  # what slime does with the file
        setattr(args, key, value)
    with pytest.raises(AprilConfigError) as err:
        rollout.AprilDataSource(args)
    assert str(err.value) == message


def test_rollout_function_needs_the_april_data_source(slime_mode, tmp_path, prompts):
    with pytest.raises(AprilConfigError, match="data_source_path"):
        rollout.generate_rollout(make_args(tmp_path, prompts), 0, object())


# ------------------------------------------------------------------ training samples
@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_samples_have_the_shape_slime_trains_on(cluster, tmp_path, prompts, policy):
    args = point_at(make_args(tmp_path, prompts, april_policy=policy), cluster)
    source = rollout.AprilDataSource(args)
    output = rollout.generate_rollout(args, 0, source)
    assert type(output).__name__ == "RolloutFnTrainOutput"
    check_train_output(output, args, version=1)
    assert any(k.startswith("april/") for k in output.metrics)


def test_a_step_whose_engines_all_fail_to_report_their_version_raises_an_engine_error(cluster, tmp_path, prompts,
                                                                                      monkeypatch):
    """No engine answers the weight-version query: the step stops with the engines' own error (a
    retryable EngineError, not an internal one), and the next step, with the engines back, trains
    every prompt once."""
    from april_slime.core.engine import EngineClient
    from april_slime.core.sglang_protocol import EngineError

    args = point_at(make_args(tmp_path, prompts, april_policy="copris"), cluster)
    source = rollout.AprilDataSource(args)
    first = rollout.generate_rollout(args, 0, source)

    async def down(self, url):
        raise EngineError(f"engine {url} is down")

    with monkeypatch.context() as m:
        m.setattr(EngineClient, "engine_weight_version", down)
        with pytest.raises(EngineError, match="is down"):
            rollout.generate_rollout(args, 1, source)
    second = rollout.generate_rollout(args, 1, source)
    trained = [g[0].group_index for out in (first, second) for g in out.samples]
    assert len(trained) == len(set(trained)) == 2 * args.rollout_batch_size


def test_the_first_step_waits_until_the_router_lists_every_engine_slime_started(cluster, tmp_path, prompts,
                                                                            monkeypatch):
    """slime registers each engine with POST /workers and carries on at the router's 202;
    sglang-router lists an engine only after its own health check. Here the router lists no engine
    at the first read and one of the two at the next three (a list that holds still): the first
    step must wait for both (the count slime's --rollout-num-gpus / --rollout-num-gpus-per-engine
    imply), not fail or start on one."""
    from april_workbench.emulator.server import RouterHandler

    handle = RouterHandler.handle
    reads: list[int] = []

    async def registering(self, method, path, payload):
        status, body = await handle(self, method, path, payload)
        if path.rstrip("/") == "/workers":
            reads.append(len(reads))
            listed = {0: 0, 1: 1, 2: 1, 3: 1}.get(len(reads) - 1, len(body["workers"]))
            body = {"workers": body["workers"][:listed], "total": listed}
        return status, body

    monkeypatch.setattr(RouterHandler, "handle", registering)
    args = point_at(make_args(tmp_path, prompts, april_policy="copris", april_engine_wait_s=60.0,
                              rollout_num_gpus=4, rollout_num_gpus_per_engine=2), cluster)
    assert describe(args).slime.engines_started == 2
    source = rollout.AprilDataSource(args)
    output = rollout.generate_rollout(args, 0, source)
    check_train_output(output, args, version=1)
    assert len(reads) >= 5  # it read the list again until both engines were on it
    assert len(rollout._RUNTIME.client.worker_urls) == 2


@pytest.mark.parametrize("args, expected", [
    (dict(rollout_num_gpus=8, rollout_num_gpus_per_engine=2), 4),
    (dict(rollout_num_gpus=16, rollout_num_gpus_per_engine=16), 1),  # one engine over two nodes registers once
    (dict(rollout_num_gpus=8, rollout_num_gpus_per_engine=2, prefill_num_servers=1), None),
    (dict(rollout_num_gpus=8, rollout_num_gpus_per_engine=2, sglang_config="pd.yaml"), None),
    (dict(rollout_num_gpus=8, rollout_num_gpus_per_engine=2, rollout_external=True), None),
    (dict(rollout_num_gpus=None, rollout_num_gpus_per_engine=1), None),
])
def test_engines_slime_started_reads_slimes_own_layout(args, expected):
    assert SlimeArgs(**args).engines_started == expected


def test_group_reward_goes_through_batched_rm(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, group_rm=True,
                              custom_rm_path=f"{__name__}.group_parity_reward"), cluster)
    output = rollout.generate_rollout(args, 0, rollout.AprilDataSource(args))
    for group in output.samples:
        mean = sum(s.response_length for s in group) / len(group)
        assert [s.reward for s in group] == [float(s.response_length > mean) for s in group]


def test_dynamic_sampling_filter_keeps_slimes_signature(cluster, tmp_path, prompts):
    CALLS.clear()
    args = point_at(make_args(tmp_path, prompts, dynamic_sampling_filter_path=f"{__name__}.keep_mixed_rewards"),
                    cluster)
    output = rollout.generate_rollout(args, 0, rollout.AprilDataSource(args))
    check_train_output(output, args, version=1)
    for group in output.samples:
        assert len({s.reward for s in group}) > 1
    dropped = sum(1 for rewards in CALLS if len(set(rewards)) == 1)
    drop_metrics = {k: v for k, v in output.metrics.items() if k.startswith("rollout/dynamic_filter/drop_")}
    assert sum(drop_metrics.values()) == dropped


# ------------------------------------------------------------------ checkpoints
def test_partials_survive_a_restart(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    last = rollout_until_partial(args, source)
    saved = source.buffer.state_dict()
    source.save(last)

    # a new process: engines restarted (weight version counts from 1 again), state loaded from disk
    rollout.shutdown()
    restarted = make_args(tmp_path, prompts, april_over_sampling_factor=3.0, load=args.save)
    point_at(restarted, cluster)
    cluster.bump(1)
    source2 = rollout.AprilDataSource(restarted)
    source2.load(last)
    assert source2.buffer.state_dict() == saved
    assert source2.restored_policy_version == 1

    output = rollout.generate_rollout(restarted, last + 1, source2)
    # the engines say 1 again; the job continues at 2 so buffered tokens keep their lag
    assert output.metrics["april/version_offset"] == 1
    check_train_output(output, restarted, version=2)
    buffered = {g["uid"] for g in saved["groups"]}
    returned = {str(g[0].group_index) for g in output.samples}
    still_buffered = {g.uid for g in source2.buffer.groups()}
    assert buffered <= returned | still_buffered, "a buffered group was lost across the restart"
    resumed = [s for g in output.samples if str(g[0].group_index) in buffered for s in g]
    assert any(v == 1 for s in resumed for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY])


def test_save_is_atomic_and_next_to_slimes_state(slime_mode, tmp_path, prompts):
    args = make_args(tmp_path, prompts)
    source = rollout.AprilDataSource(args)
    source.save(3)
    folder = tmp_path / "ckpt" / "rollout"
    assert sorted(p.name for p in folder.iterdir()) == ["april_state_3.bin", "global_dataset_state_dict_3.pt"]
    state = read_plain_state(folder, 3)
    assert state["format"] == 4 and state["prompt_state"]["sample_offset"] == 0


def test_a_missing_state_file_stops_the_job_naming_it(slime_mode, tmp_path, prompts):
    # what a kill between slime's prompt state and ours used to leave: slime's file, not ours
    args = make_args(tmp_path, prompts)
    source = rollout.AprilDataSource(args)
    source.get_samples(2)
    source.save(3)
    source.save(4)
    folder = tmp_path / "ckpt" / "rollout"
    (folder / "april_state_4.bin").unlink()
    fresh = rollout.AprilDataSource(make_args(tmp_path, prompts, load=str(tmp_path / "ckpt")))
    with pytest.raises(StateFileError) as err:
        fresh.load(4)
    message = str(err.value)
    assert message.startswith(str(folder / "april_state_4.bin") + ": missing")
    assert "global_dataset_state_dict_4.pt" in message and "checkpoint 3" in message and "\n" not in message
    fresh.load(3)  # the latest complete checkpoint loads
    assert fresh._prompts.sample_group_index == 2


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "not_a_state", "bad_buffer"])
def test_a_torn_or_corrupt_state_file_raises_naming_it(slime_mode, tmp_path, prompts, damage):
    args = make_args(tmp_path, prompts)
    source = rollout.AprilDataSource(args)
    source.get_samples(2)
    source.save(0)
    path = tmp_path / "ckpt" / "rollout" / "april_state_0.bin"
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x00\xff{",
               "not_a_state": b"[1, 2]",
               "bad_buffer": data.replace(b'"buffer": {"format": 1', b'"buffer": {"format": 9')}[damage]
    assert damaged != data
    path.write_bytes(damaged)
    fresh = rollout.AprilDataSource(make_args(tmp_path, prompts, load=str(tmp_path / "ckpt")))
    with pytest.raises(StateFileError) as err:
        fresh.load(0)
    assert str(err.value).startswith(str(path) + ":") and "\n" not in str(err.value)


def test_stale_tmp_files_of_killed_saves_are_removed(slime_mode, tmp_path, prompts):
    args = make_args(tmp_path, prompts, load=str(tmp_path / "ckpt"))
    folder = tmp_path / "ckpt" / "rollout"
    folder.mkdir(parents=True)
    stale = [folder / ".april_state_5.bin.abc123.tmp", folder / ".april_state_6.json.x.tmp"]
    for p in stale:
        p.write_text("{half")
    keep = folder / "unrelated.tmp"
    keep.write_text("")
    source = rollout.AprilDataSource(args)
    source.save(6)
    assert not any(p.exists() for p in stale) and keep.exists()
    stale[0].write_text("{half")
    rollout.AprilDataSource(args).load(6)
    assert not stale[0].exists()


# ------------------------------------------------------------------ restarts under train.py and train_async.py
@pytest.mark.parametrize("loop", ["train", "train_async"])
def test_a_restart_from_n_loses_and_repeats_nothing(cluster, tmp_path, prompts, loop):
    restart_from_n_loses_and_repeats_nothing(cluster, tmp_path, prompts, loop)


def test_a_snapshot_does_not_follow_later_changes_to_the_buffer(slime_mode, tmp_path, prompts):
    from april_slime.core.types import TrajectoryStatus

    args = make_args(tmp_path, prompts)
    source = rollout.AprilDataSource(args)
    group = source.next_groups(1, 1)[0]
    t = group.trajectories[0]
    t.append([9, 9], [-0.5, -0.5], 1)
    t.status = TrajectoryStatus.ABORTED
    source.buffer.put(group)
    source.snapshot(0)
    saved = json.loads(json.dumps(source.buffer.state_dict()))
    # rollout 1 resumes the group in place and changes its payload
    t.append([8], [-0.1], 2)
    group.payload["prompt_sample"]["label"] = "changed"
    source.buffer.restarted_groups += 1
    source.save(0)
    state = read_plain_state(tmp_path / "ckpt" / "rollout", 0)
    assert state["buffer"] == saved


def test_snapshot_is_what_save_writes(slime_mode, tmp_path, prompts):
    """save(N) after rollout N+1 writes rollout N's state, and slime's own file agrees with ours."""
    args = make_args(tmp_path, prompts)
    source = rollout.AprilDataSource(args)
    source.next_groups(4, 1)
    source.snapshot(0)
    source.next_groups(4, 1)
    source.snapshot(1)
    source.save(0)
    assert source._prompts.sample_group_index == 8  # the live position is untouched
    state = read_plain_state(tmp_path / "ckpt" / "rollout", 0)
    assert state["prompt_state"]["sample_group_index"] == 4
    fresh = rollout.AprilDataSource(make_args(tmp_path, prompts, load=args.save))
    fresh._prompts.load(0)  # slime's own file, read by slime's own loader
    assert fresh._prompts.sample_group_index == 4


def test_add_samples_buffers_slime_groups_without_duplicates(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts), cluster)
    source = rollout.AprilDataSource(args)
    output = rollout.generate_rollout(args, 0, source)
    before = len(source.buffer)
    group = output.samples[0]
    # one sample without rollout log-probs: its response cannot be trusted for IS, so it restarts
    group[1].rollout_log_probs = None
    source.add_samples([group])
    assert len(source.buffer) == before + 1
    back = next(g for g in source.buffer.groups() if g.uid == str(group[0].group_index))
    assert back.trajectories[0].response_ids == group[0].tokens[-group[0].response_length:]
    assert back.trajectories[0].reward == group[0].reward
    assert back.trajectories[1].response_ids == [] and back.trajectories[1].reward is None
    with pytest.raises(ValueError):
        source.add_samples([group])
    assert len(source.buffer) == before + 1


# ------------------------------------------------------------------ evaluation
def test_evaluation_is_slimes_own(slime_mode, tmp_path, prompts, monkeypatch):
    sglang_rollout = importlib.import_module("slime.rollout.sglang_rollout")
    seen = []

    def fake(args, rollout_id, data_source, evaluation=False):
        seen.append((args, rollout_id, data_source, evaluation))
        return "eval output"

    monkeypatch.setattr(sglang_rollout, "generate_rollout", fake)
    args, source = make_args(tmp_path, prompts), object()
    assert rollout.generate_rollout(args, 5, source, evaluation=True) == "eval output"
    assert seen == [(args, 5, source, True)]
    assert rollout._RUNTIME is None  # no engine client was built for it


def test_module_imports_and_fails_clearly_without_slime(tmp_path, prompts):
    if slime_standin.real_slime_importable():
        pytest.skip("real slime is importable here")
    args = make_args(tmp_path, prompts)
    with pytest.raises(ImportError, match="needs slime"):
        rollout.AprilDataSource(args)


def test_get_samples_serves_buffered_groups_first_like_slimes_buffer(cluster, tmp_path, prompts):
    # for a rollout function other than ours (slime's own generate resumes from sample.tokens)
    Sample = importlib.import_module("slime.utils.types").Sample
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    rollout.generate_rollout(args, 0, source)
    buffered = len(source.buffer)
    assert buffered > 0
    groups = source.get_samples(buffered + 2)
    assert len(groups) == buffered + 2 and len(source.buffer) == 0
    for group in groups[:buffered]:
        for s in group:
            assert s.train_metadata is None
            assert len(s.rollout_log_probs) == s.response_length == len(s.loss_mask)
            if s.status is Sample.Status.ABORTED:
                assert s.response_length > 0
    fresh = groups[buffered:]
    assert all(s.status is Sample.Status.PENDING and s.response_length == 0 for g in fresh for s in g)


def test_buffered_partials_keep_their_tokens_through_repeated_hand_outs(cluster, tmp_path, prompts):
    """slime's own partial rollout may hand a buffered group back untouched (aborted before any of
    its requests reached an engine). Round after round, each response keeps its tokens, log-probs
    and the versions that generated them: none is restarted for want of versions."""
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    rollout.generate_rollout(args, 0, source)
    before = {g.uid: [(t.response_ids, t.logprobs, t.version_runs) for t in g.trajectories]
              for g in source.buffer.groups()}
    assert any(ids for responses in before.values() for ids, _, _ in responses), "nothing partial was buffered"
    for _ in range(3):
        groups = source.get_samples(len(before))
        assert {str(g[0].group_index) for g in groups} == set(before)
        assert all(s.weight_versions for g in groups for s in g if s.response_length > 0)
        source.add_samples(groups)
    after = {g.uid: [(t.response_ids, t.logprobs, t.version_runs) for t in g.trajectories]
             for g in source.buffer.groups()}
    assert set(after) == set(before)
    for uid, responses in before.items():
        for (ids, logprobs, runs), (ids2, logprobs2, runs2) in zip(responses, after[uid]):
            assert ids2 == ids and logprobs2 == logprobs, f"group {uid} lost a response on its way round"
            if ids:
                # slime's hand-out keeps the call versions, not the per-token runs: every token then
                # counts as the oldest version that touched it (never staler than it is, never fresher)
                assert runs2.plain() == [[min(v for v, _ in runs), len(ids)]]
