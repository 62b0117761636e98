"""The binary form of a data-source state file: a small JSON index followed by raw arrays.

A MoE job's partial buffer holds tens of millions of tokens, each with a routed-experts row per
layer. As JSON (base64 inside) that state was about 5.5 times its raw bytes and was built whole
in memory before a byte reached the disk. Here the bytes of every array are written as they are
held (``core.columns``): one pass from the buffer's own pieces to the file, no copy of the state.

Layout of ``april_state_<N>.bin``::

    MAGIC (8 bytes) | index length L (8 bytes, little-endian) | index (L bytes of UTF-8 JSON)
    | padding to a multiple of 64 | the arrays' bytes, in the index's order

The index is the state (``core.checkpoint``: format, rollout id, policy version, prompt position,
buffer) where each array is replaced by ``{"array": k}``, plus ``arrays``: ``[dtype, count]`` for
every k. A trajectory's prompt ids are written once per group when its trajectories share them.
The routed experts are written as uint8 when every expert id is below 256 (a MoE of up to 256
experts; 4 bytes per value otherwise) and widened back to int32 on load. Reading checks the magic,
the index and that the file's size is exactly what the index announces, so a truncated or
corrupt file is an error naming it, never a short buffer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from april_slime.core.columns import Column
from april_slime.core.jsonfile import StateFileError

MAGIC = b"APRILST\x00"
_ALIGN = 64
_DTYPES = {"<i4": np.dtype("<i4"), "<f8": np.dtype("<f8"), "<f4": np.dtype("<f4"), "|u1": np.dtype("u1")}
BYTES_KEY = "__april_bytes__"  # {BYTES_KEY: k}: array k, read back as ``bytes``
_BLOCK = 1 << 24  # bytes of int32 narrowed to uint8 at a time (bounds the write's scratch memory)
# replay arrays: stored dtype, or None for the routed experts (narrowed when they fit)
_REPLAY_DTYPES = {"routed": None, "top_p_ids": "<i4", "top_p_counts": "<i4", "top_p_log_probs": "<f4",
                  "topk_ids": "<i4", "topk_log_probs": "<f4"}


class _Array:
    """One array of the file: its stored dtype and count, and how to produce its bytes."""

    __slots__ = ("dtype", "count", "pieces", "narrow")

    def __init__(self, dtype: str, count: int, pieces: tuple, narrow: bool = False) -> None:
        self.dtype, self.count, self.pieces, self.narrow = dtype, count, pieces, narrow

    @property
    def nbytes(self) -> int:
        return self.count * _DTYPES[self.dtype].itemsize

    def blocks(self) -> Iterator[Any]:
        for piece in self.pieces:
            if not self.narrow:
                yield piece
                continue
            values = np.frombuffer(piece, dtype="<i4")
            for start in range(0, len(values), _BLOCK):
                yield values[start:start + _BLOCK].astype(np.uint8)


class _Writer:
    def __init__(self) -> None:
        self.arrays: list[_Array] = []
        self._by_identity: dict[tuple, int] = {}  # (dtype, ids of its pieces) -> array index
        self._held: list[Any] = []

    def column(self, column: Column) -> dict[str, int]:
        return {"array": self._add(_Array(column.dtype.str, len(column), column.chunks))}

    def prompt(self, column: Column) -> dict[str, int]:
        # prompts holding the same pieces (a group's, shared by its trajectories) are written
        # once; the columns are held, so no id is reused while the index is built
        key = (column.dtype.str, *map(id, column.chunks))
        known = self._by_identity.get(key)
        if known is None:
            known = self._add(_Array(column.dtype.str, len(column), column.chunks))
            self._by_identity[key] = known
            self._held.append(column)
        return {"array": known}

    def replay(self, name: str, pieces: tuple[bytes, ...] | None) -> dict[str, int] | None:
        if pieces is None:
            return None
        total = sum(len(p) for p in pieces)
        dtype, narrow = _REPLAY_DTYPES[name], False
        if dtype is None:  # routed experts: uint8 when every id fits
            narrow = all(not len(p) or int(np.frombuffer(p, "<i4").max()) < 256
                         and int(np.frombuffer(p, "<i4").min()) >= 0 for p in pieces)
            dtype = "|u1" if narrow else "<i4"
        return {"array": self._add(_Array(dtype, total // 4, pieces, narrow))}

    def refer_bytes(self, value: Any) -> Any:
        """``value`` with every ``bytes`` in it (a finished episode's samples keep their replay
        rows as bytes) written as an array and referred to by ``{BYTES_KEY: k}``."""
        if isinstance(value, bytes):
            return {BYTES_KEY: self._add(_Array("|u1", len(value), (value,)))}
        if isinstance(value, dict):
            return {key: self.refer_bytes(v) for key, v in value.items()}
        if isinstance(value, list):
            return [self.refer_bytes(v) for v in value]
        return value

    def _add(self, array: _Array) -> int:
        self.arrays.append(array)
        return len(self.arrays) - 1


def encode(state: dict[str, Any]) -> tuple[list[Any], int]:
    """The blocks of the file of ``state`` (a data-source state whose buffer groups come from
    ``Group.to_dict(shared=True)``) and its size in bytes. Nothing is copied but the index."""
    writer = _Writer()
    groups = []
    for group in state["buffer"]["groups"]:
        prompt = writer.prompt(group["prompt_ids"]) if isinstance(group["prompt_ids"], Column) else None
        trajectories = []
        for t in group["trajectories"]:
            t = dict(t)
            if isinstance(t["prompt_ids"], Column):
                t["prompt_ids"] = writer.prompt(t["prompt_ids"])
            for name in ("response_ids", "logprobs"):
                if isinstance(t[name], Column):
                    t[name] = writer.column(t[name])
            if t.get("replay") is not None:
                t["replay"] = {key: (writer.replay(key, value) if key in _REPLAY_DTYPES else value)
                               for key, value in t["replay"].items()}
            for name in ("episode_sample", "episode_samples"):
                if t.get(name) is not None:
                    t[name] = writer.refer_bytes(t[name])
            trajectories.append(t)
        groups.append({**group, "prompt_ids": prompt if prompt is not None else group["prompt_ids"],
                       "trajectories": trajectories})
    index = {**state, "buffer": {**state["buffer"], "groups": groups},
             "arrays": [[a.dtype, a.count] for a in writer.arrays]}
    try:
        text = json.dumps(index, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"rollout {state.get('rollout_id')}: data-source state is not plain JSON ({e})") from e
    head = MAGIC + len(text).to_bytes(8, "little") + text
    head += b"\0" * (-len(head) % _ALIGN)
    size = len(head) + sum(a.nbytes for a in writer.arrays)

    def blocks() -> Iterator[Any]:
        yield head
        for array in writer.arrays:
            yield from array.blocks()

    return blocks(), size


def is_binary(path: Path) -> bool:
    return path.suffix == ".bin"


def decode(path: Path) -> dict[str, Any]:
    """The state in ``path``, its arrays read-only numpy arrays (token columns) and memory views
    (replay rows) of one block read from the file; every problem is a ``StateFileError`` naming
    the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic = f.read(len(MAGIC))
            if magic != MAGIC:
                raise StateFileError(f"{path}: not a data-source state file (magic {magic!r})"
                                     if magic else f"{path}: empty file (a write was cut off)")
            length = int.from_bytes(f.read(8), "little")
            if length > size:
                raise StateFileError(f"{path}: index of {length} bytes in a file of {size} (truncated or corrupt)")
            try:
                index = json.loads(f.read(length).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise StateFileError(f"{path}: corrupt index ({e})") from e
            arrays = _array_table(path, index)
            start = len(MAGIC) + 8 + length
            start += -start % _ALIGN
            expected = start + sum(_DTYPES[d].itemsize * n for d, n in arrays)
            if size != expected:
                raise StateFileError(f"{path}: {size} bytes where the index announces {expected} "
                                     "(truncated or corrupt)")
            f.seek(start)
            # one read into one block, the arrays as read-only views of it: many small reads cost
            # twice the time. The block lives until the last array restored from it is gone (the
            # restored partials are resumed, trained or dropped within the staleness bound).
            block = np.empty(expected - start, dtype=np.uint8)
            if f.readinto(memoryview(block)) != len(block):
                raise StateFileError(f"{path}: shorter than its size while being read")
            block.flags.writeable = False
            data, offset = [], 0
            for dtype, count in arrays:
                nbytes = _DTYPES[dtype].itemsize * count
                data.append(memoryview(block[offset:offset + nbytes]))
                offset += nbytes
    except FileNotFoundError as e:
        raise StateFileError(f"{path}: missing") from e
    except OSError as e:
        raise StateFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    return _with_arrays(path, index, arrays, data)


def _array_table(path: Path, index: Any) -> list[tuple[str, int]]:
    table = index.get("arrays") if isinstance(index, dict) else None
    if not isinstance(table, list):
        raise StateFileError(f"{path}: the index has no array table")
    out = []
    for k, entry in enumerate(table):
        if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in _DTYPES
                or not isinstance(entry[1], int) or isinstance(entry[1], bool) or entry[1] < 0):
            raise StateFileError(f"{path}: array {k} of the index is {entry!r}, not [dtype, count]")
        out.append((entry[0], entry[1]))
    return out


