"""Real SIGKILLs at a point of a data-source save, then a restart and a ledger check: the scenario
``tests/test_save_kill.py`` runs on the slime stand-in and ``tests/real/test_checkpoint_real.py`` on
real slime's data source. Each process is ``tests.support.save_kill_worker``."""

from __future__ import annotations

import json
import subprocess
import sys

from april_slime.core import checkpoint
from tests.support import child_process_kwargs

KILLED_SAVE = 2  # checkpoint whose save is killed; checkpoints 0 and 1 complete before it


def _run(cfg: dict) -> tuple[int, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "tests.support.save_kill_worker", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=120,
                          **child_process_kwargs(drop_env=(checkpoint.KILL_AT_ENV,)))
    if proc.returncode not in (0, -9):
        raise AssertionError(f"worker failed ({proc.returncode}):\n{proc.stderr}")
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def kill_and_restart(tmp_path, prompts, loop, point, slime="standin", shuffle=False, replay=False) -> None:
    """Kill save KILLED_SAVE at ``point`` under ``loop``'s order (slime's ``train.py``: generate N,
    save N; ``train_async.py``: generate N+1 before save N), restart from checkpoint KILLED_SAVE (or,
    refused by name when its state was not committed, from the one before), and check the ledger:
    every group handed out is trained exactly once or still buffered, and the restored buffer is
    exactly the checkpoint's (with ``replay``: the partials' routed experts and top-p kept ids too)."""
    cfg = {"prompts": prompts, "ckpt": str(tmp_path / "ckpt"), "loop": loop, "point": point,
           "kill_save": KILLED_SAVE, "restart": False, "shuffle": shuffle, "slime": slime, "replay": replay}
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
        assert message.startswith(str(tmp_path / "ckpt" / "rollout" / f"april_state_{KILLED_SAVE}.bin"))
        assert "\n" not in message and f"checkpoint {KILLED_SAVE - 1}" in message
    else:
        assert not refused
    assert not [f for f in restored["files"] if f.endswith(".tmp")], "a killed save's .tmp file was left"
    saved = next(e["buffer"] for e in first if e["kind"] == "state" and e["step"] == restored["step"])
    assert restored["buffer"] == saved, "the restored buffer differs from the checkpoint's"
    partials = [t for g in saved["groups"] for t in g["trajectories"] if t["response_ids"]]
    assert partials and all((t["replay"] is not None) == replay for t in partials)

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
