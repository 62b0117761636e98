"""Routing replay and top-p replay through a slime job on emulated engines that return both.

The emulated engines compute every position's routed experts under the weights of the call that
runs it, so a resume after a weight update gets different rows for the old positions than the
call that generated them sent: a sample whose rows came from the wrong segment fails here. Real
SGLang on CPU: ``tests/real/test_routing_replay_real.py``.
"""

from __future__ import annotations

import json

import pytest

from april_slime import rollout
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_workbench.emulator.replay import EmulatedReplay
from tests.support.slime_jobs import Cluster, make_args, point_at, rollout_until_partial
from tests.support.state_files import read_plain_state

REPLAY = EmulatedReplay(layers=2, topk=2, num_experts=8, top_p_ids=True, seed=0)
MOE = dict(use_rollout_routing_replay=True, num_layers=REPLAY.layers, moe_router_topk=REPLAY.topk)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            f.write(json.dumps({"prompt": f"Q{i:03d}", "label": str(i)}) + "\n")
    return path


@pytest.fixture
def moe_cluster(slime_mode):
    c = Cluster(replay=REPLAY)
    c.vocab_size = c.emulator.model.vocab_size
    c.bump(1)
    yield c
    rollout.shutdown()
    c.stop()


def expand(runs) -> list[int]:
    return [int(v) for v, c in runs for _ in range(int(c))]


def check_replayed(sample, vocab_size: int) -> bool:
    """Every position's routed experts and every token's top-p kept ids are the emulated engine's
    under the version that generated them; True when the sample spans several versions."""
    tokens, n = list(sample.tokens), sample.response_length
    prompt_len = len(tokens) - n
    versions = expand(sample.train_metadata[TOKEN_VERSIONS_KEY])
    experts = sample.rollout_routed_experts
    assert tuple(experts.shape) == (len(tokens) - 1, REPLAY.layers, REPLAY.topk)
    for i in range(len(tokens) - 1):
        # position i was run by the call that sampled token i + 1 (the prompt's by the first call)
        version = versions[max(0, i + 1 - prompt_len)]
        assert experts[i].reshape(-1).tolist() == REPLAY.routing_row(version, i, tokens[i]), (
            f"position {i} of {len(tokens)}: not the routing of version {version}")
    offsets = sample.rollout_top_p_token_offsets.tolist()
    ids = sample.rollout_top_p_token_ids.tolist()
    assert len(offsets) == n + 1 and offsets[-1] == len(ids)
    for j in range(n):
        assert ids[offsets[j]:offsets[j + 1]] == REPLAY.top_p_kept_ids(
            versions[j], prompt_len + j, tokens[prompt_len + j], vocab_size)
    return len(set(versions)) > 1


def run_steps(args, source, cluster, first: int, steps: int, most: int = 12) -> tuple[int, list[str]]:
    """``steps`` steps with a weight push after each, and more (``most`` in all) until a trained
    sample spans several versions; returns how many did, and per step what was trained and what
    stayed buffered (the diagnosis when none did)."""
    spanning, log = 0, []
    for rollout_id in range(first, first + most):
        if rollout_id >= first + steps and spanning:
            break
        output = rollout.generate_rollout(args, rollout_id, source)
        trained = [s for g in output.samples for s in g]
        spanning += sum(check_replayed(s, cluster.vocab_size) for s in trained)
        versions = sorted({v for s in trained for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY]})
        log.append(f"step {rollout_id}: {len(trained)} trained, versions {versions}, "
                   f"{source.buffer.num_partial_trajectories()} partials buffered")
        cluster.bump(rollout_id + 2)
    return spanning, log


@pytest.mark.parametrize("policy", ["copris", "april"])
def test_every_position_is_replayed_from_the_segment_that_generated_it(moe_cluster, tmp_path, prompts, policy):
    # twice the batch in flight (copris), three times the batch submitted (april): partials at every target
    args = point_at(make_args(tmp_path, prompts, april_policy=policy, april_over_sampling_factor=3.0,
                              april_concurrency=24 if policy == "copris" else None, rollout_top_p=0.9, **MOE),
                    moe_cluster)
    source = rollout.AprilDataSource(args)
    spanning, log = run_steps(args, source, moe_cluster, 0, 3)
    assert spanning > 0, "no trained sample was resumed under new weights; the test needs one:\n" + "\n".join(log)


def test_replay_data_survives_a_restart(moe_cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0, rollout_top_p=0.9, **MOE),
                    moe_cluster)
    source = rollout.AprilDataSource(args)
    last = rollout_until_partial(args, source)
    partial = [t for g in source.buffer.groups() for t in g.trajectories if t.response_ids]
    assert partial and all(t.replay.routed_rows == len(t.prompt_ids) + t.response_length - 1 for t in partial)
    source.save(last)
    rollout.shutdown()
    moe_cluster.bump(2)

    restarted = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0, rollout_top_p=0.9,
                                   load=args.save, **MOE), moe_cluster)
    source2 = rollout.AprilDataSource(restarted)
    source2.load(last)
    kept = {t.uid: bytes(t.replay.routed) for g in source2.buffer.groups() for t in g.trajectories
            if t.response_ids}
    assert kept == {t.uid: bytes(t.replay.routed) for t in partial}
    # completed surplus groups go first; the partials are resumed (under version 2) after them
    spanning, log = run_steps(restarted, source2, moe_cluster, last + 1, 2)
    assert spanning > 0, "no restored partial was trained under new weights:\n" + "\n".join(log)


