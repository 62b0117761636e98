"""Checkpoints and settings against real slime's code (``RolloutDataSource``, its torch-saved state
file, its argument parser): restarts under train.py's and train_async.py's orders, real SIGKILLs
mid-save (on synthetic steps, and on rollouts from the real engines: mid-save and mid-rollout),
shuffled epochs, and the custom-YAML key check against slime's own argument names."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real

try:
    importlib.import_module("slime.rollout.data_source")
except ImportError as e:  # one line, as the real tier reports what it could not run
    pytest.skip(f"real slime is not importable ({e})", allow_module_level=True)

from april_slime import rollout  # noqa: E402
from april_slime.core.config import AprilConfigError  # noqa: E402
from april_slime.settings import check_keys  # noqa: E402
from tests.support import child_process_kwargs, slime_standin  # noqa: E402
from tests.support.save_kill import kill_and_restart  # noqa: E402
from tests.support.slime_jobs import make_args, restart_from_n_loses_and_repeats_nothing  # noqa: E402


@pytest.fixture
def slime_mode(monkeypatch):
    assert slime_standin.install(monkeypatch) == "real"
    slime_standin.patch_real_tokenizer(monkeypatch)
    yield "real"
    rollout.shutdown()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i:03d}", "label": str(i)}) + "\n" for i in range(40)))
    return path


@pytest.mark.parametrize("loop", ["train", "train_async"])
def test_a_restart_from_n_loses_and_repeats_nothing_on_real_slime(cluster, tmp_path, prompts, loop):
    restart_from_n_loses_and_repeats_nothing(cluster, tmp_path, prompts, loop)


def test_snapshot_across_a_shuffled_epoch_restores_slimes_order(slime_mode, tmp_path, prompts):
    """train_async order across an epoch boundary with --rollout-shuffle: the restarted job hands out
    the prompts the first job's rollout N+1 had taken, in the same shuffled order."""
    args = make_args(tmp_path, prompts, rollout_shuffle=True)
    source = rollout.AprilDataSource(args)
    source.next_groups(36, 1)
    source.snapshot(0)
    taken_by_1 = [g.payload["prompt_sample"]["prompt"] for g in source.next_groups(8, 1)]  # wraps the epoch
    source.snapshot(1)
    source.save(0)
    assert source._prompts.epoch_id == 1
    torch = importlib.import_module("torch")
    slime_file = torch.load(tmp_path / "ckpt" / "rollout" / "global_dataset_state_dict_0.pt")
    assert (slime_file["sample_offset"], slime_file["epoch_id"]) == (36, 0)

    restarted = rollout.AprilDataSource(make_args(tmp_path, prompts, rollout_shuffle=True, load=args.save))
    restarted.next_groups(3, 1)  # the fresh process's dataset is in epoch 0's order already
    restarted.load(0)
    again = [g.payload["prompt_sample"]["prompt"] for g in restarted.next_groups(8, 1)]
    assert again == taken_by_1


@pytest.mark.parametrize("point", ["tmp_synced"])  # "renamed" and later: the restart tests above
def test_sigkill_mid_save_on_real_slime(tmp_path, point):
    prompts = tmp_path / "prompts.jsonl"
    # few enough prompts that the restarted run wraps into a shuffled second epoch
    prompts.write_text("".join(json.dumps({"prompt": f"P{i:03d}"}) + "\n" for i in range(14)))
    kill_and_restart(tmp_path, str(prompts), "train_async", point, slime="real", shuffle=True)


# ------------------------------------------------------------------ kills on the real engines
KILL_SAVE = 1  # checkpoint 0 completes; the kill hits checkpoint 1's save, or rollout 2 before it


