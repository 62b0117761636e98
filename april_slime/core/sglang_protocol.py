"""SGLang's native generate protocol as the rollout core reads it: the records a reply becomes,
their validation, and the errors an engine call can end in.

Every reply is checked here before it reaches a trajectory: a reply that breaks the protocol or is
plausible but wrong (missing keys, count mismatch, NaN or positive log-prob, a token id outside the
vocabulary, another request's id, per-token version spans that do not cover the output) raises
``EngineReplyError`` instead of poisoning a trajectory, and token ids about to be sent are checked
against the vocabulary (on SGLang one out-of-vocabulary input id kills the whole engine). The
client (``engine.py``) calls these parsers on every reply it receives; nothing here does I/O.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from april_slime.core.replay import (
    INT32,
    NO_REPLAY,
    ReplaySpec,
    SegmentReplay,
    decode_int32,
    decode_log_probs,
    float32_bytes,
    int32_bytes,
    int32_values,
)

FINISH_REASONS = ("stop", "length", "abort")


# Engines compute log-probs in float32; a log-softmax can come out a hair above 0. Anything above
# this is not a log-probability.
LOGPROB_TOLERANCE = 1e-4


class EngineError(RuntimeError):
    """An engine call failed; the message names the engine and the reason."""


class EngineUnavailable(EngineError):
    """Connection errors, HTTP 5xx or timeouts that outlasted every retry."""


class EngineReplyError(EngineError):
    """The engine answered, but the reply breaks the protocol (missing keys, counts, NaN)."""


class RequestRejected(EngineError):
    """The request itself is wrong: the engine answered HTTP 4xx (``status``), or the client
    refused to send it (``status`` None; e.g. a token id outside the vocabulary). Resending the
    same request, to this engine or another, cannot help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    weight_version: int  # the engine's version when the reply was made
    prompt_tokens: int | None  # None: aborted while still queued (SGLang then omits it)
    completion_tokens: int
    engine_url: str
    # policy version of every output token, run-length encoded [[version, count], ...]; from
    # meta_info.weight_versions when the engine sends it, else every token gets weight_version
    version_runs: list[list[int]] | None = None
    retractions: int = 0  # meta_info.num_retractions: times the engine retracted this request
    # what the job replays in training (routed experts, top-p kept ids), when it asked for it
    replay: SegmentReplay | None = None

    def __post_init__(self) -> None:
        if self.version_runs is None:
            self.version_runs = [[self.weight_version, len(self.output_ids)]] if self.output_ids else []


@dataclass
class EngineLoad:
    url: str
    num_running: int
    num_waiting: int
    used_tokens: int
    capacity_tokens: int
    # cumulative since the engine started (the emulator's /v1/loads); SGLang 0.5.23 reports
    # retractions only per request, so there it is the sum of meta_info.num_retractions over the
    # replies this client received from the engine
    retractions: int


