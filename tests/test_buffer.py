import json
import os

import pytest

from april_slime.core import checkpoint
from april_slime.core.buffer import PartialBuffer
from april_slime.core.jsonfile import StateFileError
from april_slime.core.types import Group, Trajectory, TrajectoryStatus


def make_group(uid: str, *, finished_lengths=(), partial=((0, 3),), created_version=0,
               n_pending=0, payload=None) -> Group:
    """A group whose finished trajectories have the given lengths (all generated at version 0) and
    whose partial ones are described as (version, tokens) runs."""
    trajectories = []

    def new(i):
        return Trajectory(uid=f"{uid}/{i}", group_uid=uid, index_in_group=i, prompt_ids=[1, 2, 3, 4],
                          max_new_tokens=100, sampling_seed=i)

    for length in finished_lengths:
        t = new(len(trajectories))
        t.append(list(range(length)), [-0.5] * length, created_version)
        t.status, t.finish_reason = TrajectoryStatus.COMPLETED, "stop"
        trajectories.append(t)
    for version, tokens in partial:
        t = new(len(trajectories))
        t.append(list(range(tokens)), [-0.25] * tokens, version)
        t.status, t.finish_reason, t.num_calls = TrajectoryStatus.ABORTED, "abort", 1
        trajectories.append(t)
    for _ in range(n_pending):
        trajectories.append(new(len(trajectories)))
    return Group(uid=uid, prompt_ids=[1, 2, 3, 4], trajectories=trajectories,
                 created_version=created_version, payload=payload)


def uids(groups):
    return [g.uid for g in groups]


def test_verl_priority_orders_by_unfinished_then_finished_length_then_staleness():
    buf = PartialBuffer(priority="verl")
    buf.put(make_group("two_unfinished", finished_lengths=(5,), partial=((3, 2), (3, 2))))
    buf.put(make_group("one_unfinished_long", finished_lengths=(50, 50), partial=((3, 2),)))
    buf.put(make_group("one_unfinished_short", finished_lengths=(5, 5), partial=((3, 2),)))
    buf.put(make_group("no_finished", partial=((3, 1),)))
    buf.put(make_group("no_finished_staler", partial=((1, 1),)))
    buf.put(make_group("complete", finished_lengths=(7, 7), partial=()))
    order = uids(buf.take(10, current_version=3))
    assert order == ["complete", "one_unfinished_short", "one_unfinished_long", "no_finished_staler",
                     "no_finished", "two_unfinished"]


def test_fifo_priority_uses_created_version_then_arrival():
    buf = PartialBuffer(priority="fifo")
    buf.put(make_group("late", created_version=2, partial=((2, 1),)))
    buf.put(make_group("early_b", created_version=1, partial=((2, 1),)))
    buf.put(make_group("early_c", created_version=1, finished_lengths=(3,), partial=()))
    buf.put(make_group("earliest", created_version=0, partial=((2, 9),)))
    assert uids(buf.take(2, current_version=2)) == ["earliest", "early_b"]
    assert uids(buf.take(5, current_version=2)) == ["early_c", "late"]
    assert len(buf) == 0


def test_stalest_priority_takes_highest_staleness_first():
    buf = PartialBuffer(priority="stalest")
    buf.put(make_group("lag1", partial=((4, 2),)))
    buf.put(make_group("lag3", partial=((5, 1), (2, 2))))  # the oldest token decides
    buf.put(make_group("lag0", partial=((5, 2),)))
    buf.put(make_group("lag3_later", partial=((2, 2),)))
    assert uids(buf.take(4, current_version=5)) == ["lag3", "lag3_later", "lag1", "lag0"]


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="priority"):
        PartialBuffer(priority="lifo")
    with pytest.raises(ValueError, match="stale_action"):
        PartialBuffer(stale_action="ignore")
    with pytest.raises(ValueError, match="max_staleness"):
        PartialBuffer(max_staleness=-1)


