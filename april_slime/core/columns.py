"""Per-token data held as immutable chunks: compact in memory, invisible to the garbage collector,
and shared by the checkpoint's snapshots instead of copied.

A trajectory's prompt ids, response ids and log-probs are ``Column``s; the replay rows it carries for
training (routed experts, top-p sets) are ``ByteChunks``. Both keep their data in a tuple of
immutable pieces: read-only numpy arrays (int32 ids, float64 log-probs) or ``bytes``. Appending a
reply adds one piece and leaves the earlier ones untouched, so

* a token costs its raw bytes (4 for an id, 8 for a log-prob) instead of a Python object and a
  list slot (about 36 bytes, and one more object for every gen-2 collection to walk: at millions of
  buffered tokens those collections stopped the event loop for seconds);
* a snapshot of the buffer (``core.checkpoint``) holds the same pieces as the live trajectories: it
  costs no copy, and a trajectory resumed after the snapshot adds pieces without changing what the
  snapshot sees. A piece is never written in place (numpy's read-only flag guards the arrays).

``Column`` reads like the list it replaced (``len``, indexing, slicing, iteration in Python ints or
floats, ``==`` against any sequence); ``array()`` and ``tolist()`` give the values whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")  # token ids: every vocabulary fits
LOGPROB_DTYPE = np.dtype("<f8")  # log-probs as the engine reported them, bit for bit


def frozen_array(values: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """``values`` as a read-only 1-d array of ``dtype`` (a copy unless it already is one). Integers
    outside an integer dtype's range, and values of another kind (a float id, a string), raise
    ``ValueError`` naming ``what``; nothing wraps around or is rounded silently."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and not values.flags.writeable:
        return values
    source = values if isinstance(values, np.ndarray) else np.asarray(values)
    if source.ndim != 1:
        raise ValueError(f"{what}: a sequence of numbers, not an array of shape {source.shape}")
    if source.size:
        if dtype.kind == "i":
            if source.dtype.kind not in "iub":
                raise ValueError(f"{what}: {source.dtype} values where integers are expected")
            low, high = int(source.min()), int(source.max())
            if low < np.iinfo(dtype).min or high > np.iinfo(dtype).max:
                raise ValueError(f"{what}: values {low}..{high} do not fit {dtype.name}")
        elif source.dtype.kind not in "iuf":
            raise ValueError(f"{what}: {source.dtype} values where numbers are expected")
    out = source.astype(dtype, copy=True)
    out.flags.writeable = False
    return out


def _pieces_between(pieces: tuple, start: int, stop: int) -> list:
    """The parts of ``pieces`` (anything sliceable) that cover positions ``[start, stop)`` of their
    concatenation: whole pieces as they are, the ends sliced (views, for arrays and memoryviews)."""
    out, pos = [], 0
    for piece in pieces:
        lo, hi = max(start - pos, 0), min(stop - pos, len(piece))
        if lo < hi:
            out.append(piece if (lo, hi) == (0, len(piece)) else piece[lo:hi])
        pos += len(piece)
        if pos >= stop:
            break
    return out


class Column(Sequence):
    """An immutable sequence of numbers of one dtype, held as read-only numpy chunks."""

    __slots__ = ("_chunks", "_len", "dtype")

    def __init__(self, chunks: tuple[np.ndarray, ...] = (), dtype: np.dtype = TOKEN_DTYPE) -> None:
        if type(chunks) is tuple and len(chunks) == 1:  # the common case, made cheap: a restore makes thousands
            self._len = len(chunks[0])
            self._chunks = chunks if self._len else ()
        else:
            self._chunks = tuple(c for c in chunks if len(c))
            self._len = sum(len(c) for c in self._chunks)
        self.dtype = dtype

    @classmethod
    def of(cls, values: Any, dtype: np.dtype, what: str = "column") -> Column:
        """A column of ``values`` (itself when it already is one of ``dtype``)."""
        if isinstance(values, np.ndarray):  # first: an isinstance check against the Sequence ABC is slow
            return cls((frozen_array(values, dtype, what),), dtype)
        if isinstance(values, Column) and values.dtype == dtype:
            return values
        if isinstance(values, Column):
            values = values.array()
        return cls((frozen_array(values, dtype, what),), dtype)

    # ------------------------------------------------------------------ new columns
    def extended(self, values: Any, what: str = "column") -> Column:
        """This column followed by ``values`` (the pieces held so far are shared, not copied)."""
        piece = frozen_array(values, self.dtype, what)
        return Column(self._chunks + (piece,), self.dtype) if len(piece) else self

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return Column.of(self.array()[index], self.dtype)
            return self._between(start, max(start, stop))
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("column index out of range")
        for chunk in self._chunks:
            if index < len(chunk):
                return chunk[index].item()
            index -= len(chunk)
        raise IndexError("column index out of range")  # pragma: no cover (lengths add up)

    def _between(self, start: int, stop: int) -> Column:
        return Column(tuple(_pieces_between(self._chunks, start, stop)), self.dtype)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._chunks:
            yield from chunk.tolist()

    def array(self) -> np.ndarray:
        """The values as one read-only array (no copy when they are one piece)."""
        if len(self._chunks) == 1:
            return self._chunks[0]
        out = np.concatenate(self._chunks) if self._chunks else np.empty(0, self.dtype)
        out.flags.writeable = False
        return out

    def tolist(self) -> list:
        """The values as a list of Python ints or floats."""
        out: list = []
        for chunk in self._chunks:
            out.extend(chunk.tolist())
        return out

    @property
    def chunks(self) -> tuple[np.ndarray, ...]:
        """The read-only pieces, in order (what a checkpoint writes without joining them)."""
        return self._chunks

    @property
    def nbytes(self) -> int:
        return self._len * self.dtype.itemsize

    def __add__(self, other: Any) -> list:
        """A list, as the list this replaced gave (``prompt_ids + response_ids``)."""
        return self.tolist() + (other.tolist() if isinstance(other, Column) else list(other))

    def __radd__(self, other: Any) -> list:
        return list(other) + self.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column):
            return self._len == other._len and bool(np.array_equal(self.array(), other.array()))
        if isinstance(other, (Sequence, np.ndarray)) and not isinstance(other, (str, bytes)):
            return len(other) == self._len and bool(np.array_equal(self.array(), np.asarray(other)))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (equal to lists, which do not hash)

    def __repr__(self) -> str:
        head = ", ".join(map(str, self[:8])) + (", ..." if self._len > 8 else "")
        return f"Column[{self.dtype.name}]([{head}], len={self._len})"


