"""Per-token data a slime job replays in training, carried with a trajectory across its segments.

Two kinds, as SGLang returns them and slime's ``Sample`` keeps them:

* **routed experts** (``--use-rollout-routing-replay``): for every position ``i`` of prompt + response
  but the last, the experts each MoE layer routed ``i`` to (``layers x topk`` int32): the routing
  of the forward pass whose logits at ``i`` sampled token ``i + 1``. SGLang sends positions
  ``[routed_experts_start_len, prompt + output - 1)`` as base64 of little-endian int32
  (``meta_info.routed_experts``), and honours ``routed_experts_start_len`` without echoing it.
* **top-p kept token ids** (``--rollout-top-p`` < 1, with slime's SGLang top-p patch): for every
  response token, the ids of the nucleus it was sampled from (``meta_info.top_p_token_ids`` and
  ``top_p_token_offsets``, base64 int32; slime's trainer renormalises its log-probs over them).
  With slime 0.4.0's score centering (``--use-score-centering``) also the sampler's log-prob of each
  kept id (``meta_info.top_p_log_probs``, base64 float32, aligned with the ids; slime's
  ``Sample.rollout_top_p_log_probs``).
* **sampler top-k** (score centering with top-p 1, ``--score-centering-top-k k``): for every
  response token, the ``k`` most likely ids and their log-probs under the distribution it was
  sampled from (SGLang's ``top_logprobs_num``: ``meta_info.output_top_logprobs``, or the binary
  ``output_topk_token_ids`` / ``output_topk_log_probs`` of slime's patched SGLang; slime's
  ``Sample.rollout_topk_token_ids`` / ``rollout_topk_log_probs``, ``[response, k]``).

**Stitching.** A resumed call sends prompt + partial response and generates the rest. Row ``i``
belongs to the segment that sampled token ``i + 1``, so rows ``[0, prompt + partial - 1)`` are the
earlier segments' and the resume supplies the others (it is asked for just those, with
``routed_experts_start_len``). The engine's own rows for old positions are never used: once a
weight update has flushed its prefix cache they are recomputed under the new weights and are not
the routing that generated those tokens. Top-p sets, their log-probs and the top-k rows are per
response token and simply concatenate, so each keeps the distribution of the version that sampled
its token.
A count that does not add up raises ``ValueError`` naming both sides; nothing is half-applied.

**Episodes** (a generate function's model calls, ``stitch_calls``). Every call is a trajectory of
its own, stitched over its segments as above. A returned sample's tokens run through its calls in
order: each call's input is the sample's tokens before that call's output. Row ``i`` of the sample
is the row of the first call (in the order the function made them, among the episode's calls that
ran a prefix of the sample) that ran position ``i``: the call that sampled token ``i + 1``, or, when
token ``i + 1`` was not generated (a tool's observation, loss-masked, or the prompt), the call that
read it as prompt (the next call, whose prefill ran it, under the version of that call's first
token). A call that continues an earlier call's tokens starts out holding that call's rows and asks
the engine only for the positions after them (``routed_experts_start_len``), so a conversation's
rows cross the wire once, not once per turn. Positions after the last call (an observation the
function appended and no call read) were run by no call: they repeat the last row that was run. No
trained token follows them, so with causal attention their routing cannot change any trained
token's loss.
The layout (row ``i`` = the forward pass at position ``i``, ``total tokens - 1`` rows) is slime's;
its own multi-turn path (each call asked from position 0, its rows replacing the sample's) ends
with the last call's rows everywhere, its prefill of earlier calls' tokens too, under newer weights
than generated them. Here each generated token keeps the routing it was sampled under, and an
observation gets the rows of the one call that ran it as prompt (for the last observation, the
rows slime's path gives it too).

**Storage.** Raw little-endian bytes: a Python list of ints would take about nine times the
memory. The routed experts are held as uint8 (rows x layers x topk bytes) when every expert id of
a trajectory's rows is below 256 (a MoE of up to 256 experts), a quarter of the int32 an engine
sends: each reply's rows are narrowed as they arrive, and a trajectory whose later reply holds an
id of 256 or more widens what it holds to int32 once and keeps int32 from then on
(``routed_itemsize`` says which). They are widened back to slime's int32 only where int32 is
handed out: the slime sample (``routed_int32``, ``stitch_calls``) and an agent's SGLang-format
reply (``core.front``). They are held as immutable pieces
(``core.columns.ByteChunks``): a reply adds a piece, so a buffer snapshot (taken every step) shares
them instead of copying (``to_dict(shared=True)``); ``to_dict()`` hands out ``bytes``, and the
checkpoint writes the pieces as raw arrays as they are held (``core.state_file``). ``from_dict``
reads bytes, pieces or base64 (a JSON checkpoint's); a state saved before rows were held as uint8
(no ``routed_itemsize``: int32 rows) is narrowed on load when its ids fit. Top-p
sets are kept as kept ids plus one count per token (concatenation and truncation need no offset
arithmetic); slime's offsets are their prefix sums. Log-probs are little-endian float32 bytes,
the dtype slime keeps them in.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_slime.core.columns import ByteChunks

INT32 = 4  # bytes per stored value (int32 and float32 alike)
UINT8 = 1  # bytes per routed expert id held narrowed (every id of the rows below 256)
# TokenReplay's arrays, in the order a checkpoint writes them
_ARRAYS = ("routed", "top_p_ids", "top_p_counts", "top_p_log_probs", "topk_ids", "topk_log_probs")


@dataclass(frozen=True)
class ReplaySpec:
    """What a job replays: routed experts of ``routed_layers x routed_topk`` per position (0: none),
    whether every response token carries its top-p kept ids (and, ``top_p_log_probs``, their
    sampler log-probs), and the width of its sampler top-k rows (0: none)."""

    routed_layers: int = 0
    routed_topk: int = 0
    top_p: bool = False
    top_p_log_probs: bool = False
    topk: int = 0

    @property
    def routed(self) -> bool:
        return self.routed_layers > 0

    @property
    def routed_width(self) -> int:
        """int32 values per routed-experts row."""
        return self.routed_layers * self.routed_topk

    @property
    def active(self) -> bool:
        return self.routed or self.top_p or self.topk > 0


NO_REPLAY = ReplaySpec()


# ---------------------------------------------------------------- int32 bytes
# Engines send these arrays little-endian; ``array`` holds them in the machine's order.
def _le_values(raw: bytes | bytearray, typecode: str) -> array:
    values = array(typecode)
    values.frombytes(bytes(raw))
    if sys.byteorder == "big":
        values.byteswap()
    return values


def _le_bytes(values: Any, typecode: str) -> bytes:
    out = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    if sys.byteorder == "big":
        out = array(typecode, out)
        out.byteswap()
    return out.tobytes()


def int32_values(raw: bytes | bytearray) -> array:
    """Little-endian int32 bytes -> ``array('i')`` (native order)."""
    return _le_values(raw, "i")


def int32_bytes(values: Any) -> bytes:
    """Integers -> little-endian int32 bytes."""
    return _le_bytes(values, "i")


def decode_int32(value: Any, what: str) -> bytes:
    """An int32 array as an engine sends it (base64 of little-endian int32, or a list of ints) ->
    little-endian bytes. Raises ``ValueError`` naming ``what``."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise ValueError(f"{what} is not base64: {e}") from None
        if len(raw) % INT32:
            raise ValueError(f"{what} holds {len(raw)} bytes, not whole int32 values")
        return raw
    if isinstance(value, list) and all(type(v) is int for v in value):
        try:
            return int32_bytes(value)
        except OverflowError:
            raise ValueError(f"{what} holds a value outside int32") from None
    raise ValueError(f"{what} is neither base64 nor a list of integers: {type(value).__name__}")