def _with_arrays(path: Path, index: dict[str, Any], arrays: list[tuple[str, int]],
                 data: list[memoryview]) -> dict[str, Any]:
    def ref(value: Any, what: str) -> int:
        if not (isinstance(value, dict) and isinstance(value.get("array"), int)
                and 0 <= value["array"] < len(arrays)):
            raise StateFileError(f"{path}: {what} refers to no array ({value!r})")
        return value["array"]

    columns: dict[int, np.ndarray] = {}

    def column(value: Any, what: str) -> Any:
        if isinstance(value, list):  # written as plain data
            return value
        k = ref(value, what)
        if k not in columns:  # one array per k: what shared a prompt shares it again
            columns[k] = np.frombuffer(data[k], dtype=_DTYPES[arrays[k][0]])  # read-only, no copy
        return columns[k]

    def replay_bytes(value: Any, what: str) -> Any:
        if value is None:
            return None
        k = ref(value, what)
        if arrays[k][0] == "|u1":  # narrowed routed experts: widened to the int32 held in memory
            return np.frombuffer(data[k], dtype=np.uint8).astype("<i4").tobytes()
        return data[k]  # a read-only view, held as a piece of the replay's ByteChunks

    buffer = index.get("buffer")
    if not isinstance(buffer, dict) or not isinstance(buffer.get("groups"), list):
        raise StateFileError(f"{path}: no buffer state")
    try:
        for group in buffer["groups"]:
            group["prompt_ids"] = column(group["prompt_ids"], f"group {group.get('uid')!r}: prompt_ids")
            for t in group["trajectories"]:
                where = f"trajectory {t.get('uid')!r}"
                for name in ("prompt_ids", "response_ids", "logprobs"):
                    t[name] = column(t[name], f"{where}: {name}")
                if t.get("replay") is not None:
                    for name in _REPLAY_DTYPES:
                        t["replay"][name] = replay_bytes(t["replay"].get(name), f"{where}: replay.{name}")
                for name in ("episode_sample", "episode_samples"):
                    if t.get(name) is not None:
                        t[name] = _with_bytes(t[name], arrays, data)
    except (KeyError, TypeError, AttributeError) as e:
        raise StateFileError(f"{path}: not a valid buffer state ({type(e).__name__}: {e})") from e
    del index["arrays"]
    return index


def _with_bytes(value: Any, arrays: list[tuple[str, int]], data: list[bytes]) -> Any:
    """``value`` with every ``{BYTES_KEY: k}`` replaced by the bytes of array k."""
    if isinstance(value, dict):
        k = value.get(BYTES_KEY)
        if len(value) == 1 and isinstance(k, int) and 0 <= k < len(arrays) and arrays[k][0] == "|u1":
            return bytes(data[k])
        return {key: _with_bytes(v, arrays, data) for key, v in value.items()}
    if isinstance(value, list):
        return [_with_bytes(v, arrays, data) for v in value]
    return value
