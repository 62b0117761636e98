"""The binary form of a data-source state file: a small JSON index followed by raw arrays.

A MoE job's partial buffer holds tens of millions of tokens, each with a routed-experts row per
layer. As JSON (base64 inside) that state was about 5.5 times its raw bytes and was built whole
in memory before a byte reached the disk. Here the bytes of every array are written as they are
held (``core.columns``): one pass from the buffer's own pieces to the file, no copy of the state.

Layout of ``april_state_<N>.bin``::

    MAGIC (8 bytes) | index length L (8 bytes, little-endian) | index (L bytes of UTF-8 JSON)
    | padding to a multiple of 64 | the arrays' bytes, in the index's order

Format 4 (written). The index is the state (``core.checkpoint``: format, rollout id, policy
version, prompt position, buffer) with the trajectories as columns: ``trajectories`` maps each
field of ``Trajectory.to_dict`` to the list of its values over every trajectory, in the order of
the groups (each group says how many of them are its own, ``"trajectories": n``). An array is
referred to by its number k; ``array_dtypes`` (one letter per array: ``i`` int32, ``d`` float64,
``f`` float32, ``b`` uint8) and ``array_counts`` (values per array) describe them all. A
trajectory's prompt ids are written once per group when its trajectories share them; the routed
experts are written as they are held (uint8 when every id is below 256, ``core.replay``) and read
back so. The columns cost one JSON value per field and trajectory instead of a keyed object each,
and they are read back as they are: ``decode`` gives the buffer state in the columnar form
``PartialBuffer.load_state_dict`` reads (``TRAJECTORY_COLUMNS``; each group's ``"trajectories"`` its
count), so a load makes no dict per trajectory and checks each field once per column, and
``encode`` writes that state (the snapshot of a restored checkpoint) as it was read.

Format 3 (read). One JSON object per trajectory whose arrays are ``{"array": k}``, and ``arrays``:
``[dtype, count]`` for every k; routed experts narrowed to uint8 on disk when they fit, which are
now held so.

Reading checks the magic, the index and that the file's size is exactly what the index announces,
so a truncated or corrupt file is an error naming it, never a short buffer. The arrays are read
with one read into one block; the restored arrays are read-only views of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from april_slime.core.buffer import TRAJECTORY_COLUMNS
from april_slime.core.columns import Column
from april_slime.core.jsonfile import StateFileError

MAGIC = b"APRILST\x00"
_ALIGN = 64
_DTYPES = {"<i4": np.dtype("<i4"), "<f8": np.dtype("<f8"), "<f4": np.dtype("<f4"), "|u1": np.dtype("u1")}
_LETTERS = {"i": "<i4", "d": "<f8", "f": "<f4", "b": "|u1"}  # format 4's array_dtypes
_LETTER_OF = {dtype: letter for letter, dtype in _LETTERS.items()}
# an array's dtype in a decoded table is its place in _BY_CODE (vectorised lookups)
_BY_CODE = tuple(_DTYPES.values())
_CODE_OF = {name: code for code, name in enumerate(_DTYPES)}
_ITEMSIZES = np.array([d.itemsize for d in _BY_CODE], dtype=np.int64)
_CODE_OF_LETTER = np.zeros(256, dtype=np.intp)  # only the letters of _LETTERS are looked up
for _letter, _name in _LETTERS.items():
    _CODE_OF_LETTER[ord(_letter)] = _CODE_OF[_name]
_MAX_COUNT = 2 ** 56  # values of all arrays: more than a file holds, and their bytes still add up in int64
BYTES_KEY = "__april_bytes__"  # {BYTES_KEY: k}: array k, read back as ``bytes``
# replay arrays and their stored dtype (None: the routed experts, as held: uint8 or int32)
_REPLAY_DTYPES = {"routed": None, "top_p_ids": "<i4", "top_p_counts": "<i4", "top_p_log_probs": "<f4",
                  "topk_ids": "<i4", "topk_log_probs": "<f4"}
_COLUMNS = ("prompt_ids", "response_ids", "logprobs")
_EPISODE = ("episode_sample", "episode_samples")


class _Writer:
    def __init__(self) -> None:
        self.dtypes: list[str] = []
        self.counts: list[int] = []
        self.pieces: list[tuple] = []
        self._by_identity: dict[tuple, int] = {}  # (dtype, ids of its pieces) -> array index
        self._held: list[Any] = []

    def column(self, column: Any) -> Any:
        if not isinstance(column, Column):  # plain data: written in the index
            return column
        return self._add(column.dtype.str, len(column), column.chunks)

    def prompt(self, column: Any) -> Any:
        # prompts holding the same pieces (a group's, shared by its trajectories) are written
        # once; the columns are held, so no id is reused while the index is built
        if not isinstance(column, Column):
            return column
        key = (column.dtype.str, *map(id, column.chunks))
        known = self._by_identity.get(key)
        if known is None:
            known = self._add(column.dtype.str, len(column), column.chunks)
            self._by_identity[key] = known
            self._held.append(column)
        return known

    def replay(self, replay: dict[str, Any] | None) -> dict[str, Any] | None:
        if replay is None:
            return None
        out = dict(replay)
        for name, dtype in _REPLAY_DTYPES.items():
            pieces = replay.get(name)
            if pieces is None:
                continue
            pieces = (pieces,) if isinstance(pieces, (bytes, bytearray, memoryview)) else tuple(pieces)
            if dtype is None:
                dtype = "|u1" if replay.get("routed_itemsize", 4) == 1 else "<i4"
            total = sum(len(p) for p in pieces)
            out[name] = self._add(dtype, total // _DTYPES[dtype].itemsize, pieces)
        return out

    def refer_bytes(self, value: Any) -> Any:
        """``value`` with every ``bytes`` in it (a finished episode's samples keep their replay
        rows as bytes) written as an array and referred to by ``{BYTES_KEY: k}``."""
        if isinstance(value, bytes):
            return {BYTES_KEY: self._add("|u1", len(value), (value,))}
        if isinstance(value, dict):
            return {key: self.refer_bytes(v) for key, v in value.items()}
        if isinstance(value, list):
            return [self.refer_bytes(v) for v in value]
        return value

    def _add(self, dtype: str, count: int, pieces: tuple) -> int:
        self.dtypes.append(_LETTER_OF[dtype])
        self.counts.append(count)
        self.pieces.append(pieces)
        return len(self.counts) - 1

    @property
    def nbytes(self) -> int:
        return sum(_DTYPES[_LETTERS[d]].itemsize * n for d, n in zip(self.dtypes, self.counts))


def _columns_of(groups: list[dict[str, Any]]) -> dict[str, list]:
    """The trajectories of ``groups`` as one list per field."""
    trajectories = [t for g in groups for t in g["trajectories"]]
    if not trajectories:
        return {}
    keys = trajectories[0].keys()
    for t in trajectories:
        if t.keys() != keys:
            raise ValueError(f"trajectory {t.get('uid')!r}: fields {sorted(t)} differ from {sorted(keys)}")
    return {key: [t[key] for t in trajectories] for key in keys}


def _written(columns: dict[str, list], writer: _Writer) -> dict[str, list]:
    """``columns`` (left as they are) with their arrays given to ``writer``, as they are indexed."""
    columns = dict(columns)
    for name in _COLUMNS:
        if name in columns:
            add = writer.prompt if name == "prompt_ids" else writer.column
            columns[name] = [add(v) for v in columns[name]]
    if "replay" in columns:
        columns["replay"] = [writer.replay(v) for v in columns["replay"]]
    for name in _EPISODE:
        if name in columns:
            columns[name] = [None if v is None else writer.refer_bytes(v) for v in columns[name]]
    return columns


def encode(state: dict[str, Any]) -> tuple[list[Any], int]:
    """The blocks of the file of ``state`` (a data-source state whose buffer groups come from
    ``Group.to_dict(shared=True)``, or the columnar state ``decode`` gives) and its size in bytes.
    Nothing is copied but the index."""
    writer = _Writer()
    buffer = dict(state["buffer"])
    source, columns = buffer["groups"], buffer.pop(TRAJECTORY_COLUMNS, None)
    if columns is None:  # a snapshot of the live buffer: one dict per trajectory
        columns = _columns_of(source)
        counts = [len(g["trajectories"]) for g in source]
    else:  # the columnar state a load read (the snapshot of the restored rollout)
        counts = [g["trajectories"] for g in source]
        if any(len(c) != sum(counts) for c in columns.values()):
            raise ValueError(f"rollout {state.get('rollout_id')}: the trajectory columns do not hold "
                             f"the groups' {sum(counts)} trajectories")
    groups = [{**g, "prompt_ids": writer.prompt(g["prompt_ids"]), "trajectories": n} for g, n in zip(source, counts)]
    index = {**state, "buffer": {**buffer, "groups": groups}, "trajectories": _written(columns, writer),
             "array_dtypes": "".join(writer.dtypes), "array_counts": writer.counts}
    try:
        text = json.dumps(index, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"rollout {state.get('rollout_id')}: data-source state is not plain JSON ({e})") from e
    head = MAGIC + len(text).to_bytes(8, "little") + text
    head += b"\0" * (-len(head) % _ALIGN)
    return [head, *(p for pieces in writer.pieces for p in pieces)], len(head) + writer.nbytes


def is_binary(path: Path) -> bool:
    return path.suffix == ".bin"


def decode(path: Path) -> dict[str, Any]:
    """The state in ``path``, its arrays ``Column``s (token ids, log-probs) and memory views (replay
    rows) of one block read from the file; every problem is a ``StateFileError`` naming the
    file."""
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
            table = _Arrays.of(path, index)
            start = len(MAGIC) + 8 + length
            start += -start % _ALIGN
            if size != start + table.nbytes:
                raise StateFileError(f"{path}: {size} bytes where the index announces {start + table.nbytes} "
                                     "(truncated or corrupt)")
            f.seek(start)
            # one read into one block, the arrays as read-only views of it: many small reads cost
            # twice the time. The block lives until the last array restored from it is gone (the
            # restored partials are resumed, trained or dropped within the staleness bound).
            block = np.empty(table.nbytes, dtype=np.uint8)
            if f.readinto(memoryview(block)) != len(block):
                raise StateFileError(f"{path}: shorter than its size while being read")
            block.flags.writeable = False
            table.block = block
    except FileNotFoundError as e:
        raise StateFileError(f"{path}: missing") from e
    except OSError as e:
        raise StateFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    buffer = index.get("buffer")
    if not isinstance(buffer, dict) or not isinstance(buffer.get("groups"), list):
        raise StateFileError(f"{path}: no buffer state")
    try:
        if index.get("format") == 3:
            _with_arrays_3(table, buffer["groups"])
            del index["arrays"]
        else:
            _with_arrays(table, buffer, index.pop("trajectories"))
            del index["array_dtypes"], index["array_counts"]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise StateFileError(f"{path}: not a valid buffer state ({type(e).__name__}: {e})") from e
    return index


class _Arrays:
    """The arrays of a file: their dtypes, counts and offsets in the block read from it."""

    def __init__(self, path: Path, codes: np.ndarray, counts: list[int]) -> None:
        """``codes``: each array's dtype as its place in ``_BY_CODE``; ``counts``: its values."""
        self.path, self.counts = path, counts
        self._codes = codes
        self._counts = np.array(counts, dtype=np.int64)
        sizes = _ITEMSIZES[codes] * self._counts
        ends = np.cumsum(sizes)
        self.nbytes = int(ends[-1]) if len(ends) else 0
        self._offsets = ends - sizes
        self.offsets = self._offsets.tolist()
        self.dtypes = [_BY_CODE[c] for c in codes.tolist()]
        self.block: np.ndarray | None = None
        self._columns: dict[int, Column] = {}
        self._typed: dict[int, tuple[np.ndarray, np.dtype]] = {}  # code * 8 + offset % itemsize -> view, dtype

    @classmethod
    def of(cls, path: Path, index: Any) -> _Arrays:
        if not isinstance(index, dict):
            raise StateFileError(f"{path}: the index is not an object")
        if index.get("format") not in (3, 4):
            raise StateFileError(f"{path}: state format {index.get('format')!r}, expected 3 or 4 in a binary file")
        if index.get("format") == 3:
            table = index.get("arrays")
            if not isinstance(table, list):
                raise StateFileError(f"{path}: the index has no array table")
            for k, entry in enumerate(table):
                if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in _DTYPES
                        or type(entry[1]) is not int or not 0 <= entry[1] <= _MAX_COUNT):
                    raise StateFileError(f"{path}: array {k} of the index is {entry!r}, not [dtype, count]")
            return cls(path, np.array([_CODE_OF[d] for d, _ in table], dtype=np.intp), [n for _, n in table])
        letters, counts = index.get("array_dtypes"), index.get("array_counts")
        if not isinstance(letters, str) or not isinstance(counts, list) or len(letters) != len(counts):
            raise StateFileError(f"{path}: the index has no array table")
        unknown = set(letters) - _LETTERS.keys()
        if unknown:
            raise StateFileError(f"{path}: array dtypes {sorted(unknown)} of the index are none of {sorted(_LETTERS)}")
        # checked whole, in C: a 30 M-token file has thousands of arrays
        if counts and not (set(map(type, counts)) == {int} and min(counts) >= 0 and sum(counts) <= _MAX_COUNT):
            raise StateFileError(f"{path}: the index's array counts are not all integers >= 0 "
                                 f"(adding up to at most {_MAX_COUNT})")
        codes = _CODE_OF_LETTER[np.frombuffer(letters.encode("ascii"), dtype=np.uint8)]
        return cls(path, codes, counts)

    def _ref(self, k: Any, owner: tuple[str, Any], name: str) -> int:
        if type(k) is not int or not 0 <= k < len(self.counts):
            raise StateFileError(f"{self.path}: {owner[0]} {owner[1]!r}: {name} refers to no array ({k!r})")
        return k

    def column(self, k: Any, owner: tuple[str, Any], name: str) -> Any:
        """Array k as a ``Column`` of one read-only piece (one per k: the trajectories that shared a
        prompt share it again); a list is plain data written in the index. ``owner`` (kind, uid)
        and ``name`` say whose, in errors."""
        if type(k) is list:
            return k
        out = self._columns.get(k) if type(k) is int else None
        if out is None:
            self._make((self._ref(k, owner, name),))
            out = self._columns[k]
        return out

    def columns(self, ks: list, uids: list, name: str, kind: str = "trajectory") -> list:
        """``column`` of each of ``ks`` (the field ``name`` of the ``kind``s ``uids``): a restore
        makes two or three per trajectory, so when every one refers to an array (as a written
        file's do) they are checked and made at once."""
        count = len(self.counts)
        if not ks or set(map(type, ks)) != {int} or min(ks) < 0 or max(ks) >= count:
            # plain data, or a reference to nothing (named): one at a time
            return [self.column(k, (kind, uid), name) for k, uid in zip(ks, uids)]
        self._make(set(ks) - self._columns.keys())
        return list(map(self._columns.__getitem__, ks))

    def _make(self, ks: Collection[int]) -> None:
        """A ``Column`` of each array of ``ks`` (valid numbers): a slice of the block's view as the
        array's dtype at the array's alignment, made once per dtype and alignment (a slice costs a
        third of a view made with ``np.frombuffer``). The slices are read-only, as the block is."""
        if not ks:
            return
        ks = np.fromiter(ks, dtype=np.int64, count=len(ks))
        codes, offsets = self._codes[ks], self._offsets[ks]
        itemsizes = _ITEMSIZES[codes]
        which = codes * 8 + offsets % itemsizes
        firsts = offsets // itemsizes
        lasts = firsts + self._counts[ks]
        for w in np.unique(which).tolist():
            if w not in self._typed:
                dtype, skip = _BY_CODE[w // 8], w % 8
                self._typed[w] = np.frombuffer(self.block, dtype, (self.nbytes - skip) // dtype.itemsize, skip), dtype
            view, dtype = self._typed[w]
            mine = which == w
            # in C but for Column.__init__: the slices, each in a 1-tuple (zip), made columns
            pieces = map(view.__getitem__, map(slice, firsts[mine].tolist(), lasts[mine].tolist()))
            self._columns.update(zip(ks[mine].tolist(), map(Column, zip(pieces), repeat(dtype))))

    def view(self, k: Any, owner: tuple[str, Any], name: str) -> memoryview:
        """Array k's bytes: a read-only view, held as a piece of a replay's ``ByteChunks``."""
        k = self._ref(k, owner, name)
        start = self.offsets[k]
        return memoryview(self.block[start:start + self.dtypes[k].itemsize * self.counts[k]])

    def replay(self, value: Any, owner: tuple[str, Any], *, narrowed_on_disk: bool) -> Any:
        """A trajectory's replay with its arrays' bytes; the routed experts' ``routed_itemsize``
        is their array's (a format 3 file narrowed them on disk and said nothing in the index)."""
        if value is None:
            return None
        for name in _REPLAY_DTYPES:
            k = value.get(name)
            if k is None:
                continue
            value[name] = self.view(k, owner, f"replay.{name}")
            if name == "routed":
                itemsize = self.dtypes[k].itemsize
                if narrowed_on_disk:
                    value["routed_itemsize"] = itemsize
                elif value.get("routed_itemsize", 4) != itemsize:
                    raise StateFileError(f"{self.path}: {owner[0]} {owner[1]!r}: routed experts of {itemsize}-byte "
                                         f"values where the index says {value.get('routed_itemsize', 4)}")
        return value

    def with_bytes(self, value: Any) -> Any:
        """``value`` with every ``{BYTES_KEY: k}`` replaced by the bytes of array k."""
        if isinstance(value, dict):
            k = value.get(BYTES_KEY)
            if (len(value) == 1 and type(k) is int and 0 <= k < len(self.counts)
                    and self.dtypes[k].itemsize == 1):
                return bytes(self.view(k, ("episode sample", k), BYTES_KEY))
            return {key: self.with_bytes(v) for key, v in value.items()}
        if isinstance(value, list):
            return [self.with_bytes(v) for v in value]
        return value


def _with_arrays(arrays: _Arrays, buffer: dict[str, Any], columns: Any) -> None:
    """Format 4: the trajectory columns, with their arrays, as the buffer state's
    ``TRAJECTORY_COLUMNS`` (the columnar form ``PartialBuffer.load_state_dict`` reads: no dict per
    trajectory is made); the groups keep their trajectory counts."""
    groups = buffer["groups"]
    counts = [g["trajectories"] for g in groups]
    if not all(type(n) is int and n >= 0 for n in counts):
        raise StateFileError(f"{arrays.path}: a group's trajectory count is not an integer >= 0")
    total = sum(counts)
    if not isinstance(columns, dict) or not all(isinstance(c, list) and len(c) == total for c in columns.values()):
        raise StateFileError(f"{arrays.path}: the trajectory columns do not hold {total} values each")
    if total and "uid" not in columns:
        raise StateFileError(f"{arrays.path}: the trajectory columns have no uid")
    uids = columns.get("uid", [])
    for name in _COLUMNS:
        if name in columns:
            columns[name] = arrays.columns(columns[name], uids, name)
    if "replay" in columns:
        columns["replay"] = [None if v is None else arrays.replay(v, ("trajectory", uid), narrowed_on_disk=False)
                             for v, uid in zip(columns["replay"], uids)]
    for name in _EPISODE:
        if name in columns:
            columns[name] = [None if v is None else arrays.with_bytes(v) for v in columns[name]]
    prompts = arrays.columns([g["prompt_ids"] for g in groups], [g.get("uid") for g in groups], "prompt_ids", "group")
    for group, prompt in zip(groups, prompts):
        group["prompt_ids"] = prompt
    buffer[TRAJECTORY_COLUMNS] = columns


def _with_arrays_3(arrays: _Arrays, groups: list[dict[str, Any]]) -> None:
    """Format 3: every trajectory's ``{"array": k}`` replaced by its array."""
    def ref(value: Any) -> Any:
        return value if isinstance(value, list) else (value["array"] if isinstance(value, dict) else value)

    for group in groups:
        group["prompt_ids"] = arrays.column(ref(group["prompt_ids"]), ("group", group.get("uid")), "prompt_ids")
        for t in group["trajectories"]:
            where = ("trajectory", t.get("uid"))
            for name in _COLUMNS:
                t[name] = arrays.column(ref(t[name]), where, name)
            replay = t.get("replay")
            if replay is not None:
                for name in _REPLAY_DTYPES:
                    if replay.get(name) is not None:
                        replay[name] = ref(replay[name])
                t["replay"] = arrays.replay(replay, where, narrowed_on_disk=True)
            for name in _EPISODE:
                if t.get(name) is not None:
                    t[name] = arrays.with_bytes(t[name])
