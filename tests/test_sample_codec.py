"""The Sample codec of ``april_slime.rollout`` against the engine's own numbers.

Every slime sample the rollout function hands to the trainer, every buffered sample the data
source serves to another rollout function, and every sample handed back through ``add_samples``
must carry exactly the tokens and rollout log-probs the engine generated, position by position,
with the per-token policy versions that generated them.

The emulated engines run a deterministic ``SyntheticLM``: from a trajectory's prompt, its sampling
seed and the version of each token, ``SyntheticLM.reference`` recomputes the stream the engines
produced, so the samples are checked against an independent reference rather than against what
the plugin recorded on the way. Shape checks (one log-prob per token, all <= 0) cannot see a list
that is reordered, shifted or taken from another sample; these tests can. Responses are resumed
across weight updates (over-sampling leaves partials that later rollouts finish under newer
versions), and one test pushes new weights while requests are generating (a single generate call
then spans two versions), so the reference also depends on the per-token versions being right.

Runs against the real slime when it is importable, else against ``slime_standin``, as
``test_rollout_slime`` does, on the same emulated cluster and slime arguments
(``tests.support.slime_jobs``).
"""

from __future__ import annotations

import json
import math

import pytest

from april_slime import rollout, samples
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_workbench.emulator.request import _RUNNING
from tests.support.slime_jobs import Cluster, make_args, point_at

ROLLOUTS = 3
MAX_ROLLOUTS = 12  # a starved machine may need several steps before one aborts a request with tokens

@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(240):  # enough for MAX_ROLLOUTS over-sampled steps
            f.write(json.dumps({"prompt": f"Q{i:03d}", "label": str(2 * i)}) + "\n")
    return path


def expand(runs) -> list[int]:
    return [int(v) for v, c in runs for _ in range(int(c))]


def reference(cluster: Cluster, prompt_ids: list[int], group_index, position: int, versions: list[int],
              seed: int) -> tuple[list[int], list[float]]:
    """The engines' stream for one trajectory: its sampling seed is a pure function of the job
    seed, the group and the position in the group (``samples.sampling_seed``)."""
    sampling_seed = samples.sampling_seed(seed, str(group_index), position)
    return cluster.emulator.model.reference(prompt_ids, sampling_seed, len(prompt_ids), versions)


def check_sample(cluster: Cluster, args, s, position: int, versions: list[int]) -> None:
    prompt_ids = list(s.tokens[:len(s.tokens) - s.response_length])
    response = list(s.tokens[len(prompt_ids):])
    assert len(versions) == s.response_length, f"sample {s.index}: versions do not cover the response"
    ids, lps = reference(cluster, prompt_ids, s.group_index, position, versions, args.rollout_seed)
    assert response == ids, f"sample {s.index}: response tokens differ from the engine's"
    # exact: the log-probs reach the sample through JSON, which round-trips a float exactly
    assert list(s.rollout_log_probs) == lps, f"sample {s.index}: rollout_log_probs differ from the engine's"


def run_rollouts(cluster: Cluster, args, source, until=None) -> list:
    """``ROLLOUTS`` training rollouts with a weight update before each later one, as slime's
    train.py does; returns the trained groups of every rollout. With ``until`` (a test of the
    trained groups so far), rollouts go on (at most ``MAX_ROLLOUTS``) until it holds: on a
    starved machine a step can end every request before its target aborts one with tokens."""
    trained = []
    for rollout_id in range(MAX_ROLLOUTS):
        if rollout_id >= ROLLOUTS and (until is None or until(trained)):
            break
        if rollout_id:
            cluster.bump(rollout_id + 1)
        trained.extend(rollout.generate_rollout(args, rollout_id, source).samples)
    return trained


