"""Rollout records: alignment of tokens, log-probs and per-token versions; serialisation."""

import math

import pytest

from april_slime.types import Group, Trajectory, TrajectoryStatus


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
    assert t.version_runs == [[3, 2], [4, 2]]
    assert t.token_versions() == [3, 3, 4, 4]
    assert t.call_versions == [3, 4, 4, 4]
    assert t.input_ids() == [5, 6, 7, 8, 1, 2, 3, 4] and t.remaining_tokens == 6
    assert t.staleness(current_version=6) == 3 and t.offpolicy_tokens(current_version=4) == 2


@pytest.mark.parametrize("ids, lps", [([1, 2], [-0.1]), ([1], [math.nan]), ([1], [math.inf])])
def test_misaligned_or_non_finite_output_is_refused_and_appends_nothing(ids, lps):
    t = make_trajectory()
    with pytest.raises(ValueError, match="g0/0"):
        t.append(ids, lps, version=0)
    assert t.response_ids == [] and t.logprobs == [] and t.version_runs == [] and t.call_versions == []


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
