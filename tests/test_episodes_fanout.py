"""slime's compact shape: a generate function that returns ``list[Sample]`` (one episode, several
training samples, e.g. one per model turn) runs unchanged under partial rollout. Each sample keeps
the per-token versions of the calls that made its tokens, the batch comes out nested the way slime
flattens it, and a list that breaks slime's rules (siblings with different ``rollout_id``, a call's
output dropped) is re-run, then given up, like any other unusable result.

Also here: between two rollout steps no model call reaches an engine, even when an episode's tool
finishes then and its function calls the model at once.

Runs inside slime (real where importable, else the stand-in) on emulated engines; the function is
``tests.support.agent_functions.fan_out`` (even sample indices fan out, odd ones return one sample).
"""

from __future__ import annotations

import itertools
import time

import pytest

from april_slime import rollout
from april_slime.core.episodes import EpisodeError
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.core.served import match_calls
from tests.support import agent_functions as af
from tests.support.agent_functions import check_sample, expand, served_calls
from tests.support.slime_jobs import make_args, point_at

FUNCTION = "tests.support.agent_functions.fan_out"


@pytest.fixture
def prompts(tmp_path):
    yield af.prompts_file(tmp_path)
    af.reset()


def job(tmp_path, prompts, cluster, function=FUNCTION, **settings):
    args = point_at(make_args(tmp_path, prompts, custom_generate_function_path=function, **settings), cluster)
    return args, rollout.AprilDataSource(args)


def flatten(data):
    """What slime's RolloutManager does to the rollout function's samples before training."""
    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    return data


def check_turn_sample(s, version_floor: int) -> None:
    """One turn of a fanned-out episode: every token trains, and carries the version of the call
    that generated it."""
    assert s.response_length > 0 and s.loss_mask == [1] * s.response_length
    assert len(s.rollout_log_probs) == s.response_length
    versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
    assert len(versions) == s.response_length
    assert all(version_floor <= v <= s.train_metadata["april_policy_version"] for v in versions)
    assert s.reward is not None


# ------------------------------------------------------------------ matching a sibling to its calls
def test_a_sibling_is_matched_to_the_whole_calls_it_holds():
    calls = served_calls([5, 6], [7], [8, 9])
    # the second and third calls, with a tool token between them
    versions, used = match_calls("s", [7, 90, 8, 9], [1, 0, 1, 1], [-0.2, 0.0, -0.3, -0.3], calls)
    assert used == [1, 2] and versions == [11, 11, 12, 12]


@pytest.mark.parametrize("response, mask, logprobs", [
    ([5], [1], [-0.1]),  # part of a call's output
    ([7, 5, 6], [1, 1, 1], [-0.2, -0.1, -0.1]),  # calls out of order
    ([5, 6], [1, 1], [-0.1, -0.5]),  # a log-prob that is not the call's
])
def test_a_sibling_that_is_not_whole_calls_in_order_fails_loudly(response, mask, logprobs):
    with pytest.raises(EpisodeError, match="not the whole output of any further model call"):
        match_calls("s", response, mask, logprobs, served_calls([5, 6], [7]))


# ------------------------------------------------------------------ jobs
@pytest.mark.parametrize("policy", ["sync", "copris"])
def test_an_episode_returning_a_list_trains_each_sample_with_its_own_versions(cluster, tmp_path, prompts, policy):
    """copris with more episodes than its target: calls are aborted at the target and resumed next
    step; whatever the step, the output is nested as slime's compact rollouts are (group x sample of
    the prompt x samples of one episode) and flattens to samples with exact per-token versions."""
    args, source = job(tmp_path, prompts, cluster, april_policy=policy, april_concurrency=12)
    trained, fanned, spanning = set(), 0, 0
    for step in range(16):  # until a resumed turn spans two versions: a starved step may resume none
        cluster.bump(step + 1)
        out = rollout.generate_rollout(args, step, source)
        assert len(out.samples) == args.rollout_batch_size
        for group in out.samples:
            assert len(group) == args.n_samples_per_prompt
            assert all(isinstance(member, list) for member in group), "a batch with a fan-out is not nested alike"
            for member in group:
                index = member[0].index
                assert index not in trained, f"sample {index} trained twice"
                trained.add(index)
                if index % 2 == 1:  # returned one sample
                    assert len(member) == 1
                    check_sample(member[0], version_floor=1)
                    continue
                fanned += 1
                assert len(member) == af.TURNS
                assert len({s.rollout_id for s in member}) == 1
                for s in member:
                    check_turn_sample(s, version_floor=1)
                    spanning += len(set(expand(s.train_metadata[TOKEN_VERSIONS_KEY]))) > 1
                # the turns chain: each sample's prompt is the previous one's tokens and a tool's output
                for before, after in zip(member, member[1:]):
                    assert after.tokens[:len(before.tokens)] == before.tokens
                    assert after.tokens[len(before.tokens):len(before.tokens) + len(af.TOOL_TOKENS)] == af.TOOL_TOKENS
        flat = flatten(out.samples)
        assert all(type(s).__name__ == "Sample" for s in flat)
        if policy == "sync" or spanning:
            break
    assert fanned > 0
    if policy == "copris":
        assert spanning, "no turn resumed across a step kept tokens of two policy versions"