@pytest.mark.parametrize("kill,point", [("save", "tmp_synced"), ("step", None)], ids=["mid-save", "mid-rollout"])
def test_sigkill_on_real_engines_then_restart_loses_and_repeats_nothing(real_stack, tmp_path, kill, point):
    """A job's rollout side (slime's RolloutManager methods, the plugin's april policy, the real
    engines) runs in its own process in train_async.py's order (rollout k + 1 generated before
    checkpoint k is saved) and is SIGKILLed: in the middle of checkpoint 1's data-source save
    (after its temporary file is synced, before the rename), or in the middle of rollout 2 (at its
    first reward, with requests on the engines). Either way checkpoint 1 is incomplete: a restart
    asking for it is refused naming the file, and the job resumes from checkpoint 0, the last
    complete one. Ledger across the restart: every prompt group is delivered to the trainer
    exactly once or is still buffered, none is lost, and the restored buffer is checkpoint 0's."""
    from april_slime.core import checkpoint
    from april_slime.core.jsonfile import StateFileError
    from tests.support.real_tier import SlimeRolloutManager, plugin_args

    job = tmp_path / "job"
    # april with over-sampling: every rollout leaves aborted groups in the buffer, so the
    # checkpoint holds partials and the restart must resume them, not re-take their prompts
    job_args = {"settings": {"april_policy": "april", "april_over_sampling_factor": 2.0}, "batch": 2, "n": 2,
                "max_len": 24, "prompts": 64}
    cfg = {"router_url": real_stack.router_url, "engine_urls": real_stack.engine_urls,
           "model_path": str(real_stack.model_path), "job_dir": str(job), "kill": kill, "point": point,
           "kill_save": KILL_SAVE, "plugin_args": {**job_args, "extra_argv": ["--custom-rm-path", "__main__.reward"]}}
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.support.restart_worker", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=300,
                              **child_process_kwargs(drop_env=(checkpoint.KILL_AT_ENV,)))
    finally:
        real_stack.wait_idle()  # the killed process's requests end on the engines (or were aborted)
    first = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == -9, f"the worker was not killed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert not any(e["kind"] == "finished" for e in first)
    steps = {e["step"]: e for e in first if e["kind"] == "step"}
    # where the kill landed: after rollout 2 (mid-save of checkpoint 1), inside it (mid-rollout)
    assert sorted(steps) == ([0, 1, 2] if kill == "save" else [0, 1])
    folder = job / "ckpt" / "rollout"
    assert (folder / "april_state_0.bin").exists() and not (folder / "april_state_1.bin").exists()
    if kill == "save":
        assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")], "the save was not killed mid-write"

    # the restart, here: a new job --load-ing the checkpoint folder (the trainer's half says 1)
    (job / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(KILL_SAVE + 1))
    second = SlimeRolloutManager(plugin_args(real_stack, job, load=str(job / "ckpt"), **job_args))
    with pytest.raises(StateFileError) as refused:
        second.load(KILL_SAVE)
    message = str(refused.value)
    assert message.startswith(str(folder / f"april_state_{KILL_SAVE}.bin")) and "\n" not in message
    assert f"checkpoint {KILL_SAVE - 1}" in message, message
    second.load(KILL_SAVE - 1)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")], "a killed save's .tmp file was left"
    restored = json.loads(json.dumps(second.data_source.buffer.state_dict()))
    assert restored == steps[0]["buffer"], "the restored buffer is not checkpoint 0's"
    assert steps[0]["buffered"], "checkpoint 0 holds no buffered group: the restart checks nothing"
    taken_by_killed = {g for e in first if e["kind"] == "step" for g in e["trained"] + e["buffered"]}
    trained_after = []
    try:
        # rollouts 1 and 2 again, and more (at most 8 in all) until the restarted job has taken every
        # prompt the killed one had: when the restored partials complete the batch at once, a rollout
        # takes no fresh prompt, and how many do depends on how fast the engines finish them
        for rollout_id in range(1, 9):
            samples, _, _ = second.generate(rollout_id)
            trained_after += sorted({s.group_index for s in samples})
            second.save(rollout_id)
            if rollout_id >= 2 and second.data_source._prompts.sample_group_index > max(taken_by_killed):
                break
    finally:
        rollout.shutdown()
        real_stack.wait_idle()
    end_buffered = {g.payload["group_index"] for g in second.data_source.buffer.groups()}
    pointer = second.data_source._prompts.sample_group_index

    # the model of checkpoint 0 trained rollout 0 of the first job; then the restarted job's rollouts
    trained = steps[0]["trained"] + trained_after
    assert len(trained) == len(set(trained)), f"a group was trained twice: {trained}"
    assert not set(trained) & end_buffered, "a trained group is still buffered"
    assert set(trained) | end_buffered == set(range(pointer)), "a prompt group was lost"
    lost = taken_by_killed - set(range(pointer))
    assert not lost, f"groups the killed job had taken were never handed out again: {lost}"
    # what the killed job delivered after checkpoint 0 was lost with it, and delivered again
    redone = {g for k, e in steps.items() if k > 0 for g in e["trained"]}
    assert redone and redone <= set(trained) | end_buffered


def test_no_slime_argument_is_taken_for_a_misspelled_setting():
    """Keys of the custom YAML that are slime's own arguments override them (slime's documented
    use); none may be mistaken for a near miss of a plugin setting."""
    arguments = importlib.import_module("slime.utils.arguments")
    parser = argparse.ArgumentParser()
    arguments.get_slime_extra_args_provider()(parser)
    dests = sorted({a.dest for a in parser._actions} - {"help"})
    assert len(dests) > 100
    refused = []
    for dest in dests:
        try:
            check_keys([], [dest])
        except AprilConfigError as e:
            refused.append(str(e))
    assert refused == []
