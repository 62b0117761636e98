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
from pathlib import Path

import pytest

from april_slime.core import checkpoint
from tests.support.save_kill import kill_and_restart


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"P{i:03d}"}) + "\n" for i in range(200)))
    return str(path)


@pytest.mark.parametrize("loop", ["train", "train_async"])
@pytest.mark.parametrize("point", checkpoint.SAVE_POINTS)
def test_sigkill_at_every_point_of_a_save_loses_and_repeats_nothing(tmp_path, prompts, loop, point):
    kill_and_restart(tmp_path, prompts, loop, point)


@pytest.mark.parametrize("point", ["tmp_partial", "renamed"])
def test_a_kill_keeps_the_routed_experts_and_top_p_ids_of_every_partial(tmp_path, prompts, point):
    kill_and_restart(tmp_path, prompts, "train_async", point, replay=True)


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
    from april_slime import rollout
    from april_slime.core.jsonfile import StateFileError
    from tests.support import slime_standin

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
    assert ("april_state_1.bin" in left) == (point in ("renamed", "end"))
    monkeypatch.setattr(checkpoint, "SAVE_POINT_HOOK", None)
    restarted = rollout.AprilDataSource(args)
    if point in ("renamed", "end"):
        restarted.load(1)
        assert restarted._prompts.sample_group_index == 4
    else:
        with pytest.raises(StateFileError, match="april_state_1.bin: missing"):
            restarted.load(1)
        restarted.load(0)
        assert restarted._prompts.sample_group_index == 2
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
