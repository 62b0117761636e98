"""Rollout records: alignment of tokens, log-probs and per-token versions; serialisation."""

import math

import pytest

from april_slime.core.types import Group, Trajectory, TrajectoryStatus


def make_trajectory() -> Trajectory:
    return Trajectory(uid="g0/0", group_uid="g0", index_in_group=0, prompt_ids=[5, 6, 7, 8],
                      max_new_tokens=10, sampling_seed=3)


def test_stages_concatenate_with_run_length_versions():
    t = make_trajectory()
    t.append([1, 2], [-0.5, -0.25], version=3)
    t.append([], [], version=4)  # an abort that came back empty is still a call
    t.append([3], [-1.0], version=4)
    t.append([4], [-2.0], version=4)
    assert t.response_ids == [1, 2, 3, 4] and t.logprobs == [-0.5, -0.25, -1.0, -2.0]
    assert t.version_runs.plain() == [[3, 2], [4, 2]]
    assert t.token_versions() == [3, 3, 4, 4]
    assert t.call_versions == [3, 4, 4, 4]
    assert t.input_ids() == [5, 6, 7, 8, 1, 2, 3, 4] and t.remaining_tokens == 6
    assert t.staleness(current_version=6) == 3 and t.offpolicy_tokens(current_version=4) == 2


@pytest.mark.parametrize("ids, lps", [([1, 2], [-0.1]), ([1], [math.nan]), ([1], [math.inf])])
def test_misaligned_or_non_finite_output_is_refused_and_appends_nothing(ids, lps):
    t = make_trajectory()
    with pytest.raises(ValueError, match="g0/0"):
        t.append(ids, lps, version=0)
    assert t.response_ids == [] and t.logprobs == [] and t.version_runs.plain() == [] and t.call_versions == []


def test_group_round_trip_and_reset():
    t = make_trajectory()
    t.append([1, 2], [-0.5, -0.25], version=1)
    t.status, t.reward = TrajectoryStatus.COMPLETED, {"score": 1.0}
    group = Group(uid="g0", prompt_ids=[5, 6, 7, 8], trajectories=[t], created_version=1,
                  payload={"label": "42"})
    again = Group.from_dict(group.to_dict())
    assert again == group and again.complete
    again.trajectories[0].reset()
    assert again.trajectories[0].response_ids == [] and again.trajectories[0].reward is None
    assert not again.complete


def test_weights_changed_during_a_call_give_per_token_versions():
    t = make_trajectory()
    t.append([1], [-0.5], version=2)
    t.append([2, 3, 4], [-0.1, -0.2, -0.3], version=4, version_runs=[[2, 1], [3, 0], [4, 2]])
    assert t.token_versions() == [2, 2, 4, 4]
    assert t.version_runs.plain() == [[2, 2], [4, 2]]
    assert t.call_versions == [2, 4]
    with pytest.raises(ValueError, match="cover 1 tokens, not 2"):
        t.append([5, 6], [-0.1, -0.1], version=4, version_runs=[[4, 1]])
    assert t.response_length == 4 and t.call_versions == [2, 4]


def test_rejected_calls_survive_a_round_trip():
    t = make_trajectory()
    t.rejected_calls = 2
    assert Trajectory.from_dict(t.to_dict()).rejected_calls == 2
    old = t.to_dict()
    del old["rejected_calls"]  # saved before the field existed
    assert Trajectory.from_dict(old).rejected_calls == 0


def test_an_episodes_samples_survive_a_round_trip_and_a_reset():
    t = make_trajectory()
    t.append([1, 2], [-0.5, -0.25], version=1)
    t.status, t.reward = TrajectoryStatus.COMPLETED, [1.0, 0.0]
    t.episode_samples = [{"sample": {"tokens": [5, 1]}, "version_runs": [[1, 1]], "call_versions": [1],
                          "num_calls": 1, "num_aborts": 0},
                         {"sample": {"tokens": [5, 1, 9, 2]}, "version_runs": [[1, 1]], "call_versions": [1],
                          "num_calls": 1, "num_aborts": 0}]
    again = Trajectory.from_dict(t.to_dict())
    assert again == t
    old = t.to_dict()
    del old["episode_samples"]  # saved before the field existed
    assert Trajectory.from_dict(old).episode_samples is None
    again.reset()
    assert again.episode_samples is None and again.reward is None
