"""Real SIGKILLs at every point of a data-source save, then a restart and a ledger check.

A worker process (on the slime stand-in here, on real slime's data source in
``tests/real/test_checkpoint_real.py``) runs rollout steps on ``AprilDataSource`` (prompts from slime's data source, the
stand-in here; partial groups into the buffer) under slime's ``train.py`` order (generate N, save N)
or ``train_async.py`` order (generate N+1 before save N), and is killed with SIGKILL at one named
point of save K (``APRIL_SLIME_SAVE_KILL_AT``, see ``april_slime.core.checkpoint``). A second process
restarts from checkpoint K, or, when that checkpoint's state was not committed, is refused with one
line naming the file and restarts from K-1, as the message says. The ledger then checks that every
group handed out is trained exactly once or still buffered, and that the restored buffer is exactly
the one of the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_slime.core import checkpoint

TESTS = Path(__file__).resolve().parent
KILLED_SAVE = 2  # checkpoint whose save is killed; checkpoints 0 and 1 complete before it

WORKER = r"""
import json, os, sys
from types import SimpleNamespace

sys.path.insert(0, os.environ["TESTS_DIR"])
import slime_standin


class _Patch:  # the monkeypatch slime_standin expects, in a process that never undoes it
    def setitem(self, mapping, key, value):
        mapping[key] = value

    def setattr(self, target, name, value, raising=True):
        setattr(target, name, value)


cfg = json.loads(sys.argv[1])
if slime_standin.install(_Patch(), force=cfg["slime"] == "standin") == "real":
    slime_standin.patch_real_tokenizer(_Patch())
from april_slime.core import checkpoint
from april_slime import rollout
from april_slime.core.types import TrajectoryStatus

args = SimpleNamespace(
    prompt_data=cfg["prompts"], input_key="prompt", label_key=None, rollout_global_dataset=True,
    metadata_key="metadata", tool_key=None, multimodal_keys=None, apply_chat_template=False,
    apply_chat_template_kwargs={}, rollout_max_prompt_len=None, dump_details=None, buffer_filter_path=None,
    hf_checkpoint="toy", rollout_seed=1, rollout_shuffle=cfg["shuffle"], n_samples_per_prompt=2,
    rollout_batch_size=3, over_sampling_batch_size=3, rollout_max_response_len=16, rollout_top_p=1.0,
    save=cfg["ckpt"], load=cfg["ckpt"] if cfg["restart"] else None, april_policy="april")
source = rollout.AprilDataSource(args)


def emit(kind, **values):
    print(json.dumps({"kind": kind, **values}), flush=True)


def step(k):
    # a rollout step: buffered groups first, then fresh prompts; three train, one goes back partial
    version = k + 1
    groups = source.buffer.take(2, version)
    groups += source.next_groups(4 - len(groups), version)
    emit("step", step=k, trained=[g.uid for g in groups[:3]], handed_out=[g.uid for g in groups])
    partial = groups[3]
    t = partial.trajectories[0]
    t.append([5 + k, 6 + k], [-0.5, -0.25], version)
    t.status, t.finish_reason = TrajectoryStatus.ABORTED, "abort"
    source.buffer.put(partial)
    source.policy_version = version
    source.snapshot(k)
    emit("state", step=k, buffer=source.buffer.state_dict())


def save(k):
    if k == cfg["kill_save"] and not cfg["restart"]:
        os.environ[checkpoint.KILL_AT_ENV] = cfg["point"]
    source.save(k)
    os.environ.pop(checkpoint.KILL_AT_ENV, None)


if not cfg["restart"]:
    if cfg["loop"] == "train":
        for k in range(cfg["kill_save"] + 1):
            step(k)
            save(k)
    else:  # train_async: generate k+1 is queued on the rollout actor before save k
        step(0)
        for k in range(cfg["kill_save"] + 1):
            step(k + 1)
            save(k)
    emit("finished")
else:
    restored = cfg["kill_save"]
    try:
        source.load(restored)
    except rollout.StateFileError as e:
        emit("refused", message=str(e))
        restored -= 1
        source.load(restored)
    folder = os.path.join(cfg["ckpt"], "rollout")
    emit("restored", step=restored, buffer=source.buffer.state_dict(), files=sorted(os.listdir(folder)))
    for k in range(restored + 1, restored + 4):
        step(k)
        save(k)
    emit("end", buffered=[g.uid for g in source.buffer.groups()],
         pointer=source._prompts.sample_group_index)
