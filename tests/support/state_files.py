"""Reading a data-source checkpoint the way a test inspects it: the state file of a checkpoint
(binary or an earlier version's JSON) as plain data, arrays as lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from april_slime.core.buffer import TRAJECTORY_COLUMNS
from april_slime.core.checkpoint import existing_state_file, read_state
from april_slime.core.columns import Column


def state_path(folder: Path, rollout_id: int) -> Path:
    path = existing_state_file(Path(folder), rollout_id)
    assert path is not None, f"no state file of checkpoint {rollout_id} in {folder}: {sorted(Path(folder).iterdir())}"
    return path


def read_plain_state(folder: Path, rollout_id: int) -> dict[str, Any]:
    """Checkpoint ``rollout_id``'s state in ``folder``, every array a list (replay rows ``bytes``),
    each group holding its trajectories as dicts (``state_dict``'s form, whatever the file's)."""
    state = read_state(state_path(folder, rollout_id), rollout_id)
    columns = state["buffer"].pop(TRAJECTORY_COLUMNS, None)
    if columns is not None:
        rows = [dict(zip(columns, row)) for row in zip(*columns.values())]
        for group in state["buffer"]["groups"]:
            group["trajectories"], rows = rows[:group["trajectories"]], rows[group["trajectories"]:]
    return _plain(state)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (np.ndarray, Column)):
        return value.tolist()
    return value


def write_json_state(folder: Path, rollout_id: int, state: dict[str, Any]) -> Path:
    """Replace checkpoint ``rollout_id``'s state file by ``state`` (plain, as ``read_plain_state``
    gives it) in the JSON form earlier versions wrote (format 2, bytes as base64), which loads too."""
    import base64
    import json

    for old in Path(folder).glob(f"april_state_{rollout_id}.*"):
        old.unlink()
    path = Path(folder) / f"april_state_{rollout_id}.json"
    path.write_text(json.dumps({**state, "format": 2},
                               default=lambda b: base64.b64encode(bytes(b)).decode("ascii")))
    return path