def parse_weight_version(value: Any, where: str) -> int:
    if value is None:
        raise EngineReplyError(
            f"{where}: reply carries no weight_version; the engine must be an SGLang build that "
            "reports weight versions (meta_info.weight_version and /get_weight_version)"
        )
    if isinstance(value, bool):
        raise EngineReplyError(f"{where}: weight_version {value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        # SGLang's --weight-version defaults to the string "default" until the trainer pushes its
        # first update; slime counts weight versions from 0, so that is version 0.
        if value == "default":
            return 0
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise EngineReplyError(f"{where}: weight_version {value!r} is not an integer")


def _require_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineReplyError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def _split_logprob_triples(triples: list, where: str) -> tuple[list[float], list[int]]:
    """``[[logprob, token_id, text], ...]`` -> (log-probs, token ids), every entry checked.

    Replies run to tens of thousands of tokens, so the common well-formed case is checked with
    whole-list operations (a sum is finite only if every term is); anything unusual goes through
    the per-position loop, which names the first bad position.
    """
    if all(type(t) is list and len(t) >= 2 and type(t[0]) is float and type(t[1]) is int
           for t in triples):
        logprobs = [t[0] for t in triples]
        if math.isfinite(sum(logprobs)) and (not logprobs or max(logprobs) <= LOGPROB_TOLERANCE):
            return logprobs, [t[1] for t in triples]
    logprobs, token_ids = [], []
    for pos, triple in enumerate(triples):
        if not isinstance(triple, (list, tuple)) or len(triple) < 2:
            raise EngineReplyError(
                f"{where}: output_token_logprobs[{pos}] is not a [logprob, token_id, text] triple: "
                f"{triple!r}"
            )
        logprob, token_id = triple[0], triple[1]
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise EngineReplyError(f"{where}: log-prob at position {pos} is {logprob!r}")
        try:
            value = float(logprob)
        except OverflowError:  # an integer beyond any double
            value = math.inf
        if not math.isfinite(value):
            raise EngineReplyError(f"{where}: log-prob at position {pos} is not finite ({logprob})")
        if value > LOGPROB_TOLERANCE:
            raise EngineReplyError(
                f"{where}: log-prob at position {pos} is {logprob} > 0, not a log-probability"
            )
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise EngineReplyError(f"{where}: token id at position {pos} is {token_id!r}")
        logprobs.append(value)
        token_ids.append(token_id)
    return logprobs, token_ids


def check_token_ids(ids: list[int], vocab_size: int | None, what: str) -> None:
    """Every id must be an int in ``[0, vocab_size)`` (any int >= 0 when the size is unknown).
    Raises ``ValueError`` naming the first bad position."""
    if not ids:
        return
    # Inputs run to tens of thousands of ids: the common case is checked in C (a count of exact
    # types, then the bounds of an int64 array); anything else goes through the loop below.
    if list(map(type, ids)).count(int) == len(ids):
        try:
            as_int64 = np.frombuffer(array("q", ids), dtype=np.int64)
            low, high = as_int64.min(), as_int64.max()
        except OverflowError:  # beyond int64: out of any vocabulary, but fine for an unknown one
            low, high = min(ids), max(ids)
        if low >= 0 and (vocab_size is None or high < vocab_size):
            return
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (
                vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{what}: token id {t!r} at position {pos} is not an integer in {bound}")


# ------------------------------------------------------------------------ a reply's output tokens
# A reply carries an id and a log-prob for every output token, twice over for the ids (output_ids
# and the triples): tens of thousands of items. Checked one by one in Python they cost several times
# the JSON decoding, so the common well-formed case is checked with whole-list operations that run
# in C (counts of exact types, int64/float64 arrays, numpy reductions). A reply they cannot vouch
# for goes through the reference checks, which name what is wrong at its first position. Both
# accept the same replies and return the same lists (tests/test_reply_tokens.py).


@dataclass(frozen=True, eq=False)
class LogprobArrays:
    """``meta_info.output_token_logprobs`` of an in-process reply: the log-probs (float64) and
    token ids (int64) as two aligned arrays instead of ``[[logprob, token_id, text], ...]``.

    Not SGLang's wire form, which is JSON: an engine that lives in the client's process (the
    emulator on its virtual clock) hands these over, with the reply's ``output_ids`` as an int64
    array too, so a reply costs no Python object per token until the client builds its lists.
    ``to_triples`` is what the same reply says on the wire."""

    logprobs: np.ndarray
    token_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_triples(self) -> list[list]:
        return list(map(list, zip(self.logprobs.tolist(), self.token_ids.tolist(), repeat(None))))


def output_tokens(output_ids: Any, triples: Any, vocab_size: int | None,
                  where: str) -> tuple[list[int], list[float]]:
    """A reply's ``output_ids`` (None: the engine sent only the triples) and
    ``meta_info.output_token_logprobs`` (a list of triples, or ``LogprobArrays``) -> (token ids,
    log-probs) as fresh lists, once every per-token check has passed: triples well formed,
    log-probs finite and <= ``LOGPROB_TOLERANCE``, ids integers in ``[0, vocab_size)``, the same
    ids in both places. Raises ``EngineReplyError`` naming the first bad position."""
    if isinstance(triples, LogprobArrays):
        checked = _checked_arrays(output_ids, triples, vocab_size)
        if checked is not None:
            return checked
        # the wire form of the same reply, for the reference checks to name the problem
        triples = triples.to_triples()
        if isinstance(output_ids, np.ndarray):
            output_ids = output_ids.tolist()
    else:
        checked = _checked_lists(output_ids, triples, vocab_size)
        if checked is not None:
            return checked
    return _checked_one_by_one(output_ids, triples, vocab_size, where)


def _checked_lists(output_ids: Any, triples: Any, vocab_size: int | None) -> tuple[list[int], list[float]] | None:
    """``output_tokens`` for lists of triples, as JSON decodes them, in whole-list operations;
    None unless every check passes (types are counted exactly, so a bool, a float id or an int
    log-prob is left to the reference checks)."""
    if type(triples) is not list:
        return None
    n = len(triples)
    if list(map(type, triples)).count(list) != n:
        return None
    try:
        logprobs = [t[0] for t in triples]
        triple_ids = [t[1] for t in triples]
    except IndexError:  # a triple of fewer than two items
        return None
    if list(map(type, logprobs)).count(float) != n or list(map(type, triple_ids)).count(int) != n:
        return None
    if output_ids is None:
        output_ids = triple_ids
    elif (not isinstance(output_ids, list) or list(map(type, output_ids)).count(int) != n
          or output_ids != triple_ids):
        return None
    if n:
        as_float64 = np.frombuffer(array("d", logprobs), dtype=np.float64)
        if not (np.isfinite(as_float64).all() and as_float64.max() <= LOGPROB_TOLERANCE):
            return None
        try:
            as_int64 = np.frombuffer(array("q", output_ids), dtype=np.int64)
        except OverflowError:
            return None
        if not _ids_in_vocab(as_int64, vocab_size):
            return None
    return list(output_ids), logprobs


def _checked_arrays(output_ids: Any, arrays: LogprobArrays,
                    vocab_size: int | None) -> tuple[list[int], list[float]] | None:
    """``output_tokens`` for ``LogprobArrays`` (and ``output_ids`` as an int64 array or None);
    None unless every check passes."""
    logprobs, ids = arrays.logprobs, arrays.token_ids
    if not (isinstance(logprobs, np.ndarray) and logprobs.dtype == np.float64 and logprobs.ndim == 1
            and isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.shape == logprobs.shape):
        return None
    if output_ids is not None and not (isinstance(output_ids, np.ndarray) and output_ids.dtype == np.int64
                                       and np.array_equal(output_ids, ids)):
        return None
    if len(ids) and not (np.isfinite(logprobs).all() and logprobs.max() <= LOGPROB_TOLERANCE
                         and _ids_in_vocab(ids, vocab_size)):
        return None
    return ids.tolist(), logprobs.tolist()


def _ids_in_vocab(ids: np.ndarray, vocab_size: int | None) -> bool:
    return bool(ids.min() >= 0 and (vocab_size is None or ids.max() < vocab_size))


def _checked_one_by_one(output_ids: Any, triples: Any, vocab_size: int | None,
                        where: str) -> tuple[list[int], list[float]]:
    """The reference checks of ``output_tokens``: item by item, raising at the first bad one."""
    logprobs, triple_ids = _split_logprob_triples(triples, where)
    if output_ids is None:
        output_ids = triple_ids
    elif not isinstance(output_ids, list) or not all(type(t) is int for t in output_ids):
        raise EngineReplyError(f"{where}: output_ids is not a list of integers")
    if len(output_ids) != len(triples):
        raise EngineReplyError(
            f"{where}: {len(output_ids)} output_ids but {len(triples)} output_token_logprobs"
        )
    if output_ids != triple_ids:
        pos = next(i for i, (a, b) in enumerate(zip(output_ids, triple_ids)) if a != b)
        raise EngineReplyError(
            f"{where}: output_token_logprobs[{pos}] is for token {triple_ids[pos]}, "
            f"output_ids has {output_ids[pos]}"
        )
    try:
        check_token_ids(output_ids, vocab_size, f"{where}: output_ids")
    except ValueError as exc:
        raise EngineReplyError(str(exc)) from None
    return list(output_ids), logprobs


def _parse_version_spans(spans: Any, n: int, where: str) -> list[list[int]]:
    """SGLang's ``meta_info.weight_versions`` -> ``[[version, count], ...]`` over ``n`` output
    tokens. The spans must tile ``[0, n)`` in order (empty spans allowed)."""
    if not isinstance(spans, list) or not spans:
        raise EngineReplyError(f"{where}: meta_info.weight_versions is not a non-empty list: {spans!r}")
    runs: list[list[int]] = []
    pos = 0
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            raise EngineReplyError(f"{where}: weight_versions[{i}] is not an object: {span!r}")
        start, end = span.get("start"), span.get("end")
        if (isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int)
                or not isinstance(end, int) or start != pos or end < start or end > n):
            raise EngineReplyError(
                f"{where}: weight_versions[{i}] = {span!r} does not continue the spans at token "
                f"{pos} within {n} output tokens"
            )
        version = parse_weight_version(span.get("version"), f"{where} weight_versions[{i}]")
        if end > start:
            if runs and runs[-1][0] == version:
                runs[-1][1] += end - start
            else:
                runs.append([version, end - start])
        pos = end
    if pos != n:
        raise EngineReplyError(f"{where}: weight_versions cover {pos} of {n} output tokens")
    return runs


def parse_generate_reply(
    reply: Any, *, engine_url: str, rid: str, max_new_tokens: int, vocab_size: int | None = None,
    replay: ReplaySpec = NO_REPLAY, input_len: int = 0, routed_start: int = 0,
) -> GenerateResult:
    """Validate one SGLang ``/generate`` reply and turn it into a ``GenerateResult``. With a
    ``replay`` spec, the reply must carry what it names (``parse_replay``) for the ``input_len``
    ids sent, the routed experts from position ``routed_start`` on."""
    where = f"engine {engine_url} rid {rid}"
    if not isinstance(reply, dict):
        raise EngineReplyError(f"{where}: reply is a {type(reply).__name__}, not a JSON object")
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineReplyError(f"{where}: reply has no meta_info object")
    reply_rid = meta.get("id")
    if reply_rid is not None and reply_rid != rid:
        raise EngineReplyError(f"{where}: reply belongs to another request (meta_info.id={reply_rid!r})")

    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else None
    if finish_type not in FINISH_REASONS:
        raise EngineReplyError(
            f"{where}: meta_info.finish_reason must be an object with type in {FINISH_REASONS}, "
            f"got {finish!r}"
        )

    triples = meta.get("output_token_logprobs")
    if triples is None and finish_type == "abort" and not reply.get("output_ids"):
        triples = []  # aborted before any token: some builds send no log-prob list at all
    if not isinstance(triples, (list, LogprobArrays)):
        raise EngineReplyError(
            f"{where}: meta_info.output_token_logprobs missing or not a list (was the request sent "
            "with return_logprob=true?)"
        )
    output_ids, logprobs = output_tokens(reply.get("output_ids"), triples, vocab_size, where)

    completion = meta.get("completion_tokens")
    if completion is None and finish_type == "abort" and not output_ids:
        completion = 0
    completion_tokens = _require_int(completion, "completion_tokens", where)
    if completion_tokens != len(output_ids):
        raise EngineReplyError(
            f"{where}: completion_tokens={completion_tokens} but {len(output_ids)} tokens returned"
        )
    if len(output_ids) > max_new_tokens:
        raise EngineReplyError(
            f"{where}: {len(output_ids)} tokens returned, more than max_new_tokens={max_new_tokens}"
        )
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None or finish_type != "abort" or output_ids:
        # only a request aborted while still queued comes back without prompt_tokens
        prompt_tokens = _require_int(prompt_tokens, "prompt_tokens", where)
    weight_version = parse_weight_version(meta.get("weight_version"), where)
    retractions = meta.get("num_retractions", 0)
    if isinstance(retractions, bool) or not isinstance(retractions, int) or retractions < 0:
        retractions = 0  # informational only; never a reason to drop a reply
    spans = meta.get("weight_versions")
    version_runs = (_parse_version_spans(spans, len(output_ids), where) if spans is not None
                    else None)

    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish_type,
        weight_version=weight_version,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        engine_url=engine_url,
        version_runs=version_runs,
        retractions=retractions,
        replay=(parse_replay(meta, where, replay, input_len=input_len, output_len=len(output_ids),
                             routed_start=routed_start, vocab_size=vocab_size) if replay.active else None),
    )