def test_a_checkpoint_without_replay_restarts_its_partials(moe_cluster, tmp_path, prompts):
    plain = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), moe_cluster)
    source = rollout.AprilDataSource(plain)
    last = rollout_until_partial(plain, source)
    source.save(last)
    rollout.shutdown()

    moe = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0, load=plain.save, **MOE),
                   moe_cluster)
    source2 = rollout.AprilDataSource(moe)
    source2.load(last)
    assert all(not t.response_ids for g in source2.buffer.groups() for t in g.trajectories)
    output = rollout.generate_rollout(moe, last + 1, source2)
    for group in output.samples:
        for s in group:
            assert s.rollout_routed_experts.shape[0] == len(s.tokens) - 1


def test_engines_that_do_not_return_routed_experts_stop_the_first_step(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, **MOE), cluster)
    source = rollout.AprilDataSource(args)
    with pytest.raises(AprilConfigError) as err:
        rollout.generate_rollout(args, 0, source)
    message = str(err.value)
    assert message.startswith("use_rollout_routing_replay: the rollout engines do not return")
    assert "--enable-return-routed-experts" in message and "\n" not in message
    assert len(source.buffer) == 0  # nothing was started, nothing is lost


def test_engines_without_top_p_ids_stop_the_first_step(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, rollout_top_p=0.9), cluster)
    with pytest.raises(AprilConfigError, match=r"^rollout_top_p: .*sglang-top_p\.patch"):
        rollout.generate_rollout(args, 0, rollout.AprilDataSource(args))


def test_slime_groups_handed_back_keep_their_replay(moe_cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, rollout_top_p=0.9, **MOE), moe_cluster)
    source = rollout.AprilDataSource(args)
    group = rollout.generate_rollout(args, 0, source).samples[0]
    group[1].rollout_routed_experts = group[1].rollout_routed_experts[:-1]  # one row short: restarts
    source.add_samples([group])
    back = next(g for g in source.buffer.groups() if g.uid == str(group[0].group_index))
    assert back.trajectories[1].response_ids == []
    out = next(g for g in source.get_samples(len(source.buffer)) if g[0].group_index == group[0].group_index)
    assert out[0].rollout_routed_experts.tolist() == group[0].rollout_routed_experts.tolist()
    assert out[0].rollout_top_p_token_offsets.tolist() == group[0].rollout_top_p_token_offsets.tolist()


@pytest.mark.parametrize("function", ["multi_turn", "fan_out"])
def test_episodes_carry_the_top_p_kept_ids_of_their_calls(moe_cluster, tmp_path, prompts, function):
    """Multi-turn episodes under copris with --rollout-top-p 0.9: one sample per episode, or slime's
    compact shape (a list of samples, one per turn; ``agent_functions.fan_out``). Every model token
    of every trained sample has its call's kept ids (the emulated engine keeps the sampled token
    first), stitched over the call's segments; a tool's tokens have none, as slime pads them."""
    from tests.support import agent_functions as af

    af.reset()
    args = point_at(make_args(tmp_path, prompts, april_policy="copris", april_concurrency=12, rollout_top_p=0.9,
                              custom_generate_function_path=f"tests.support.agent_functions.{function}"),
                    moe_cluster)
    source = rollout.AprilDataSource(args)
    checked = resumed = 0
    try:
        for step in range(8):
            output = rollout.generate_rollout(args, step, source)
            moe_cluster.bump(step + 2)
            flat = [s for g in output.samples for m in g for s in (m if isinstance(m, list) else [m])]
            for s in flat:
                offsets, ids = s.rollout_top_p_token_offsets.tolist(), s.rollout_top_p_token_ids.tolist()
                assert len(offsets) == s.response_length + 1 and offsets[-1] == len(ids)
                response = s.tokens[len(s.tokens) - s.response_length:]
                for k, (m, token) in enumerate(zip(s.loss_mask, response)):
                    kept = ids[offsets[k]:offsets[k + 1]]
                    assert (kept[:1] == [token]) if m else kept == [], f"token {k} (mask {m}): kept {kept}"
                checked += 1
            resumed += output.metrics["april/episodes/resumed_calls"]
            if step >= 2 and resumed:
                break
    finally:
        af.reset()
    assert checked and resumed, "no episode's call was resumed across a step"


def generated_positions(samples) -> dict[int, int]:
    """Position -> version of every generated (loss-mask 1) token of an episode's samples (one, or
    a fan-out's, each holding the conversation before its turn)."""
    out = {}
    for s in samples:
        prompt_len = len(s.tokens) - s.response_length
        for k, (m, v) in enumerate(zip(s.loss_mask, expand(s.train_metadata[TOKEN_VERSIONS_KEY]))):
            if m:
                out[prompt_len + k] = v
    return out