def test_staleness_restart_resets_group_and_counts_tokens():
    buf = PartialBuffer(max_staleness=2, stale_action="restart")
    old = make_group("old", finished_lengths=(4,), partial=((1, 3),), created_version=1)
    old.trajectories[0].reward = 1.0
    buf.put(old)
    buf.put(make_group("fresh_enough", partial=((3, 5),), created_version=3))
    taken = {g.uid: g for g in buf.take(10, current_version=5)}  # old lags 4, fresh lags 2
    restarted = taken["old"]
    assert restarted.restarts == 1
    for t in restarted.trajectories:
        assert t.response_ids == [] and t.logprobs == [] and t.version_runs.plain() == []
        assert t.status is TrajectoryStatus.PENDING and t.reward is None
        assert t.num_calls >= 0
    # rids stay unique after a restart: the call counter is not rewound
    assert restarted.trajectories[1].num_calls == 1
    assert taken["fresh_enough"].trajectories[0].response_length == 5
    assert buf.restarted_groups == 1 and buf.restarted_tokens == 7
    assert buf.dropped_groups == 0 and buf.discarded_tokens == 7


def test_staleness_drop_removes_and_counts():
    buf = PartialBuffer(max_staleness=1, stale_action="drop")
    buf.put(make_group("stale", finished_lengths=(6,), partial=((0, 2),)))
    buf.put(make_group("ok", partial=((2, 5),)))
    buf.put(make_group("untouched", partial=(), n_pending=2))  # no tokens: staleness 0
    taken = buf.take(10, current_version=2)
    assert sorted(uids(taken)) == ["ok", "untouched"]
    assert buf.dropped_groups == 1 and buf.dropped_trajectories == 2 and buf.dropped_tokens == 8
    assert buf.restarted_groups == 0 and buf.discarded_tokens == 8


def test_completed_surplus_groups_count_for_staleness():
    buf = PartialBuffer(max_staleness=0, stale_action="drop")
    buf.put(make_group("surplus", finished_lengths=(3, 3), partial=(), created_version=0))
    assert buf.take(1, current_version=1) == []
    assert buf.dropped_groups == 1


def test_take_never_duplicates_and_put_refuses_duplicates():
    buf = PartialBuffer()
    groups = [make_group(f"g{i}", partial=((0, i + 1),)) for i in range(7)]
    for g in groups:
        buf.put(g)
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.put(groups[0])
    seen = []
    for n in (3, 0, 2, 5, 1):
        seen += uids(buf.take(n, current_version=0))
    assert sorted(seen) == sorted(uids(groups)) and len(seen) == len(set(seen))
    assert len(buf) == 0
    buf.put(groups[3])  # a taken group may come back
    assert uids(buf.take(1, 0)) == ["g3"]


def test_put_refuses_running_or_misaligned_trajectories():
    buf = PartialBuffer()
    g = make_group("running")
    g.trajectories[0].status = TrajectoryStatus.RUNNING
    with pytest.raises(ValueError, match="still running"):
        buf.put(g)
    g = make_group("bad")
    g.trajectories[0].logprobs = g.trajectories[0].logprobs[:-1]
    with pytest.raises(ValueError, match="do not match"):
        buf.put(g)
    assert len(buf) == 0


# ------------------------------------------------------------------ persistence: the data source's checkpoint
class Prompts:
    """slime's data source as the checkpoint sees it: a prompt position, ``save`` and ``load``."""

    def __init__(self):
        self.sample_offset = self.epoch_id = self.sample_group_index = self.sample_index = 0
        self.metadata = {}

    def save(self, rollout_id):
        pass

    def load(self, rollout_id):
        pass


def checkpoints(tmp_path, buffer, prompts=None):
    """The checkpoints of a data source saving to and loading from ``tmp_path / "ckpt"``."""
    folder = str(tmp_path / "ckpt")
    return checkpoint.Checkpoints(prompts or Prompts(), buffer, save_dir=folder, load_dir=folder, buffer_dir=None,
                                  rollout_shuffle=False)


