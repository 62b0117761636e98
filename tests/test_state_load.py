"""Reading a format-4 state file in its columnar form: the trajectories ``Trajectory.from_columns``
makes are those ``from_dict`` makes of each row (owning their lists, the columns left as read), a
bad value is refused naming its trajectory, and the work of a load is per column, not per
trajectory (pinned by counting the Python calls a load makes)."""

from __future__ import annotations

import collections
import copy
import sys

import pytest

from april_slime.core.buffer import TRAJECTORY_COLUMNS, PartialBuffer
from april_slime.core.jsonfile import StateFileError
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.core.versions import VersionRuns
from tests.support.state_fixture import fixture_buffer
from tests.test_buffer import checkpoints, make_group
from tests.test_state_file import rewrite_index, routed_group, saved_file


def rows_and_columns(buffer: PartialBuffer) -> tuple[list[dict], dict[str, list]]:
    rows = [t.to_dict(shared=True) for g in buffer.groups() for t in g.trajectories]
    return rows, {key: [r[key] for r in rows] for key in rows[0]}


def test_trajectories_from_columns_are_what_from_dict_makes_of_each_row():
    rows, columns = rows_and_columns(fixture_buffer())  # routed, top-p, episode, finished, pending
    rows[1]["version_runs"] = columns["version_runs"][1] = [[0, 0], [1, 2], [1, 7]]  # merged, as ``of`` merges
    rows[2]["status"] = columns["status"][2] = "running"
    for name in ("reward", "loss_mask", "rejected_calls"):  # an older file without them: the defaults
        del columns[name]
        for r in rows:
            del r[name]
    kept = {name: (list(values), [id(v) for v in values]) for name, values in columns.items()}
    made = Trajectory.from_columns(columns)
    expected = [Trajectory.from_dict(copy.copy(r)) for r in rows]
    assert made == expected and [t.to_dict() for t in made] == [t.to_dict() for t in expected]
    assert made[1].version_runs.plain() == [[1, 9]] and made[2].status is TrajectoryStatus.RUNNING
    # the columns are left as read (a restore keeps them as its snapshot); the lists a trajectory
    # changes in place are its own
    assert {name: (values, [id(v) for v in values]) for name, values in columns.items()} == kept
    for t, versions in zip(made, columns["call_versions"]):
        assert t.call_versions == versions and t.call_versions is not versions and t.loss_mask is None
    episode = made[-2]
    assert episode.sampling_params == {"temperature": 0.5} and episode.episode_sample["rows"] == bytes(range(24))


def test_version_runs_each_is_of_of_each():
    many = [[[0, 4], [1, 2]], [[2, 0], [2, 3], [2, 1]], [], [(5, 1)], [[1.0, 2]], VersionRuns.single(3, 2),
            ((v, 1) for v in (7, 7))]
    expected = [VersionRuns.of(p) for p in copy.deepcopy(many[:-2])] + [many[-2], VersionRuns.of([(7, 2)])]
    made = VersionRuns.each(many)
    assert made == expected and made[-2] is many[-2] and [r.total for r in made] == [r.total for r in expected]
    assert made[1].plain() == [[2, 4]] and made[4].plain() == [[1, 2]]
    with pytest.raises(ValueError, match="negative count"):
        VersionRuns.each([[[0, 1]], [[0, -1]]])


@pytest.mark.parametrize("change, error, message", [
    (lambda c: c["status"].__setitem__(1, "bogus"), ValueError, "trajectory 'g/1': status: 'bogus' is not a valid"),
    (lambda c: c["version_runs"].__setitem__(1, [[0, -1]]), ValueError, "trajectory 'g/1': version_runs: "),
    (lambda c: c["replay"].__setitem__(0, {"routed_itemsize": 3}), ValueError, "trajectory 'g/0': replay: "),
    (lambda c: c["response_ids"].__setitem__(1, [1.5]), ValueError, "g/1: response_ids: float64 values"),
    (lambda c: c.update(color=[1, 2]), TypeError, "unknown fields ['color']"),
    (lambda c: c.pop("sampling_seed"), TypeError, "missing fields ['sampling_seed']"),
    (lambda c: c["uid"].pop(), ValueError, "values, not one per trajectory"),
])
def test_a_bad_column_value_is_refused_naming_its_trajectory(change, error, message):
    buffer = PartialBuffer()
    buffer.put(routed_group("g"))
    _, columns = rows_and_columns(buffer)
    change(columns)
    with pytest.raises(error) as err:
        Trajectory.from_columns(columns)
    assert message in str(err.value)