"""


def _run(cfg: dict) -> tuple[int, list[dict]]:
    env = {**os.environ, "TESTS_DIR": str(TESTS)}
    env.pop(checkpoint.KILL_AT_ENV, None)
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=120)
    if proc.returncode not in (0, -9):
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr}")
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"P{i:03d}"}) + "\n" for i in range(200)))
    return str(path)


def kill_and_restart(tmp_path, prompts, loop, point, slime="standin", shuffle=False) -> None:
    """Kill save KILLED_SAVE at ``point``, restart, and check the ledger (see the module docstring)."""
    cfg = {"prompts": prompts, "ckpt": str(tmp_path / "ckpt"), "loop": loop, "point": point,
           "kill_save": KILLED_SAVE, "restart": False, "shuffle": shuffle, "slime": slime}
    rc, first = _run(cfg)
    assert rc == -9 and not any(e["kind"] == "finished" for e in first), "the save was not killed"
    rc, second = _run({**cfg, "restart": True})
    assert rc == 0

    committed = checkpoint.SAVE_POINTS.index(point) >= checkpoint.SAVE_POINTS.index("renamed")
    restored = next(e for e in second if e["kind"] == "restored")
    refused = [e for e in second if e["kind"] == "refused"]
    # either the new complete state or, refused by name, the old complete one
    assert restored["step"] == (KILLED_SAVE if committed else KILLED_SAVE - 1)
    if not committed:
        message = refused[0]["message"]
        assert message.startswith(str(tmp_path / "ckpt" / "rollout" / f"april_state_{KILLED_SAVE}.json"))
        assert "\n" not in message and f"checkpoint {KILLED_SAVE - 1}" in message
    else:
        assert not refused
    assert not [f for f in restored["files"] if f.endswith(".tmp")], "a killed save's .tmp file was left"
    saved = next(e["buffer"] for e in first if e["kind"] == "state" and e["step"] == restored["step"])
    assert restored["buffer"] == saved, "the restored buffer differs from the checkpoint's"

    # ledger: the model of checkpoint R trained steps <= R of the first run, then the second run's
    trained = [uid for e in first if e["kind"] == "step" and e["step"] <= restored["step"]
               for uid in e["trained"]]
    trained += [uid for e in second if e["kind"] == "step" for uid in e["trained"]]
    end = next(e for e in second if e["kind"] == "end")
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & set(end["buffered"]), "a trained group is still buffered"
    handed_out = {str(i) for i in range(end["pointer"])}
    assert handed_out == set(trained) | set(end["buffered"]), "a group was lost"
    lost_by_first = {uid for e in first if e["kind"] == "step" for uid in e["handed_out"]} - handed_out
    assert not lost_by_first


@pytest.mark.parametrize("loop", ["train", "train_async"])
@pytest.mark.parametrize("point", checkpoint.SAVE_POINTS)
def test_sigkill_at_every_point_of_a_save_loses_and_repeats_nothing(tmp_path, prompts, loop, point):
    kill_and_restart(tmp_path, prompts, loop, point)


def test_the_write_fsyncs_the_file_then_the_folder_after_the_rename(tmp_path, monkeypatch):
    from april_slime.core import jsonfile

    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((target, (tmp_path / "state.json").exists()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    jsonfile.write_json_atomic(tmp_path / "state.json", {"a": 1})
    assert [p.name.endswith(".tmp") for p, _ in synced] == [True, False]
    assert synced[0][1] is False  # the temporary file, before the rename
    assert synced[1] == (tmp_path, True)  # the folder, after the rename


class SimulatedKill(BaseException):
    """Raised by a save-point hook: leaves the disk as SIGKILL there would (for in-process soaks)."""


@pytest.mark.parametrize("point", checkpoint.SAVE_POINTS)
def test_an_in_process_hook_stops_a_save_where_a_kill_would(tmp_path, monkeypatch, point):
    import slime_standin
    from april_slime import rollout

    slime_standin.install(monkeypatch, force=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"P{i}"}) + "\n" for i in range(20)))
    from types import SimpleNamespace

    args = SimpleNamespace(prompt_data=str(prompts), input_key="prompt", label_key=None, hf_checkpoint="toy",
                           n_samples_per_prompt=2, rollout_batch_size=2, rollout_max_response_len=8,
                           save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"))
    source = rollout.AprilDataSource(args)
    source.next_groups(2, 1)
    source.save(0)
    source.next_groups(2, 1)

    def hook(name):
        if name == point:
            raise SimulatedKill(name)

    monkeypatch.setattr(checkpoint, "SAVE_POINT_HOOK", hook)
    with pytest.raises(SimulatedKill):
        source.save(1)
    folder = tmp_path / "ckpt" / "rollout"
    left = sorted(p.name for p in folder.iterdir())
    assert any(n.endswith(".tmp") for n in left) == (point in ("tmp_partial", "tmp_synced"))
    assert ("april_state_1.json" in left) == (point in ("renamed", "end"))
    monkeypatch.setattr(checkpoint, "SAVE_POINT_HOOK", None)
    restarted = rollout.AprilDataSource(args)
    if point in ("renamed", "end"):
        restarted.load(1)
        assert restarted._prompts.sample_group_index == 4
    else:
        with pytest.raises(rollout.StateFileError, match="april_state_1.json: missing"):
            restarted.load(1)
        restarted.load(0)
        assert restarted._prompts.sample_group_index == 2
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