def test_checkpoint_round_trip(tmp_path):
    buf = PartialBuffer(priority="fifo", max_staleness=5, stale_action="drop")
    g1 = make_group("a", finished_lengths=(3,), partial=((0, 2),), payload={"label": "42", "idx": 7})
    g1.trajectories[1].append([9, 8, 7], [-0.1, -1.5e-8, -3.25], 2)  # second stage, new version
    g1.trajectories[0].reward = 0.5
    g2 = make_group("b", partial=(), n_pending=3, created_version=1)
    g2.restarts = 2
    buf.put(g1)
    buf.put(g2)
    buf.restarted_groups, buf.restarted_tokens, buf.dropped_groups = 4, 40, 1
    checkpoints(tmp_path, buf).save(0, policy_version=2)
    folder = tmp_path / "ckpt" / "rollout"
    assert [p.name for p in folder.iterdir()] == ["april_state_0.bin"]  # no temporary left behind

    loaded = PartialBuffer(priority="fifo")
    assert checkpoints(tmp_path, loaded).load(0).policy_version == 2
    assert loaded.state_dict() == buf.state_dict()
    t = loaded.groups()[0].trajectories[1]
    assert t.version_runs.plain() == [[0, 2], [2, 3]]
    assert t.logprobs == [-0.25, -0.25, -0.1, -1.5e-8, -3.25]
    assert t.status is TrajectoryStatus.ABORTED
    assert loaded.groups()[0].payload == {"label": "42", "idx": 7}
    assert loaded.groups()[0].trajectories[0].reward == 0.5
    assert loaded.groups()[1].restarts == 2
    assert loaded.counters() == buf.counters()
    # the original objects and the loaded ones are independent
    assert [g.to_dict() for g in loaded.take(5, 1)] == [g.to_dict() for g in buf.take(5, 1)]


def test_checkpoint_save_is_atomic_and_refuses_non_json_payload(tmp_path):
    buf = PartialBuffer()
    buf.put(make_group("a"))
    saver = checkpoints(tmp_path, buf)
    saver.save(0, policy_version=None)
    folder = tmp_path / "ckpt" / "rollout"
    before = (folder / "april_state_0.bin").read_bytes()
    buf.put(make_group("b", payload=object()))
    with pytest.raises(ValueError, match="not plain JSON"):
        saver.save(0, policy_version=None)
    assert (folder / "april_state_0.bin").read_bytes() == before
    assert os.listdir(folder) == ["april_state_0.bin"]


def test_load_state_validates_before_replacing():
    buf = PartialBuffer()
    buf.put(make_group("keep"))
    state = buf.state_dict()
    bad = json.loads(json.dumps(state))
    bad["groups"].append(bad["groups"][0])
    with pytest.raises(ValueError, match="twice"):
        buf.load_state_dict(bad)
    with pytest.raises(ValueError, match="format"):
        buf.load_state_dict({"format": 99, "groups": []})
    assert uids(buf.groups()) == ["keep"]
    # a trajectory saved while running comes back resumable
    running = json.loads(json.dumps(state))
    running["groups"][0]["trajectories"][0]["status"] = "running"
    buf.load_state_dict(running)
    assert buf.groups()[0].trajectories[0].status is TrajectoryStatus.ABORTED


@pytest.mark.parametrize("text", ["", '{"format": 2, "buffer": {', "[]", '{"format": 2}',
                                  '{"format": 2, "prompt_state": {}, "buffer": {"format": 9, "groups": []}}'])
def test_loading_a_torn_or_wrong_checkpoint_names_it_and_keeps_the_buffer(tmp_path, text):
    path = tmp_path / "ckpt" / "rollout" / "april_state_0.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    buf = PartialBuffer()
    buf.put(make_group("kept"))
    prompts = Prompts()
    prompts.sample_group_index = 3
    with pytest.raises(StateFileError) as err:
        checkpoints(tmp_path, buf, prompts).load(0)
    assert str(err.value).startswith(f"{path}:") and "\n" not in str(err.value)
    assert uids(buf.groups()) == ["kept"]
    assert prompts.sample_group_index == 3