# ------------------------------------------------------------------ replay data (core.replay)
TOP_P_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")  # slime reads either name
TOP_P_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def ask_for_replay(payload: dict, spec: ReplaySpec, routed_start: int) -> None:
    """Add to a ``/generate`` payload what ``spec`` replays: the routed experts of the positions
    from ``routed_start`` on, (slime's top-p patch) the top-p kept ids of every token and their
    log-probs, and the sampler top-k of every token (``top_logprobs_num``, as slime 0.4.0's
    ``slime/utils/score_centering.py`` asks)."""
    if spec.routed:
        payload["return_routed_experts"] = True
        if routed_start:
            payload["routed_experts_start_len"] = routed_start
    if spec.top_p:
        params = payload["sampling_params"]
        asked = {"return_top_p_token_ids": True, **({"return_top_p_log_probs": True} if spec.top_p_log_probs else {})}
        params["custom_params"] = {**(params.get("custom_params") or {}), **asked}
    if spec.topk:
        payload["return_logprob"] = True
        payload["top_logprobs_num"] = spec.topk


def parse_replay(meta: dict, where: str, spec: ReplaySpec, *, input_len: int, output_len: int,
                 routed_start: int, vocab_size: int | None) -> SegmentReplay | None:
    """The replay data of a reply of ``output_len`` tokens (None without tokens: an abort before
    the first token says nothing about any position)."""
    if output_len == 0:
        return None
    seg = SegmentReplay(routed_start=routed_start, routed_width=spec.routed_width)
    if spec.routed:
        seg.routed = parse_routed_experts(meta, where, spec, input_len=input_len, output_len=output_len,
                                          start=routed_start)
    if spec.top_p:
        seg.top_p_ids, seg.top_p_counts = parse_top_p_token_ids(meta, where, output_len=output_len,
                                                                vocab_size=vocab_size)
        if spec.top_p_log_probs:
            seg.top_p_log_probs = _log_probs(meta, "top_p_log_probs", where, len(seg.top_p_ids) // INT32)
    if spec.topk:
        seg.topk = spec.topk
        seg.topk_ids, seg.topk_log_probs = parse_sampler_topk(meta, where, k=spec.topk, output_len=output_len,
                                                              vocab_size=vocab_size)
    return seg


def _log_probs(meta: dict, key: str, where: str, count: int) -> bytes:
    try:
        return decode_log_probs(meta.get(key), f"meta_info.{key}", count, LOGPROB_TOLERANCE)
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e} (slime's score centering needs the sampler's log-probs)") from None