def token_column(values: Any, what: str = "token ids") -> Column:
    return Column.of(values, TOKEN_DTYPE, what)


def logprob_column(values: Any, what: str = "log-probs") -> Column:
    return Column.of(values, LOGPROB_DTYPE, what)


def _piece(data: bytes | bytearray | memoryview) -> bytes | memoryview:
    """An immutable piece: ``bytes`` as they are, a read-only view as it is (a restored
    checkpoint's block), anything else copied."""
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly and data.format in "bB"
                                   and data.ndim == 1 and data.contiguous):
        return data
    return bytes(data)


class ByteChunks:
    """A growable byte string held as immutable pieces (``bytes``, or read-only views): the operations of the
    ``bytearray`` it replaces in a trajectory's replay rows (``len``, slicing to ``bytes``,
    ``+=``, ``del x[n:]``), but a growth or a cut rebinds the piece tuple instead of writing in
    place, so a ``frozen()`` taken earlier keeps reading what it saw."""

    __slots__ = ("_pieces", "_len")

    def __init__(self, data: bytes | bytearray | memoryview | Iterable[bytes | memoryview] = b"") -> None:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = (data,)
        self._pieces = tuple(_piece(p) for p in data if len(p))
        self._len = sum(len(p) for p in self._pieces)

    def frozen(self) -> tuple[bytes | memoryview, ...]:
        """The current pieces: an immutable view, valid whatever happens to this object later."""
        return self._pieces

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __bytes__(self) -> bytes:
        if len(self._pieces) == 1 and isinstance(self._pieces[0], bytes):
            return self._pieces[0]
        return b"".join(self._pieces)

    def __getitem__(self, index: slice) -> bytes:
        if not isinstance(index, slice):
            raise TypeError("ByteChunks are read in slices")
        start, stop, step = index.indices(self._len)
        if step != 1:
            return bytes(self)[index]
        out = _pieces_between(self._pieces, start, stop)
        return out[0] if len(out) == 1 and isinstance(out[0], bytes) else b"".join(out)

    def __iadd__(self, data: bytes | bytearray | memoryview | ByteChunks) -> ByteChunks:
        more = data._pieces if isinstance(data, ByteChunks) else ((_piece(data),) if len(data) else ())
        self._pieces += more
        self._len += sum(len(p) for p in more)
        return self

    def __delitem__(self, index: slice) -> None:
        """Only ``del x[n:]`` (a cut of the tail) is supported."""
        if not isinstance(index, slice) or index.stop is not None or index.step not in (None, 1):
            raise TypeError("ByteChunks only cut their tail: del x[n:]")
        keep = index.indices(self._len)[0]
        if keep >= self._len:
            return
        pieces, pos = [], 0
        for piece in self._pieces:
            if pos + len(piece) <= keep:
                pieces.append(piece)
            elif pos < keep:
                pieces.append(piece[:keep - pos])
            pos += len(piece)
        self._pieces, self._len = tuple(pieces), keep

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ByteChunks):
            return bytes(self) == bytes(other)
        if isinstance(other, (bytes, bytearray, memoryview)):
            return bytes(self) == bytes(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ByteChunks({self._len} bytes in {len(self._pieces)} pieces)"