def test_a_bad_value_in_a_file_is_refused_naming_the_file_and_the_trajectory_and_nothing_is_replaced(tmp_path):
    buffer = PartialBuffer()
    buffer.put(routed_group("g"))
    path = saved_file(tmp_path, buffer)
    rewrite_index(path, lambda ix: ix["trajectories"]["status"].__setitem__(1, "bogus"))
    kept = PartialBuffer()
    kept.put(make_group("kept"))
    with pytest.raises(StateFileError) as err:
        checkpoints(tmp_path, kept).load(0)
    assert str(err.value).startswith(f"{path}:") and "trajectory 'g/1': status" in str(err.value)
    assert [g.uid for g in kept.groups()] == ["kept"]
    for groups_change, message in ((lambda ix: ix["buffer"]["groups"][0].update(trajectories=3), "do not hold 3"),
                                   (lambda ix: ix["buffer"]["groups"][0].update(trajectories="2"), "not an integer")):
        path = saved_file(tmp_path, buffer)
        rewrite_index(path, groups_change)
        with pytest.raises(StateFileError, match=message):
            checkpoints(tmp_path, kept).load(0)


def test_a_columnar_buffer_state_with_counts_that_do_not_add_up_is_refused():
    buffer = PartialBuffer()
    buffer.put(routed_group("g"))
    _, columns = rows_and_columns(buffer)
    group = {**buffer.state_dict(shared=True)["groups"][0], "trajectories": 3}
    with pytest.raises(ValueError, match="the groups count 3 trajectories, the columns hold 2"):
        Group.from_columns([group], columns)
    with pytest.raises(ValueError, match="not an integer >= 0"):
        PartialBuffer().load_state_dict({"format": 1, "groups": [{**group, "trajectories": -1}],
                                         TRAJECTORY_COLUMNS: columns})


def python_calls_of_a_load(tmp_path, groups: int) -> collections.Counter:
    """The Python functions a load of ``groups`` groups of four calls, by name, with the buffer it
    restored checked against the one saved."""
    folder = tmp_path / str(groups)
    buffer = PartialBuffer()
    for k in range(groups):
        buffer.put(make_group(f"g{k}", finished_lengths=(3, 4), partial=((0, 2), (1, 5))))
    checkpoints(folder, buffer).save(0, policy_version=1)
    loaded, calls = PartialBuffer(), collections.Counter()
    restore = checkpoints(folder, loaded)

    def count(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_qualname] += 1

    sys.setprofile(count)
    try:
        restore.load(0)
    finally:
        sys.setprofile(None)
    assert loaded.state_dict() == buffer.state_dict()
    return calls


def test_a_load_checks_and_converts_each_field_once_per_column_not_once_per_trajectory(tmp_path):
    few, many = python_calls_of_a_load(tmp_path, 20), python_calls_of_a_load(tmp_path, 40)
    per_trajectory = {name: (many[name] - few[name]) / 80 for name in many if many[name] != few[name]}
    # nothing re-validates a trajectory: no record, status, version runs or array is checked one by one
    for name in ("Trajectory.from_dict", "Trajectory.__setattr__", "VersionRuns.of", "VersionRuns.add",
                 "Column.of", "frozen_array", "_Arrays._make", "_Arrays._ref", "_replay", "_version_runs"):
        assert few[name] == many[name], f"{name} is called once per trajectory or group"
    # what is left per trajectory: its columns made (a prompt, the response, the log-probs; a group's
    # prompt is one more per group of four) and their lengths read for the alignment check; then a
    # few calls per group (a generator's step, its payload copied for the snapshot) and the log
    # line's count of partial samples (before the columnar load: 25 calls per trajectory)
    assert per_trajectory.pop("Column.__init__") == 3 + 1 / 4
    assert per_trajectory.pop("Column.__len__") == 2 and per_trajectory.pop("VersionRuns.total") == 1
    assert sum(per_trajectory.values()) <= 2.5, per_trajectory