def parse_sampler_topk(meta: dict, where: str, *, k: int, output_len: int,
                       vocab_size: int | None) -> tuple[bytes, bytes]:
    """The sampler's top-``k`` of every output token -> (ids int32, log-probs float32), rows in the
    engine's order: slime's patched SGLang sends ``output_topk_token_ids`` / ``_log_probs`` (base64,
    ``output_topk_shape`` [tokens, k]); stock SGLang ``output_top_logprobs`` (per token, ``k``
    ``[logprob, token_id, text]`` triples)."""
    if meta.get("output_topk_token_ids") is not None:
        if meta.get("output_topk_shape") != [output_len, k]:
            raise EngineReplyError(f"{where}: meta_info.output_topk_shape {meta.get('output_topk_shape')!r} is not "
                                   f"[{output_len}, {k}]")
        try:
            ids_raw = decode_int32(meta["output_topk_token_ids"], "meta_info.output_topk_token_ids")
        except ValueError as e:
            raise EngineReplyError(f"{where}: {e}") from None
        ids = list(int32_values(ids_raw))
        log_probs_raw = _log_probs(meta, "output_topk_log_probs", where, output_len * k)
    else:
        rows = meta.get("output_top_logprobs")
        if not isinstance(rows, list) or len(rows) != output_len or any(
                not isinstance(row, list) or len(row) != k for row in rows):
            raise EngineReplyError(f"{where}: meta_info.output_top_logprobs is not {output_len} rows of {k} entries "
                                   f"(the request asked top_logprobs_num={k})")
        log_probs, ids = _split_logprob_triples([entry for row in rows for entry in row], where)
        log_probs_raw = float32_bytes(log_probs)
    if len(ids) != output_len * k:
        raise EngineReplyError(f"{where}: sampler top-{k} ids of {len(ids)} entries for {output_len} tokens")
    for row in range(output_len):
        chunk = ids[row * k:(row + 1) * k]
        if len(set(chunk)) != k or min(chunk) < 0 or (vocab_size is not None and max(chunk) >= vocab_size):
            raise EngineReplyError(f"{where}: sampler top-{k} ids of token {row} are not {k} distinct ids in the "
                                   f"vocabulary: {chunk}")
    return int32_bytes(ids), log_probs_raw