def spans_versions(trained: list) -> bool:
    """Whether some trained sample holds tokens of two policy versions (a resumed partial)."""
    return any(len({v for v, _ in s.train_metadata[TOKEN_VERSIONS_KEY]}) > 1 for g in trained for s in g)


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_trained_samples_carry_the_engines_log_probs_in_order(cluster, tmp_path, prompts, policy):
    args = point_at(make_args(tmp_path, prompts, april_policy=policy, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    trained = run_rollouts(cluster, args, source, until=spans_versions)
    checked = multi_version = 0
    for group in trained:
        for position, s in enumerate(group):
            versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
            check_sample(cluster, args, s, position, versions)
            checked += s.response_length >= 2  # a one-token list reads the same in any order
            multi_version += len(set(versions)) > 1
    assert checked > 0, "no sample had two tokens; the test checks nothing"
    assert multi_version > 0, "no trained sample was resumed under a newer version; the test needs one"


def test_buffered_samples_served_to_another_rollout_function_carry_the_engines_log_probs(
        cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    run_rollouts(cluster, args, source, until=lambda _: len(source.buffer) > 0)
    # get_samples drops the per-token versions (another rollout function extends the responses),
    # so they are read from the buffer before it hands the groups out
    versions = {t.uid: t.token_versions() for g in source.buffer.groups() for t in g.trajectories}
    buffered = len(source.buffer)
    assert buffered > 0, "over-sampling left nothing buffered; the test needs some"
    checked = 0
    for group in source.get_samples(buffered):
        for position, s in enumerate(group):
            if s.response_length == 0:
                continue
            check_sample(cluster, args, s, position, versions[f"{s.group_index}/{position}"])
            checked += s.response_length >= 2
    assert checked > 0, "no buffered sample had two tokens; the test checks nothing"


def test_samples_handed_back_keep_the_engines_log_probs(cluster, tmp_path, prompts):
    """add_samples (slime's own partial rollout, or a user's all-samples hook, returning groups):
    the buffered trajectories hold the sample's tokens, log-probs and versions unchanged."""
    args = point_at(make_args(tmp_path, prompts, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    trained = run_rollouts(cluster, args, source)
    returned = trained[-2:]
    source.add_samples(returned)
    by_uid = {g.uid: g for g in source.buffer.groups()}
    checked = 0
    for group in returned:
        kept = by_uid[str(group[0].group_index)]
        for position, (s, t) in enumerate(zip(group, kept.trajectories, strict=True)):
            assert t.response_ids == list(s.tokens[len(s.tokens) - s.response_length:])
            assert t.logprobs == list(s.rollout_log_probs)
            assert t.token_versions() == expand(s.train_metadata[TOKEN_VERSIONS_KEY])
            ids, lps = reference(cluster, t.prompt_ids, s.group_index, position, t.token_versions(),
                                 args.rollout_seed)
            assert (t.response_ids, t.logprobs) == (ids, lps), f"{t.uid}: differs from the engine's stream"
            assert all(math.isfinite(lp) for lp in t.logprobs)
            checked += t.response_length >= 2
    assert checked > 0


def bump_inside_a_call(cluster) -> dict:
    """Push new weights (bump every engine's version) at the end of the first decode step after
    which a request is still generating with tokens already generated: that call then spans the
    update, its first tokens under the old version and the rest under the new one (as when weights
    are pushed during generation, e.g. slime's fully asynchronous training). The engines' own step
    places the event, so it happens on any machine. Returns what it saw when it pushed."""
    seen: dict = {}
    for engine in cluster.emulator.engines:
        commit = engine._commit

        def commit_then_bump(plan, engine=engine, commit=commit):
            commit(plan)
            if "version" in seen:
                return
            started = [r for r in engine._requests.values() if r.state == _RUNNING and r.generated > 0]
            if started:
                seen["rids"] = {r.rid for r in started}
                seen["version"] = cluster.emulator.bump_weight_version()

        engine._commit = commit_then_bump
    return seen


@pytest.mark.parametrize("policy", ["april", "copris"])
def test_weights_pushed_mid_call_give_each_token_the_version_that_generated_it(cluster, tmp_path, prompts, policy):
    """A generate call that spans a weight update returns per-token version runs; the samples
    (trained and buffered) must carry them, token by token. With the call's final version for all
    of its tokens, the reference stream for those versions differs from the tokens generated."""
    bumped = bump_inside_a_call(cluster)
    args = point_at(make_args(tmp_path, prompts, april_policy=policy, april_over_sampling_factor=3.0), cluster)
    source = rollout.AprilDataSource(args)
    trained = rollout.generate_rollout(args, 0, source).samples
    rollout.shutdown()
    assert "version" in bumped, "no decode step left a request generating; nothing spanned an update"
    # get_samples drops the per-token versions: read them, and each call's version, from the buffer
    kept = {t.uid: (t.token_versions(), t.call_versions) for g in source.buffer.groups() for t in g.trajectories}
    buffered = source.get_samples(len(source.buffer)) if len(source.buffer) else []
    checked = spanning = 0
    for group, from_buffer in [*((g, False) for g in trained), *((g, True) for g in buffered)]:
        for position, s in enumerate(group):
            if s.response_length == 0:
                continue
            if from_buffer:
                versions, calls = kept[f"{s.group_index}/{position}"]
            else:
                versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
                calls = [int(v) for v in s.weight_versions]
            check_sample(cluster, args, s, position, versions)
            checked += 1
            # a call may be one of several stages of the response; only the first call's start is
            # known here: its first token older than the version it reported means it spanned the update
            spanning += versions[0] < int(calls[0])
    assert checked > 0
    assert spanning > 0, "no sample's first generate call spanned the weight update (or its tokens lost their versions)"