def check_episode_routing(sample, generated: dict[int, int]) -> None:
    """Every position's routed experts are those of the call that ran it first (``core.replay``): the
    call that sampled the next token, under that token's version; a tool's observation's (and the
    prompt's), the next call's prefill, under the version of that call's first token."""
    tokens = list(sample.tokens)
    experts = sample.rollout_routed_experts
    assert tuple(experts.shape) == (len(tokens) - 1, REPLAY.layers, REPLAY.topk)
    for i in range(len(tokens) - 1):
        version = generated[min(p for p in generated if p > i)]
        assert experts[i].reshape(-1).tolist() == REPLAY.routing_row(version, i, tokens[i]), (
            f"position {i} of {len(tokens)}: not the routing of version {version}")


@pytest.mark.parametrize("function", ["multi_turn", "fan_out"])
def test_episodes_replay_the_routing_of_the_call_that_ran_each_position(moe_cluster, tmp_path, prompts, function):
    """Multi-turn episodes under copris with routing replay, weights bumped every step: each
    returned sample (one per episode, or one per turn, each with the conversation before its turn)
    holds, at each position, the routing of the call that ran it first, over resumed calls and tool
    tokens."""
    from tests.support import agent_functions as af

    af.reset()
    args = point_at(make_args(tmp_path, prompts, april_policy="copris", april_concurrency=12, **MOE,
                              custom_generate_function_path=f"tests.support.agent_functions.{function}"),
                    moe_cluster)
    source = rollout.AprilDataSource(args)
    spanning = resumed = 0
    try:
        for step in range(8):
            output = rollout.generate_rollout(args, step, source)
            moe_cluster.bump(step + 2)
            for episode in (m if isinstance(m, list) else [m] for g in output.samples for m in g):
                generated = generated_positions(episode)
                spanning += len(set(generated.values())) > 1
                for s in episode:
                    check_episode_routing(s, generated)
            resumed += output.metrics["april/episodes/resumed_calls"]
            if step >= 2 and resumed and spanning:
                break
    finally:
        af.reset()
    assert resumed, "no episode's call was resumed across a step"
    assert spanning, "no sample's model tokens span two versions; the stitch over calls was not checked"


def test_episodes_whose_calls_do_not_continue_one_sequence_stop_the_job(moe_cluster, tmp_path, prompts):
    """Two calls awaited together (``agent_functions.concurrent_turns``) ran on other inputs than the
    sample's tokens: their routing cannot be replayed on it, and the first step says so."""
    from tests.support import agent_functions as af

    af.reset()
    args = point_at(make_args(tmp_path, prompts, april_policy="copris", **MOE,
                              custom_generate_function_path="tests.support.agent_functions.concurrent_turns"),
                    moe_cluster)
    try:
        with pytest.raises(Exception) as refused:
            rollout.generate_rollout(args, 0, rollout.AprilDataSource(args))
    finally:
        af.reset()
    message = str(refused.value)
    assert "concurrent_turns cannot run under the plugin" in message and "\n" not in message, message
    assert "with use_rollout_routing_replay each model call's input_ids must be" in message


@pytest.mark.parametrize("function", ["multi_turn", "fan_out"])
def test_finished_episodes_keep_their_routing_across_a_restart(moe_cluster, tmp_path, prompts, function):
    """A checkpoint of a routing-replay job keeps its finished episodes (their samples' rows are
    whole); the restored job trains them with those rows, and restarts only the unfinished ones."""
    from tests.support import agent_functions as af

    af.reset()
    settings = dict(april_policy="copris", april_concurrency=12, april_over_sampling_factor=3.0, **MOE,
                    custom_generate_function_path=f"tests.support.agent_functions.{function}")
    args = point_at(make_args(tmp_path, prompts, **settings), moe_cluster)
    source = rollout.AprilDataSource(args)
    try:
        rollout.generate_rollout(args, 0, source)
        source.save(0)
        rollout.shutdown()
        saved = read_plain_state(next(tmp_path.rglob("april_state_0.bin")).parent, 0)["buffer"]["groups"]
        finished = {t["uid"] for g in saved for t in g["trajectories"]
                    if t["episode_sample"] is not None or t["episode_samples"] is not None}
        assert finished, "no finished episode was buffered; the test needs one"
        moe_cluster.bump(2)

        restarted = point_at(make_args(tmp_path, prompts, load=args.save, **settings), moe_cluster)
        source2 = rollout.AprilDataSource(restarted)
        source2.load(0)
        assert {t.uid for g in source2.buffer.groups() for t in g.trajectories if t.response_ids} == finished
        output = rollout.generate_rollout(restarted, 1, source2)
        for episode in (m if isinstance(m, list) else [m] for g in output.samples for m in g):
            generated = generated_positions(episode)
            for s in episode:
                check_episode_routing(s, generated)
    finally:
        af.reset()