def parse_routed_experts(meta: dict, where: str, spec: ReplaySpec, *, input_len: int, output_len: int,
                         start: int) -> bytes:
    """``meta_info.routed_experts`` -> the rows of positions ``[start, input_len + output_len - 1)``.

    SGLang honours ``routed_experts_start_len`` (and sends only those rows); an engine that ignores
    it sends every position from 0, and the rows before ``start`` are dropped here. Any other row
    count is an error: a row short or over would shift every later token's routing."""
    value = meta.get("routed_experts")
    if value is None:
        raise EngineReplyError(f"{where}: no meta_info.routed_experts (routing replay needs engines started "
                               "with --enable-return-routed-experts)")
    try:
        raw = decode_int32(value, "meta_info.routed_experts")
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e}") from None
    width = spec.routed_width * INT32
    end = input_len + output_len - 1
    if len(raw) % width:
        raise EngineReplyError(f"{where}: meta_info.routed_experts holds {len(raw) // INT32} values, not rows of "
                               f"{spec.routed_layers} layers x top-{spec.routed_topk}")
    rows = len(raw) // width
    if rows == end - start:
        return raw
    if start and rows == end:
        return raw[start * width:]
    raise EngineReplyError(f"{where}: meta_info.routed_experts has {rows} rows, but {input_len} input ids + "
                           f"{output_len} output tokens from position {start} need {end - start}")


