"""The data source's checkpoint: what is saved with slime checkpoint N, when, and what a kill leaves.

What is saved. One file per checkpoint, ``april_state_<N>.bin`` (in ``april_buffer_dir``, default
``<save>/rollout/``), holds the whole data-source state: slime's prompt position (``sample_offset``,
``epoch_id``, ``sample_group_index``, ``sample_index``, ``metadata``, the fields slime's
``RolloutDataSource.save`` writes), the partial buffer (every group with its tokens, log-probs,
per-token versions and replay rows, plus the buffer's counters) and the policy version. The file
is a JSON index followed by the raw arrays (``core.state_file``): about the raw bytes of the
tokens, written from the buffer's own pieces without a copy of the state. Files of earlier
versions (the binary format 3, and ``april_state_<N>.json``, formats 1 and 2) are still read.
slime's own ``global_dataset_state_dict_<N>.pt`` is still written, with the same prompt position,
so slime's tools and slime's own data source read a consistent file.

Who carries it out. ``Checkpoints`` (one per data source) holds the snapshots and performs every
save and load in the order described here; ``AprilDataSource.snapshot`` / ``save`` / ``load``, the
calls slime and the rollout function make, delegate to it. It is the only persistence path of the
partial buffer: ``PartialBuffer`` only turns its contents into plain data and back.

Where it runs. A snapshot is taken on the rollout's event loop and shares the buffer's immutable
token columns, so it costs no copy of the tokens; a save runs in slime's call (the rollout
actor's thread, not the event loop), and the file's array bytes are written by system calls that
release the interpreter lock.

Which state. The state of checkpoint N is the state as of the end of ``generate_rollout(N)``: the
rollout function calls ``AprilDataSource.snapshot(N)`` when step N's samples are complete, and
``save(N)`` writes that snapshot, whatever ran in between. This is what makes a restart from N lose
nothing under both of slime's loops:

* ``train.py``: generate(N), train(N), save(N). Nothing touches the data source between the
  snapshot and the save, so the snapshot is the current state.
* ``train_async.py``: generate(N), then generate(N+1) is queued on the rollout actor before
  save(N), so by the time save(N) runs, step N+1 has already taken prompts and buffered groups.
  Saving the current state would skip them on a restart from N (the model of checkpoint N never
  trained on them). The snapshot of N does not contain N+1's consumption, so a restart from N
  hands out exactly what N+1 had taken again. The two latest snapshots are kept (N and N+1).

A ``save(N)`` without a snapshot of N (a rollout function other than ours, or a save right after a
restore) writes the current state.

Which file wins. On ``load(N)`` the april file wins: the prompt position is restored from it (slime's
shuffle for the epoch applied as slime's own ``load`` does), and slime's ``.pt`` is not read. Files
written by older versions of this module (format 1, no prompt position) are read with slime's
``.pt`` for the position.

Write order and what a kill leaves. ``save(N)`` passes these named points (``SAVE_POINTS``), in
this order; "refused" means ``load(N)`` stops the job naming ``april_state_N.bin`` as missing and
naming the latest complete checkpoint (N-1), whose state is untouched:

* ``begin``: stale ``.tmp`` files removed, nothing of N written. Restart from N: refused.
* ``prompt_state_written``: slime's ``.pt`` of N written and fsynced. Restart from N: refused.
* ``tmp_partial``: half of ``.april_state_N.bin.<random>.tmp`` written. Restart from N: refused.
* ``tmp_synced``: the temporary file complete and fsynced, not renamed. Restart from N: refused.
* ``renamed``: ``april_state_N.bin`` complete; the folder fsync is pending, so only a power loss
  could still undo the rename. Restart from N: loads N completely.
* ``end``: the folder fsynced. Restart from N: loads N completely.

The rename of ``april_state_N.bin`` is the commit: before it, checkpoint N's data-source state
does not exist and every earlier checkpoint is untouched (each N has its own files); after it, the
whole state of N exists. A re-save of the same N replaces the file atomically (the old complete
state until the rename; slime's ``.pt``, rewritten first and not atomically, is never read while
the april file exists). slime saves the model before the data source, so a kill before the
rename leaves a model checkpoint N without its data-source state: ``load(N)`` then stops the job
with one line naming the missing file and the latest complete checkpoint in the folder (resume
from that one, e.g. with ``--ckpt-step``), never an empty buffer or a rewound prompt position.
A torn, truncated or otherwise corrupt state file raises ``StateFileError`` naming the file. The
temporary files of killed saves are removed by the next ``save`` or ``load`` in that folder.

Fault injection. ``SAVE_POINT_HOOK`` (a callable taking the point name, or None) is called at every
point; a hook that raises an exception deriving from ``BaseException`` but not ``Exception`` leaves
the disk exactly as a kill there does (the temporary file is not cleaned up). With the environment
variable ``APRIL_SLIME_SAVE_KILL_AT=<point>`` the process sends itself SIGKILL at that point: a real
kill -9 mid-save, for subprocess tests: ``tests/test_save_kill.py`` (``kill_and_restart`` in
``tests/support/save_kill.py`` runs a worker in either loop order, kills save 2 at a given point,
restarts, and checks a ledger).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import re
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from april_slime.core import state_file
from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfigError
from april_slime.core.jsonfile import (
    StateFileError,
    fsync_dir,
    fsync_file,
    read_json,
    remove_stale_tmp,
    write_blocks_atomic,
)

logger = logging.getLogger(__name__)

STATE_FORMAT = 4  # 4: binary, columnar index (core.state_file); 3: binary; 1 and 2: JSON; all still read
READABLE_FORMATS = (1, 2, 3, 4)
STATE_FILE = "april_state_{rollout_id}.bin"
JSON_STATE_FILE = "april_state_{rollout_id}.json"  # written by earlier versions; read, never written
SLIME_STATE_FILE = "global_dataset_state_dict_{rollout_id}.pt"
_STATE_FILE_RE = re.compile(r"^april_state_(\d+)\.(bin|json)$")

SAVE_POINTS = ("begin", "prompt_state_written", "tmp_partial", "tmp_synced", "renamed", "end")
KILL_AT_ENV = "APRIL_SLIME_SAVE_KILL_AT"
SAVE_POINT_HOOK: Callable[[str], None] | None = None

# The fields slime's RolloutDataSource.save / load carry, at the pinned commit.
PROMPT_STATE_KEYS = ("sample_offset", "epoch_id", "sample_group_index", "sample_index", "metadata")


def at_save_point(name: str) -> None:
    if name not in SAVE_POINTS:
        raise ValueError(f"unknown save point {name!r}; known: {', '.join(SAVE_POINTS)}")
    if SAVE_POINT_HOOK is not None:
        SAVE_POINT_HOOK(name)
    if os.environ.get(KILL_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------- slime's prompt position
def prompt_state(prompts: Any) -> dict[str, Any]:
    """slime's prompt position, as plain JSON values."""
    state = {key: getattr(prompts, key) for key in PROMPT_STATE_KEYS if hasattr(prompts, key)}
    return json.loads(json.dumps(state, default=_plain_default, allow_nan=False))