def decode_float32(value: Any, what: str) -> bytes:
    """A float32 array as an engine sends it (base64 of little-endian float32, or a list of
    numbers) -> little-endian bytes. Raises ``ValueError`` naming ``what``."""
    if isinstance(value, str):
        return decode_int32(value, what)  # the same 4-byte framing
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return float32_bytes(value)
    raise ValueError(f"{what} is neither base64 nor a list of numbers: {type(value).__name__}")


def decode_log_probs(value: Any, what: str, count: int, tolerance: float) -> bytes:
    """``count`` finite log-probabilities (at most ``tolerance`` above 0) as an engine sends them
    -> little-endian float32 bytes. Raises ``ValueError`` naming ``what``."""
    raw = decode_float32(value, what)
    values = float32_values(raw)
    if len(values) != count or (count and not (math.isfinite(sum(values)) and max(values) <= tolerance)):
        raise ValueError(f"{what} holds {len(values)} values, not {count} finite log-probabilities")
    return raw


def float32_values(raw: bytes | bytearray) -> array:
    """Little-endian float32 bytes -> ``array('f')`` (native order)."""
    return _le_values(raw, "f")


def float32_bytes(values: Any) -> bytes:
    """Numbers -> little-endian float32 bytes."""
    return _le_bytes(values, "f")