def test_siblings_that_break_slimes_rules_are_rerun_then_given_up(cluster, tmp_path, prompts):
    """Sample 0's siblings carry different rollout_ids (slime would count its episode three times)
    once, then its episode is fine: re-run alone. Sample 2 drops a turn's output twice: given up
    with its group (max one re-run)."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_max_episode_failures=1)
    af.CONTROL["split_rollout_id"][0] = 1
    af.CONTROL["drop_turn"][4] = 2
    samples, totals = {}, {}
    for step in range(4):
        cluster.bump(step + 1)
        out = rollout.generate_rollout(args, step, source)
        for s in flatten(out.samples):
            samples.setdefault(s.index, []).append(s)
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0) + v
    assert totals["april/episodes/failures"] == 3
    assert totals["april/episodes/given_up"] == 1
    assert totals["april/episodes/failed_groups"] == 1
    assert len(samples[0]) == af.TURNS and len({s.rollout_id for s in samples[0]}) == 1
    assert 4 not in samples, "the given-up group was trained"
    assert af.CONTROL["split_rollout_id"][0] == 0 and af.CONTROL["drop_turn"][4] == 0


def test_rewards_of_a_fanned_out_episode_are_per_sample(cluster, tmp_path, prompts):
    """slime's reward path rewards every sample of a list (its own generate_and_rm does the same),
    and the dynamic filter sees the group's samples, lists flattened."""
    args, source = job(tmp_path, prompts, cluster, april_policy="sync",
                       dynamic_sampling_filter_path="tests.support.agent_functions.keep_all")
    cluster.bump(1)
    out = rollout.generate_rollout(args, 0, source)
    for s in flatten(out.samples):
        assert s.reward is not None
    assert any(len(m) == af.TURNS for g in out.samples for m in g)
    seen = af.FILTERED
    assert len(seen) == args.rollout_batch_size and all(set(names) == {"Sample"} for names in seen)
    # the filter saw every sample of each group: a fanned-out member's TURNS, another's one
    assert sorted(map(len, seen)) == sorted(sum(map(len, g)) for g in out.samples)


def test_no_model_call_reaches_an_engine_between_two_steps(cluster, tmp_path, prompts):
    """copris leaves episodes in their tools at a step's end; their tools finish while no step runs
    and their functions call the model at once. Those calls wait: the engines receive nothing until
    the next step, which then serves them."""
    args, source = job(tmp_path, prompts, cluster, "tests.support.agent_functions.multi_turn",
                       april_policy="copris", april_concurrency=12)
    emulator = cluster.emulator

    def received() -> int:
        totals = emulator.stats()["totals"]
        return totals["finished_requests"] + totals["aborted_requests"] + sum(
            load["num_running_reqs"] + load["num_waiting_reqs"] for load in emulator.loads())

    for step in range(10):
        cluster.bump(step + 1)
        rollout.generate_rollout(args, step, source)
        runner = rollout._RUNTIME.episodes
        at_end = received()
        # a call made after the step ended: its trajectory was never sent (no call yet)
        made_between = lambda runner=runner: [c for e in runner.episodes.values() if e.live  # noqa: E731
                                for c in e.pending.values() if c.trajectory.num_calls == 0]
        deadline = time.monotonic() + 30
        while not made_between() and any(e.live and not e.pending for e in runner.episodes.values()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        waiting = made_between()
        assert received() == at_end, "a model call reached an engine between two steps"
        if waiting:
            # later steps serve them (a step can reach its target before it dispatches one)
            for later in range(step + 1, step + 6):
                cluster.bump(later + 1)
                rollout.generate_rollout(args, later, source)
                if any(call.trajectory.num_calls > 0 for call in waiting):
                    return
            pytest.fail("no call made between two steps was served by the five steps after")
    pytest.fail("no episode called the model between two steps in 10 steps")