def _plain_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"slime data-source state of type {type(obj).__name__} is not plain JSON")


@contextlib.contextmanager
def prompt_state_as(prompts: Any, state: dict[str, Any]) -> Iterator[None]:
    """slime's data source shows ``state`` for the duration (so its ``save`` writes it), then its
    own position again."""
    current = {key: getattr(prompts, key) for key in state}
    for key, value in state.items():
        setattr(prompts, key, value)
    try:
        yield
    finally:
        for key, value in current.items():
            setattr(prompts, key, value)


def restore_prompt_state(prompts: Any, state: dict[str, Any], shuffle: bool) -> None:
    """What slime's ``RolloutDataSource.load`` does with its file, from our file's copy."""
    for key in PROMPT_STATE_KEYS:
        if key in state:
            setattr(prompts, key, state[key])
    dataset = getattr(prompts, "dataset", None)
    if shuffle and dataset is not None:
        dataset.shuffle(prompts.epoch_id)


# ---------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class Snapshot:
    """The data-source state as of the end of one rollout, ready to be written.

    It shares the buffer's token columns and replay pieces (``core.columns``: immutable, so what
    the buffer does later leaves the snapshot as it was); only the small per-trajectory fields and
    the groups' payloads are copied. Taking one costs microseconds per trajectory, whatever the
    number of tokens, and serializing happens only in a save.
    """

    rollout_id: int
    prompt_state: dict[str, Any]
    state: dict[str, Any]

    @classmethod
    def take(cls, rollout_id: int, prompts: Any, buffer_state: dict[str, Any],
             policy_version: int | None) -> Snapshot:
        """``buffer_state`` must be a fresh ``PartialBuffer.state_dict(shared=True)`` (or plain);
        the payloads and counters it shares with the live buffer are copied here."""
        position = prompt_state(prompts)
        buffer_state = {**buffer_state, "counters": dict(buffer_state.get("counters", {})),
                        "groups": [{**g, "payload": copy.deepcopy(g.get("payload"))}
                                   for g in buffer_state["groups"]]}
        state = {"format": STATE_FORMAT, "rollout_id": rollout_id, "policy_version": policy_version,
                 "prompt_state": position, "buffer": buffer_state}
        return cls(rollout_id, position, state)

    @property
    def policy_version(self) -> int | None:
        return self.state["policy_version"]

    def blocks(self) -> tuple[Iterator[Any], int]:
        """The state file's bytes, block by block, and its size (``core.state_file``)."""
        return state_file.encode(self.state)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector paused for the duration. A restore builds tens of thousands of
    objects (the trajectories, their columns, the snapshot of them), every one of them kept: the
    collections their allocation triggers would examine them for nothing, and took a third of a
    30 M-token load. Reference counting still frees what dies meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---------------------------------------------------------------------------- files