def parse_top_p_token_ids(meta: dict, where: str, *, output_len: int,
                          vocab_size: int | None) -> tuple[bytes, bytes]:
    """slime's top-p replay fields -> (kept ids, one count per output token), both int32 bytes."""
    ids_key = next((k for k in TOP_P_ID_KEYS if meta.get(k) is not None), None)
    offsets_key = next((k for k in TOP_P_OFFSET_KEYS if meta.get(k) is not None), None)
    if ids_key is None or offsets_key is None:
        raise EngineReplyError(
            f"{where}: no meta_info.top_p_token_ids / top_p_token_offsets for {output_len} tokens sampled with "
            "top-p < 1 (the engine must return the top-p kept token ids: SGLang with slime's "
            "sglang-top_p.patch, as in slime's images)")
    try:
        ids_raw = decode_int32(meta[ids_key], f"meta_info.{ids_key}")
        offsets = int32_values(decode_int32(meta[offsets_key], f"meta_info.{offsets_key}"))
    except ValueError as e:
        raise EngineReplyError(f"{where}: {e}") from None
    n_ids = len(ids_raw) // INT32
    if len(offsets) != output_len + 1 or offsets[0] != 0 or offsets[-1] != n_ids:
        raise EngineReplyError(
            f"{where}: meta_info.{offsets_key} ({len(offsets)} offsets, first "
            f"{offsets[0] if offsets else None}, last {offsets[-1] if offsets else None}) does not split "
            f"{n_ids} kept ids over {output_len} tokens")
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(counts) < 0:
        raise EngineReplyError(f"{where}: meta_info.{offsets_key} decreases at token {counts.index(min(counts))}")
    if n_ids:
        ids = int32_values(ids_raw)
        if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
            raise EngineReplyError(f"{where}: meta_info.{ids_key} holds a token id outside [0, {vocab_size})")
    return ids_raw, int32_bytes(counts)


def normalise_url(url: str) -> str:
    return url.rstrip("/")


def parse_load(reply: Any, url: str, retractions_in_replies: int = 0) -> EngineLoad:
    """SGLang reports one entry per data-parallel rank; an engine's load is their sum. Without a
    ``num_retractions`` entry (SGLang 0.5.23) the retractions are those the replies reported."""
    entries = reply.get("loads") if isinstance(reply, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise EngineReplyError(f"engine {url} GET /v1/loads: no list of loads in {reply!r}")

    def total(key: str) -> int:
        value = 0
        for entry in entries:
            item = entry.get(key, 0)
            if item is None:
                item = 0
            if isinstance(item, bool) or not isinstance(item, (int, float)) or item < 0:
                raise EngineReplyError(f"engine {url} GET /v1/loads: {key}={item!r}")
            value += int(item)
        return value

    return EngineLoad(
        url=url,
        num_running=total("num_running_reqs"),
        num_waiting=total("num_waiting_reqs"),
        used_tokens=total("num_used_tokens"),
        capacity_tokens=total("max_total_num_tokens"),
        retractions=(total("num_retractions") if any("num_retractions" in e for e in entries)
                     else retractions_in_replies),
    )
