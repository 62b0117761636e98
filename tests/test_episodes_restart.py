"""A restart in the middle of a multi-turn job loses and duplicates nothing.

A copris job with more episodes alive than its target runs two steps, so its buffer holds groups
with finished members and groups whose episodes are suspended (a model call pending, or a tool
running); checkpoint 1 is saved and the job dies with its episodes. A new job loads checkpoint 1
and runs three more steps. Checked:

* every group handed out is trained exactly once or still buffered;
* a member that had finished is kept as it was saved (its tokens, log-probs and versions), never
  regenerated;
* every unfinished member is reset at load (also one saved with a partial response) and restarted
  from its prompt by a new episode: all its tokens are of the new job's policies, and
  ``april/episodes/restarted`` counts exactly the unfinished members restored;
* every trained sample is a whole ``multi_turn`` sample (``check_sample``).

Runs inside slime (real where importable, else the stand-in) on emulated engines, with the toy
function ``tests.support.agent_functions.multi_turn``, as ``tests/test_episodes.py`` does.
"""

from __future__ import annotations

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from april_slime.core.types import TrajectoryStatus
from tests.support import agent_functions as af
from tests.support.agent_functions import check_sample, expand
from tests.support.slime_jobs import make_args, point_at, run_steps
from tests.support.state_files import read_plain_state, write_json_state

FUNCTION = "tests.support.agent_functions.multi_turn"
# 16 calls in flight for a target of 4 groups of 3: at the target about 9 groups are still open,
# some with finished members, so both kinds of buffered group exist at the save
SETTINGS = dict(custom_generate_function_path=FUNCTION, april_policy="copris", april_concurrency=16)
FINISHED = (TrajectoryStatus.COMPLETED.value, TrajectoryStatus.TRUNCATED.value)


@pytest.fixture
def prompts(tmp_path):
    yield af.prompts_file(tmp_path)
    af.reset()


def checked(s) -> None:
    check_sample(s, version_floor=1)


def test_a_restart_in_the_middle_of_a_run_loses_and_repeats_nothing(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, **SETTINGS), cluster)
    source = rollout.AprilDataSource(args)
    trained, _ = run_steps(args, source, cluster, [0, 1], versions=[1, 2], check=checked)
    source.save(1)
    rollout.shutdown()  # the job dies here (after training step 1): its live episodes with it

    # what checkpoint 1 holds, read from its file (the buffer itself may still change on the loop)
    folder = source._checkpoints.state_path(1).parent
    state = read_plain_state(folder, 1)
    members = {}  # sample index -> saved member
    for g in state["buffer"]["groups"]:
        for t in g["trajectories"]:
            members[g["payload"]["indices"][t["index_in_group"]]] = t
    finished = {i: t for i, t in members.items() if t["status"] in FINISHED}
    unfinished = {i: t for i, t in members.items() if t["status"] not in FINISHED}
    assert finished, "no buffered group had a finished member at the save; the test needs one"
    assert unfinished, "no episode was suspended at the save; the test needs one"
    assert all(t["episode_sample"] is not None for t in finished.values())
    # one unfinished member as a run of the same job without its generate function saves it (a
    # partial response): a new episode must not start from it
    stale = unfinished[min(unfinished)]
    stale.update(response_ids=[5, 6], logprobs=[-0.5, -0.5], version_runs=[[1, 2]], status="aborted",
                 finish_reason="abort", loss_mask=[1, 1])
    write_json_state(folder, 1, state)  # as an earlier version wrote it: that form loads as well

    restarted = point_at(make_args(tmp_path, prompts, load=args.save, **SETTINGS), cluster)
    source2 = rollout.AprilDataSource(restarted)
    source2.load(1)
    assert source2.restored_policy_version == 2
    restored_uids = set()
    for g in source2.buffer.groups():
        for t in g.unfinished():
            assert t.status is TrajectoryStatus.PENDING
            assert (t.response_ids, t.logprobs, t.version_runs.plain()) == ([], [], [])
            assert t.loss_mask is None and t.episode_sample is None and t.reward is None
            restored_uids.add(t.uid)
    assert source2.restored_episodes == restored_uids and len(restored_uids) == len(unfinished)

    # the restarted trainer counts its weight updates from 1 again; the job's numbering goes on at 3
    more, totals = run_steps(restarted, source2, cluster, [2, 3, 4], versions=[1, 2, 3], check=checked)
    assert not set(trained) & set(more), "a sample was trained in both jobs"
    trained.update(more)
    first_new = 3

    # nothing lost, nothing trained twice
    trained_groups = {s.group_index for s in trained.values()}
    buffered = {int(g.uid) for g in source2.buffer.groups()}
    assert not trained_groups & buffered, "a trained group is still buffered"
    assert set(range(source2._prompts.sample_group_index)) == trained_groups | buffered, "a group was lost"
    assert totals["april/episodes/failed_groups"] == 0 and totals["april/stale_restarted_groups"] == 0

    # finished members kept as saved
    kept = 0
    buffered_members = {g.payload["indices"][t.index_in_group]: t for g in source2.buffer.groups()
                        for t in g.trajectories}
    for index, saved in finished.items():
        if index in more:
            s = more[index]
            assert s.tokens == saved["episode_sample"]["tokens"], f"sample {index} was regenerated"
            assert s.rollout_log_probs == saved["logprobs"]
            assert s.train_metadata[TOKEN_VERSIONS_KEY] == saved["version_runs"]
            kept += 1
        else:
            assert buffered_members[index].response_ids == saved["response_ids"]
    assert kept > 0, "no kept member was trained after the restart"

    # unfinished members restarted from their prompts, each counted once
    for index in unfinished:
        if index in more:
            assert min(expand(more[index].train_metadata[TOKEN_VERSIONS_KEY])) >= first_new, (
                f"sample {index} kept tokens of the job that died")
    runner = rollout._RUNTIME.episodes
    assert runner.restored == set(), "a restored member was never opened in three steps"
    assert totals["april/episodes/restarted"] == len(unfinished) > 0
    assert any(index in more for index in unfinished), "no restarted member was trained"