def state_path_in(folder: Path, rollout_id: int) -> Path:
    """Where checkpoint ``rollout_id``'s state is written."""
    return folder / STATE_FILE.format(rollout_id=rollout_id)


def existing_state_file(folder: Path, rollout_id: int) -> Path | None:
    """The state file of checkpoint ``rollout_id`` in ``folder``: binary, else an earlier
    version's JSON; None when neither exists."""
    for name in (STATE_FILE, JSON_STATE_FILE):
        path = folder / name.format(rollout_id=rollout_id)
        if path.exists():
            return path
    return None


def read_state(path: Path, rollout_id: int) -> dict[str, Any]:
    """The checked state of a state file of either form; errors name the file."""
    value = state_file.decode(path) if state_file.is_binary(path) else read_json(path)
    return parse_state(path, value, rollout_id)


def remove_stale_tmp_files(folder: Path) -> list[Path]:
    return remove_stale_tmp(folder, "april_state_*")


def complete_checkpoints(folder: Path) -> list[int]:
    """Rollout ids with a committed state file in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    ids = (_STATE_FILE_RE.match(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in ids if m)


def sync_slime_state(folder: Path, rollout_id: int) -> None:
    """slime writes its ``.pt`` with a plain ``torch.save``; flush it before the commit."""
    path = folder / SLIME_STATE_FILE.format(rollout_id=rollout_id)
    if path.exists():
        fsync_file(path)
        fsync_dir(folder)


def missing_state_error(path: Path, rollout_id: int, slime_folder: Path | None) -> StateFileError:
    slime_file = slime_folder / SLIME_STATE_FILE.format(rollout_id=rollout_id) if slime_folder else None
    if slime_file is not None and slime_file.exists():
        why = f"slime's {slime_file.name} of checkpoint {rollout_id} exists, so its save was cut off"
    else:
        why = f"checkpoint {rollout_id} has no data-source state (its save was cut off or the file removed)"
    earlier = [i for i in complete_checkpoints(path.parent) if i < rollout_id]
    hint = (f"latest complete state there is checkpoint {earlier[-1]}: resume from it (e.g. --ckpt-step "
            f"{earlier[-1]})" if earlier else "no earlier complete state there")
    return StateFileError(f"{path}: missing; {why}; the partial buffer and prompt position of that "
                          f"checkpoint are unknown, so the job stops rather than lose or repeat groups; {hint}")


def parse_state(path: Path, value: Any, rollout_id: int) -> dict[str, Any]:
    """Check the shape of a state file's JSON; errors name the file."""
    if not isinstance(value, dict):
        raise StateFileError(f"{path}: not a data-source state (a JSON {type(value).__name__})")
    fmt = value.get("format")
    if fmt not in READABLE_FORMATS:
        raise StateFileError(f"{path}: state format {fmt!r}, expected one of {READABLE_FORMATS}")
    if value.get("rollout_id", rollout_id) != rollout_id:
        raise StateFileError(f"{path}: holds rollout {value.get('rollout_id')!r}, expected {rollout_id}")
    if not isinstance(value.get("buffer"), dict):
        raise StateFileError(f"{path}: no buffer state")
    if fmt >= 2 and not isinstance(value.get("prompt_state"), dict):
        raise StateFileError(f"{path}: no prompt position")
    version = value.get("policy_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise StateFileError(f"{path}: policy_version must be an integer or null, got {version!r}")
    return value


# ---------------------------------------------------------------------------- the save and load order
class Checkpoints:
    """The checkpoints of one data source: the snapshots of its latest rollouts, and ``save`` /
    ``load`` in the order of the module docstring.

    ``prompts`` is slime's ``RolloutDataSource`` (its position attributes, ``save`` and ``load``),
    ``buffer`` the data source's partial buffer. The folders come from ``buffer_dir`` (the
    ``april_buffer_dir`` setting) or else slime's ``--save`` / ``--load`` (``save_dir`` / ``load_dir``),
    each with ``rollout/`` appended; ``rollout_shuffle`` is slime's, which the prompt position replays.
    """

    def __init__(self, prompts: Any, buffer: PartialBuffer, *, save_dir: str | None, load_dir: str | None,
                 buffer_dir: str | None, rollout_shuffle: bool) -> None:
        self.prompts = prompts
        self.buffer = buffer
        self.save_dir = save_dir
        self.load_dir = load_dir
        self.buffer_dir = buffer_dir
        self.rollout_shuffle = rollout_shuffle
        # rollout id -> state at the end of that rollout (the two latest)
        self._snapshots: dict[int, Snapshot] = {}

    def _state_dir(self, base: str | None) -> Path | None:
        if self.buffer_dir:
            return Path(self.buffer_dir)
        return Path(base) / "rollout" if base else None

    def state_path(self, rollout_id: int, *, for_load: bool = False) -> Path | None:
        """Where checkpoint ``rollout_id`` is saved; for a load, the file that exists there (an
        earlier version's JSON included), else the binary file's name."""
        folder = self._state_dir(self.load_dir if for_load else self.save_dir)
        if folder is None:
            return None
        return (for_load and existing_state_file(folder, rollout_id)) or state_path_in(folder, rollout_id)

    def _take(self, rollout_id: int, policy_version: int | None) -> Snapshot:
        return Snapshot.take(rollout_id, self.prompts, self.buffer.state_dict(shared=True), policy_version)

    def snapshot(self, rollout_id: int, policy_version: int | None) -> None:
        """Record the state as of the end of rollout ``rollout_id``; ``save(rollout_id)`` writes it
        even when a later rollout has run in between (slime's train_async.py)."""
        self._snapshots[rollout_id] = self._take(rollout_id, policy_version)
        for old in sorted(self._snapshots)[:-2]:
            del self._snapshots[old]

    def save(self, rollout_id: int, policy_version: int | None) -> None:
        """Write checkpoint ``rollout_id``: its snapshot, else the current state (with
        ``policy_version``), through the named save points."""
        path = self.state_path(rollout_id)
        if path is None:
            raise AprilConfigError("april_buffer_dir: unset and slime's --save is unset; the partial "
                                   "buffer has nowhere to be saved")
        snapshot = self._snapshots.get(rollout_id)
        if snapshot is None:
            snapshot = self._take(rollout_id, policy_version)
        remove_stale_tmp_files(path.parent)
        at_save_point("begin")
        with prompt_state_as(self.prompts, snapshot.prompt_state):
            self.prompts.save(rollout_id)
        if self.save_dir:
            sync_slime_state(Path(self.save_dir) / "rollout", rollout_id)
        at_save_point("prompt_state_written")
        blocks, size = snapshot.blocks()
        write_blocks_atomic(path, blocks, size, at_point=at_save_point)
        older = path.with_name(JSON_STATE_FILE.format(rollout_id=rollout_id))
        with contextlib.suppress(FileNotFoundError):
            older.unlink()  # an earlier version's file of the same checkpoint: the new one wins
        at_save_point("end")
        logger.info("saved the data-source state of rollout %d (%d buffered groups, %d partial samples) "
                    "to %s", rollout_id, len(self.buffer), self.buffer.num_partial_trajectories(), path)

    def load(self, rollout_id: int | None) -> Snapshot | None:
        """Restore checkpoint ``rollout_id``: all of it, or raise ``StateFileError`` naming the file.

        Returns the snapshot of the restored state (its ``policy_version`` is the saved one), or
        None when only slime's data source was loaded: no checkpoint asked for (``rollout_id`` None
        or negative), or no folder this job could have saved to.
        """
        if rollout_id is None or rollout_id < 0:
            self.prompts.load(rollout_id)
            return None
        path = self.state_path(rollout_id, for_load=True)
        if path is None:  # no --load and no april_buffer_dir: nothing was ever saved for this job
            self.prompts.load(rollout_id)
            return None
        remove_stale_tmp_files(path.parent)
        if not path.exists():
            slime_folder = Path(self.load_dir) / "rollout" if self.load_dir else None
            raise missing_state_error(path, rollout_id, slime_folder)
        with collection_paused():
            state = read_state(path, rollout_id)
            buffer_state = state.pop("buffer")
            try:
                self.buffer.load_state_dict(buffer_state)  # validates before replacing anything
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise StateFileError(f"{path}: not a valid buffer state ({type(e).__name__}: {e})") from e
            if state["format"] >= 2:
                restore_prompt_state(self.prompts, state["prompt_state"], self.rollout_shuffle)
            else:  # written before the prompt position moved into this file
                self.prompts.load(rollout_id)
            self._snapshots = {}
            if state["format"] == STATE_FORMAT:
                # what a file of this format decodes to is what a snapshot of the restored buffer
                # holds (the same columns and replay bytes, which the buffer now shares): it is
                # that snapshot, without a second pass over thousands of trajectories
                self._snapshots[rollout_id] = Snapshot.take(rollout_id, self.prompts, buffer_state,
                                                            state.get("policy_version"))
            else:  # an earlier format: its state may be laid out otherwise (lists, int32 rows)
                self.snapshot(rollout_id, state.get("policy_version"))
            del buffer_state
        logger.info("restored %d buffered groups (%d partial samples) and the prompt position from %s",
                    len(self.buffer), self.buffer.num_partial_trajectories(), path)
        return self._snapshots[rollout_id]