def fits_uint8(raw: bytes | bytearray | memoryview) -> bool:
    """Whether every value of little-endian int32 ``raw`` is an expert id in [0, 256)."""
    values = np.frombuffer(raw, "<i4")
    return not len(values) or (int(values.min()) >= 0 and int(values.max()) < 256)


def narrowed(raw: bytes | bytearray | memoryview) -> bytes:
    """Little-endian int32 ids that fit a byte (``fits_uint8``) -> one byte each."""
    return np.frombuffer(raw, "<i4").astype(np.uint8).tobytes()


def widened(raw: bytes | bytearray | memoryview, itemsize: int) -> bytes:
    """Routed-experts ids held ``itemsize`` bytes each -> little-endian int32 bytes (slime's dtype)."""
    if itemsize == INT32:
        return bytes(raw)
    return np.frombuffer(raw, np.uint8).astype("<i4").tobytes()


def _read(value: str | bytes | memoryview | tuple | None, what: str, itemsize: int = INT32) -> ByteChunks | None:
    """A saved array of ``itemsize``-byte values (int32, float32, uint8 routed experts): ``bytes``
    or a snapshot's pieces (an in-memory state, read without a copy) or base64 (a JSON checkpoint
    file)."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview, tuple)):
        raw = ByteChunks(value)
        if len(raw) % itemsize:
            raise ValueError(f"{what} holds {len(raw)} bytes, not whole int32 values")
        return raw
    if itemsize == UINT8 and isinstance(value, str):
        try:
            return ByteChunks(base64.b64decode(value.encode("ascii"), validate=True))
        except (binascii.Error, UnicodeEncodeError) as e:
            raise ValueError(f"{what} is not base64: {e}") from None
    return ByteChunks(decode_int32(value, what))


# ---------------------------------------------------------------- one reply, one trajectory
@dataclass
class SegmentReplay:
    """What one reply adds: the routed experts of positions ``[routed_start, input + output - 1)``,
    the top-p kept ids of each output token (ids, one count per token, and the ids' log-probs),
    and the ``topk`` sampler top-k ids and log-probs of each output token."""

    routed_start: int = 0
    routed: bytes | None = None
    routed_width: int = 0
    top_p_ids: bytes | None = None
    top_p_counts: bytes | None = None
    top_p_log_probs: bytes | None = None
    topk: int = 0
    topk_ids: bytes | None = None
    topk_log_probs: bytes | None = None


@dataclass
class TokenReplay:
    """A trajectory's replay data: routed experts of positions ``[0, routed_rows)`` (``routed_width``
    ids per row, each ``routed_itemsize`` bytes: 1 for uint8, 4 for int32), the top-p kept ids (and
    their log-probs) of its first ``top_p_tokens`` response tokens, and the sampler top-k rows
    (``topk`` ids and log-probs) of its first ``topk_tokens``.

    Assigning raw bytes (not ``ByteChunks`` or a snapshot's pieces) to ``routed`` means int32 rows,
    as an engine sends them: ``routed_itemsize`` becomes 4 (``narrow_routed`` narrows them)."""

    routed_width: int = 0
    routed: ByteChunks | None = None
    top_p_ids: ByteChunks | None = None
    top_p_counts: ByteChunks | None = None
    top_p_log_probs: ByteChunks | None = None
    topk: int = 0
    topk_ids: ByteChunks | None = None
    topk_log_probs: ByteChunks | None = None
    routed_itemsize: int = INT32  # bytes per routed expert id held: UINT8 or INT32

    def __setattr__(self, name: str, value: Any) -> None:
        # every array is held as immutable pieces, whatever a caller assigns (bytes, a bytearray):
        # the checkpoint's snapshots share them (core.columns)
        if name in _ARRAYS and value is not None and not isinstance(value, ByteChunks):
            if name == "routed" and not isinstance(value, tuple):  # raw bytes: int32 rows
                object.__setattr__(self, "routed_itemsize", INT32)
            value = ByteChunks(value)
        object.__setattr__(self, name, value)

    @property
    def routed_rows(self) -> int:
        if not self.routed or not self.routed_width:
            return 0
        return len(self.routed) // (self.routed_itemsize * self.routed_width)

    def routed_int32(self, start: int = 0, stop: int | None = None) -> bytes:
        """The routed experts of positions ``[start, stop)`` (default: to the last held) as slime
        and SGLang hand them out: little-endian int32, whatever they are held as."""
        if self.routed is None:
            return b""
        row = self.routed_width * self.routed_itemsize
        stop = self.routed_rows if stop is None else stop
        return widened(self.routed[start * row:stop * row], self.routed_itemsize)

    def narrow_routed(self) -> None:
        """Hold int32 routed rows as uint8 when every id fits (a no-op otherwise)."""
        if self.routed is None or self.routed_itemsize != INT32:
            return
        raw = bytes(self.routed)
        if fits_uint8(raw):
            object.__setattr__(self, "routed", ByteChunks(narrowed(raw)))
            object.__setattr__(self, "routed_itemsize", UINT8)

    @property
    def top_p_tokens(self) -> int:
        return len(self.top_p_counts) // INT32 if self.top_p_counts is not None else 0

    @property
    def topk_tokens(self) -> int:
        return len(self.topk_ids) // (INT32 * self.topk) if self.topk_ids is not None and self.topk else 0

    def covers(self, spec: ReplaySpec, prompt_len: int, response_len: int) -> str | None:
        """None when this holds what ``spec`` asks for a trajectory of that length, else what is
        missing, in words."""
        if spec.routed:
            want = prompt_len + response_len - 1 if response_len else 0
            if self.routed is None or self.routed_width != spec.routed_width:
                if want:
                    return f"no routed experts of {spec.routed_layers}x{spec.routed_topk} per position"
            elif self.routed_rows != want:
                return f"routed experts of {self.routed_rows} positions, not {want}"
        if spec.top_p and self.top_p_tokens != response_len:
            return f"top-p kept ids of {self.top_p_tokens} response tokens, not {response_len}"
        if spec.top_p_log_probs and response_len and (self.top_p_log_probs is None
                                                      or len(self.top_p_log_probs) != len(self.top_p_ids)):
            return "top-p kept ids without their log-probs"
        if spec.topk and response_len and (self.topk != spec.topk or self.topk_tokens != response_len):
            return (f"sampler top-{self.topk} rows of {self.topk_tokens} response tokens, not top-{spec.topk} "
                    f"of {response_len}")
        return None

    def extend(self, seg: SegmentReplay, *, input_len: int, response_len: int, new_tokens: int) -> None:
        """Add one reply of ``new_tokens`` tokens to a trajectory that held ``response_len``
        response tokens and sent ``input_len`` ids. Checked whole before anything changes."""
        if new_tokens == 0:
            return
        routed = None
        if seg.routed is not None:
            if self.routed_width != seg.routed_width and self.routed_rows:
                raise ValueError(f"routed experts of {seg.routed_width} int32 per position for a trajectory "
                                 f"that holds rows of {self.routed_width}")
            width = seg.routed_width * INT32
            held = self.routed_rows
            keep = min(held, input_len - 1)
            if response_len and held < input_len - 1:
                raise ValueError(f"routed experts are held for {held} of the {input_len - 1} positions "
                                 "before this call; the generated tokens' routing is unknown")
            end = input_len + new_tokens - 1
            rows = len(seg.routed) // width
            if seg.routed_start > keep or seg.routed_start + rows != end:
                raise ValueError(f"routed experts of positions [{seg.routed_start}, {seg.routed_start + rows}) "
                                 f"do not continue the {keep} positions held up to position {end}")
            routed = (keep, seg.routed[(keep - seg.routed_start) * width:])
        if seg.top_p_counts is not None:
            if len(seg.top_p_counts) != new_tokens * INT32:
                raise ValueError(f"top-p kept ids of {len(seg.top_p_counts) // INT32} tokens for "
                                 f"{new_tokens} new tokens")
            if self.top_p_tokens != response_len:
                raise ValueError(f"top-p kept ids are held for {self.top_p_tokens} of the {response_len} "
                                 "response tokens before this call")
            held_log_probs = self.top_p_log_probs is not None or not response_len
            if seg.top_p_log_probs is not None and (len(seg.top_p_log_probs) != len(seg.top_p_ids or b"")
                                                    or not held_log_probs):
                raise ValueError("top-p log-probs that do not pair with the kept ids")
        if seg.topk_ids is not None:
            if not seg.topk or len(seg.topk_ids) != new_tokens * seg.topk * INT32 or len(
                    seg.topk_log_probs or b"") != len(seg.topk_ids):
                raise ValueError(f"sampler top-{seg.topk} rows that do not cover {new_tokens} new tokens")
            if self.topk_tokens != response_len or (response_len and self.topk != seg.topk):
                raise ValueError(f"sampler top-{self.topk} rows are held for {self.topk_tokens} of the "
                                 f"{response_len} response tokens before this top-{seg.topk} call")
        if routed is not None:
            self._add_routed(seg.routed_width, *routed)
        if seg.top_p_counts is not None:
            if self.top_p_counts is None:
                self.top_p_ids, self.top_p_counts = ByteChunks(), ByteChunks()
            self.top_p_ids += seg.top_p_ids or b""
            self.top_p_counts += seg.top_p_counts
            if seg.top_p_log_probs is not None:
                if self.top_p_log_probs is None:
                    self.top_p_log_probs = ByteChunks()
                self.top_p_log_probs += seg.top_p_log_probs
        if seg.topk_ids is not None:
            self.topk = seg.topk
            if self.topk_ids is None:
                self.topk_ids, self.topk_log_probs = ByteChunks(), ByteChunks()
            self.topk_ids += seg.topk_ids
            self.topk_log_probs += seg.topk_log_probs

    def _add_routed(self, width: int, keep: int, rows: bytes) -> None:
        """Keep the first ``keep`` rows held and append ``rows`` (int32, checked by ``extend``):
        as uint8 when what is kept is uint8 (or nothing) and the new ids fit, else as int32, the
        kept rows widened once if they were uint8."""
        kept = self.routed if self.routed is not None and keep else ByteChunks()
        itemsize = self.routed_itemsize if keep else UINT8
        del kept[keep * width * itemsize:]
        if itemsize == UINT8 and fits_uint8(rows):
            rows = narrowed(rows)
        elif itemsize == UINT8:  # an id of 256 or more: int32 from here on
            kept, itemsize = ByteChunks(widened(bytes(kept), UINT8)), INT32
        kept += rows
        object.__setattr__(self, "routed", kept)
        object.__setattr__(self, "routed_itemsize", itemsize)
        self.routed_width = width

    def truncate(self, prompt_len: int, response_len: int) -> None:
        """Keep what covers the first ``response_len`` response tokens."""
        if self.routed is not None:
            rows = prompt_len + response_len - 1 if response_len else 0
            del self.routed[rows * self.routed_width * self.routed_itemsize:]
        if self.top_p_counts is not None:
            counts = int32_values(self.top_p_counts[:response_len * INT32])
            del self.top_p_counts[response_len * INT32:]
            del self.top_p_ids[sum(counts) * INT32:]
            if self.top_p_log_probs is not None:
                del self.top_p_log_probs[sum(counts) * INT32:]
        if self.topk_ids is not None:
            del self.topk_ids[response_len * self.topk * INT32:]
            del self.topk_log_probs[response_len * self.topk * INT32:]

    def top_p_offsets(self) -> list[int]:
        """slime's ``rollout_top_p_token_offsets``: 0, then the running total of kept ids."""
        offsets, total = [0], 0
        for count in int32_values(self.top_p_counts or b""):
            total += count
            offsets.append(total)
        return offsets

    def to_dict(self, *, shared: bool = False) -> dict[str, Any]:
        """Plain data but for the arrays, which are ``bytes`` (see the module docstring); with
        ``shared``, the arrays' immutable pieces themselves (a snapshot's: no copy)."""
        out: dict[str, Any] = {"routed_width": self.routed_width, "routed_itemsize": self.routed_itemsize,
                               "topk": self.topk}
        for name in _ARRAYS:
            raw = getattr(self, name)
            out[name] = None if raw is None else (raw.frozen() if shared else bytes(raw))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenReplay:
        itemsize = d.get("routed_itemsize", INT32)
        if itemsize not in (UINT8, INT32):
            raise ValueError(f"replay.routed_itemsize: {itemsize!r}, not {UINT8} (uint8) or {INT32} (int32)")
        replay = cls(routed_width=int(d.get("routed_width", 0)), routed_itemsize=itemsize,
                     routed=_read(d.get("routed"), "replay.routed", itemsize),
                     top_p_ids=_read(d.get("top_p_ids"), "replay.top_p_ids"),
                     top_p_counts=_read(d.get("top_p_counts"), "replay.top_p_counts"),
                     top_p_log_probs=_read(d.get("top_p_log_probs"), "replay.top_p_log_probs"),
                     topk=int(d.get("topk", 0)), topk_ids=_read(d.get("topk_ids"), "replay.topk_ids"),
                     topk_log_probs=_read(d.get("topk_log_probs"), "replay.topk_log_probs"))
        if replay.routed is not None and (not replay.routed_width
                                          or len(replay.routed) % (itemsize * replay.routed_width)):
            raise ValueError(f"replay.routed: {len(replay.routed)} bytes are not rows of "
                             f"{replay.routed_width} {'uint8' if itemsize == UINT8 else 'int32'}")
        if "routed_itemsize" not in d:  # saved before rows were held narrowed: int32
            replay.narrow_routed()
        if (replay.top_p_ids is None) != (replay.top_p_counts is None):
            raise ValueError("replay: top-p kept ids without their counts (or the reverse)")
        if replay.top_p_counts is not None and sum(int32_values(replay.top_p_counts)) * INT32 != len(
                replay.top_p_ids):
            raise ValueError("replay: top-p counts do not add up to the kept ids")
        if replay.top_p_log_probs is not None and len(replay.top_p_log_probs) != len(replay.top_p_ids or b""):
            raise ValueError("replay: top-p log-probs do not pair with the kept ids")
        if (replay.topk_ids is None) != (replay.topk_log_probs is None) or replay.topk_ids is not None and (
                not replay.topk or len(replay.topk_ids) % (INT32 * replay.topk)
                or len(replay.topk_log_probs) != len(replay.topk_ids)):
            raise ValueError(f"replay: sampler top-k ids and log-probs are not rows of {replay.topk}")
        return replay


def stitch_calls(width: int, rows: int, calls: list[TokenReplay | None]) -> bytearray:
    """The ``rows`` routed-experts rows of a sample whose model calls (in order, each holding the
    rows it ran: ``[0, input + output - 1)`` of the sample) are ``calls``: row ``i`` from the first
    call that ran it, positions no call ran repeating the last row that was (module docstring).
    ``ValueError`` naming the call when one holds no rows of ``width`` or more rows than the sample."""
    out = bytearray()
    held = 0
    row_bytes = width * INT32
    for n, replay in enumerate(calls):
        if replay is None or replay.routed is None or replay.routed_width != width:
            raise ValueError(f"model call {n} holds no routed experts of {width} int32 per position")
        ran = replay.routed_rows
        if ran > rows:
            raise ValueError(f"model call {n} ran {ran} positions of a sample of {rows + 1} tokens")
        if ran > held:
            out += replay.routed_int32(held, ran)
            held = ran
    if rows and not held:
        raise ValueError("no model call ran any position of the sample")
    out += bytes(out[(held - 1) * row_bytes:held * row_bytes]) * (rows - held) if rows > held else b""
    return out
