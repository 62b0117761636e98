"""Crash-safe JSON files, for state saved with slime checkpoints.

``write_json_atomic`` leaves either the old file or the new one at every instant of a write, also
under SIGKILL and (with the folder fsync) power loss: the text goes to a temporary file in the same
folder, which is fsynced, renamed over the target, and the folder is fsynced so that the rename
itself is durable. ``read_json`` names the file in every error, torn and corrupt files included.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Buffer = bytes | bytearray | memoryview  # and any object with the buffer protocol (numpy arrays)

TMP_SUFFIX = ".tmp"
# a state file's blocks are thousands of arrays (a few per trajectory): they are handed to the
# kernel many at a time (writev) rather than copied into a buffer first, which cost as much again
WRITE_BATCH_BYTES = 64 << 20
WRITE_BATCH_BLOCKS = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class StateFileError(ValueError):
    """A state file is missing, unreadable, truncated or not what it claims to be; the message
    starts with the file's path."""


def tmp_prefix(path: Path) -> str:
    """Temporary files of a write to ``path`` are ``.<name>.<random>.tmp`` in the same folder."""
    return f".{path.name}."


def write_json_atomic(path: str | os.PathLike, value: Any, *,
                      at_point: Callable[[str], None] | None = None) -> None:
    """Write ``value`` as JSON so that a crash leaves either the old or the new file, never a torn
    one. Raises ``ValueError`` naming the file when the value is not plain JSON (NaN included);
    nothing is written then.

    ``at_point(name)`` is called at each instant where a kill leaves a different picture on disk:
    ``tmp_partial`` (half of the temporary file written), ``tmp_synced`` (temporary file complete
    and fsynced, target untouched), ``renamed`` (target replaced, folder not yet fsynced).
    """
    path = Path(path)
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: state is not plain JSON ({e})") from e
    write_text_atomic(path, text, at_point=at_point)


def write_text_atomic(path: str | os.PathLike, text: str, *,
                      at_point: Callable[[str], None] | None = None) -> None:
    """``write_json_atomic`` for text that is already serialized."""
    data = text.encode("utf-8")
    write_blocks_atomic(path, [data], len(data), at_point=at_point)


def write_blocks_atomic(path: str | os.PathLike, blocks: Iterable[Buffer], total: int, *,
                        at_point: Callable[[str], None] | None = None) -> None:
    """Write the concatenation of ``blocks`` (``total`` bytes; any objects with the buffer
    protocol, taken one at a time as the write goes, so a large file is never joined in memory)
    with the guarantees of ``write_json_atomic``; its ``tmp_partial`` point comes when half of the
    bytes are written. A block count that does not add up to ``total`` raises ``ValueError`` and
    leaves nothing behind."""
    path = Path(path)
    point = at_point or (lambda name: None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path), suffix=TMP_SUFFIX, dir=path.parent)
    try:
        try:
            written, half = 0, total // 2
            batch: list[memoryview] = []
            batch_bytes = 0
            for block in blocks:
                view = memoryview(block).cast("B")
                if written <= half < written + len(view):
                    batch.append(view[:half - written])
                    _write_all(fd, batch)
                    batch, batch_bytes = [], 0
                    point("tmp_partial")
                    view = view[half - written:]
                    written = half
                batch.append(view)
                batch_bytes += len(view)
                written += len(view)
                if len(batch) >= WRITE_BATCH_BLOCKS or batch_bytes >= WRITE_BATCH_BYTES:
                    _write_all(fd, batch)
                    batch, batch_bytes = [], 0
            _write_all(fd, batch)
            if written != total:
                raise ValueError(f"{path}: {written} bytes written where {total} were announced")
            if total == 0:
                point("tmp_partial")
            os.fsync(fd)
        finally:
            os.close(fd)
        point("tmp_synced")
        os.replace(tmp, path)
    except Exception:
        # An error of ours: nothing half-written stays. A BaseException that is not an Exception
        # (a simulated kill, KeyboardInterrupt) leaves the file as a kill would; the next save or
        # load in the folder removes it (remove_stale_tmp).
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    point("renamed")
    fsync_dir(path.parent)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` in order, however many bytes each system call takes."""
    while views:
        done = os.writev(fd, views)
        if done == 0 and any(views):
            raise OSError(f"writing {sum(map(len, views))} bytes: the file takes none")
        n = 0
        while n < len(views) and done >= len(views[n]):
            done -= len(views[n])
            n += 1
        views = views[n:]
        if views:
            views[0] = views[0][done:]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file another library wrote (e.g. with ``torch.save``) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames and new files in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename is still atomic there
    finally:
        os.close(fd)


def remove_stale_tmp(folder: str | os.PathLike, name_glob: str) -> list[Path]:
    """Delete the temporary files left by killed writes of files matching ``name_glob`` in
    ``folder`` (one writer per folder is assumed: call it before writing, never during a write).
    Returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for tmp in folder.glob(f".{name_glob}.*{TMP_SUFFIX}"):
        try:
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value of ``path``; every failure is a ``StateFileError`` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise StateFileError(f"{path}: missing") from e
    except OSError as e:
        raise StateFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    if not data:
        raise StateFileError(f"{path}: empty file (a write was cut off)")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise StateFileError(f"{path}: not UTF-8 text at byte {e.start} (corrupt)") from e
    except json.JSONDecodeError as e:
        raise StateFileError(f"{path}: truncated or corrupt JSON ({e.msg} at line {e.lineno}, "
                             f"column {e.colno})") from e
