"""SGLang's native generate protocol as the rollout core reads it: the records a reply becomes,
their validation, and the errors an engine call can end in.

Every reply is checked here before it reaches a trajectory: a reply that breaks the protocol or is
plausible but wrong (missing keys, count mismatch, NaN or positive log-prob, a token id outside the
vocabulary, another request's id, per-token version spans that do not cover the output) raises
``EngineReplyError`` instead of poisoning a trajectory, and token ids about to be sent are checked
against the vocabulary (on SGLang one out-of-vocabulary input id kills the whole engine). The
client (``engine.py``) calls these parsers on every reply it receives; nothing here does I/O.
The checks of single values and the errors live in ``sglang_values``, the replay data (routed
experts, top-p ids, sampler top-k) in ``replay_wire``, per-token versions in ``versions``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import repeat
from typing import Any

import numpy as np

from april_slime.core.replay import (
    NO_REPLAY,
    ReplaySpec,
    SegmentReplay,
)
from april_slime.core.replay_wire import ask_for_replay, parse_replay
from april_slime.core.sglang_values import (
    LOGPROB_TOLERANCE,
    EngineError,
    EngineReplyError,
    EngineUnavailable,
    ReplayReplyError,
    RequestRejected,
    check_token_ids,
    parse_weight_version,
    require_int,
    split_logprob_triples,
)
from april_slime.core.versions import VersionRuns

# what the rest of the core names from here: the errors and value checks of sglang_values
__all__ = ["LOGPROB_TOLERANCE", "EngineError", "EngineReplyError", "EngineUnavailable", "ReplayReplyError",
           "RequestRejected", "check_token_ids", "parse_weight_version"]

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(eq=False)
class GenerateResult:
    # the output tokens as the reply checks left them: int64 ids and float64 log-probs (bit for bit
    # what the engine sent), arrays rather than lists so that a reply of tens of thousands of tokens
    # holds no Python object per token; a trajectory stores them as they are
    output_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # stop | length | abort
    weight_version: int  # the engine's version when the reply was made
    prompt_tokens: int | None  # None: aborted while still queued (SGLang then omits it)
    completion_tokens: int
    engine_url: str
    # policy version of every output token; from meta_info.weight_versions when the engine sends
    # it, else every token gets weight_version
    version_runs: VersionRuns | None = None
    retractions: int = 0  # meta_info.num_retractions: times the engine retracted this request
    # what the job replays in training (routed experts, top-p kept ids), when it asked for it
    replay: SegmentReplay | None = None

    def __post_init__(self) -> None:
        if self.version_runs is None:
            self.version_runs = VersionRuns.single(self.weight_version, len(self.output_ids))

    def __eq__(self, other: object) -> bool:
        """Equal values: the same ids, the same log-prob bits, the same other fields."""
        if not isinstance(other, GenerateResult):
            return NotImplemented
        return (np.array_equal(self.output_ids, other.output_ids)
                and np.array_equal(self.logprobs.view(np.int64), other.logprobs.view(np.int64))
                and all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self)[2:]))


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
    array too, so a reply costs no Python object per token on its way to the trajectory.
    ``to_triples`` is what the same reply says on the wire."""

    logprobs: np.ndarray
    token_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_triples(self) -> list[list]:
        return list(map(list, zip(self.logprobs.tolist(), self.token_ids.tolist(), repeat(None))))


def output_tokens(output_ids: Any, triples: Any, vocab_size: int | None,
                  where: str) -> tuple[list[int], list[float]]:
    """A reply's ``output_ids`` (a list of ints, or None: the ids come from the triples) and
    ``meta_info.output_token_logprobs`` (a list of triples, or ``LogprobArrays``) -> (token ids,
    log-probs) as fresh lists, once every per-token check has passed: triples well formed,
    log-probs finite and <= ``LOGPROB_TOLERANCE``, ids integers in ``[0, vocab_size)``, the same
    ids in both places. Raises ``EngineReplyError`` naming the first bad position."""
    if isinstance(triples, LogprobArrays):
        ids, logprobs = output_token_arrays(output_ids, triples, vocab_size, where)
        return ids.tolist(), logprobs.tolist()
    checked = _checked_lists(output_ids, triples, vocab_size)
    if checked is not None:
        return checked[0], checked[1]
    return output_tokens_reference(output_ids, triples, vocab_size, where)


def output_token_arrays(output_ids: Any, triples: Any, vocab_size: int | None,
                        where: str) -> tuple[np.ndarray, np.ndarray]:
    """``output_tokens`` as (int64 ids, float64 log-probs) arrays, what a ``GenerateResult`` holds:
    those the whole-list checks built, else those of the reference checks' lists (which also name
    the problem of a reply they refuse). No list of the tokens is made on the way."""
    if isinstance(triples, LogprobArrays):
        checked = _checked_arrays(output_ids, triples, vocab_size)
        if checked is not None:
            return checked
        # the wire form of the same reply, for the reference checks to name the problem
        triples = triples.to_triples()
        if isinstance(output_ids, np.ndarray):
            output_ids = output_ids.tolist()
    else:
        listed = _checked_lists(output_ids, triples, vocab_size)
        if listed is not None:
            return listed[2]
    ids, logprobs = output_tokens_reference(output_ids, triples, vocab_size, where)
    try:
        return np.array(ids, dtype=np.int64), np.array(logprobs, dtype=np.float64)
    except OverflowError:  # any integer >= 0 is an id of an unknown vocabulary, but none fits a token column
        raise EngineReplyError(f"{where}: output_ids holds a token id beyond 64 bits") from None


def _checked_lists(output_ids: Any, triples: Any,
                   vocab_size: int | None) -> tuple[list[int], list[float], tuple[np.ndarray, np.ndarray]] | None:
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
    if not n:
        return [], logprobs, (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))
    as_float64 = np.frombuffer(array("d", logprobs), dtype=np.float64)
    if not (np.isfinite(as_float64).all() and as_float64.max() <= LOGPROB_TOLERANCE):
        return None
    try:
        as_int64 = np.frombuffer(array("q", output_ids), dtype=np.int64)
    except OverflowError:
        return None
    if not _ids_in_vocab(as_int64, vocab_size):
        return None
    return list(output_ids), logprobs, (as_int64, as_float64)


def compact_generate_reply(reply: Any) -> None:
    """A decoded ``/generate`` reply's per-token lists replaced, in place, by the arrays the
    whole-list checks build of them (``meta_info.output_token_logprobs`` as ``LogprobArrays``,
    ``output_ids`` as the same int64 array), when those checks vouch for them with the vocabulary
    unknown; the client's checks read them as they are and apply the vocabulary. A reply they
    cannot vouch for is left as it is, for the checks to name what is wrong."""
    meta = reply.get("meta_info") if type(reply) is dict else None
    triples = meta.get("output_token_logprobs") if type(meta) is dict else None
    checked = _checked_lists(reply.get("output_ids"), triples, None) if triples is not None else None
    if checked is None:
        return
    ids, logprobs = checked[2]
    meta["output_token_logprobs"] = LogprobArrays(logprobs, ids)
    if reply.get("output_ids") is not None:
        reply["output_ids"] = ids


def _checked_arrays(output_ids: Any, arrays: LogprobArrays,
                    vocab_size: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """``output_token_arrays`` for ``LogprobArrays`` (and ``output_ids`` as an int64 array or
    None): the same arrays; None unless every check passes."""
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
    return ids, logprobs


def _ids_in_vocab(ids: np.ndarray, vocab_size: int | None) -> bool:
    return bool(ids.min() >= 0 and (vocab_size is None or ids.max() < vocab_size))


def output_tokens_reference(output_ids: Any, triples: Any, vocab_size: int | None,
                            where: str) -> tuple[list[int], list[float]]:
    """The reference checks of ``output_tokens``: item by item, raising at the first bad one (what the
    whole-list checks fall back to, to name the problem; the decode benchmark times it)."""
    logprobs, triple_ids = split_logprob_triples(triples, where)
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


def _parse_version_spans(spans: Any, n: int, where: str) -> VersionRuns:
    """SGLang's ``meta_info.weight_versions`` over ``n`` output tokens, as ``VersionRuns``."""
    if not isinstance(spans, list) or not spans:
        raise EngineReplyError(f"{where}: meta_info.weight_versions is not a non-empty list: {spans!r}")
    triples = []
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            raise EngineReplyError(f"{where}: weight_versions[{i}] is not an object: {span!r}")
        start, end = span.get("start"), span.get("end")
        if isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int) or not isinstance(end, int):
            raise EngineReplyError(f"{where}: weight_versions[{i}] = {span!r} has no integer start and end")
        triples.append((parse_weight_version(span.get("version"), f"{where} weight_versions[{i}]"), start, end))
    try:
        return VersionRuns.from_spans(triples, n)
    except ValueError as e:
        raise EngineReplyError(f"{where}: weight_versions: {e}") from None


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
    output_ids, logprobs = output_token_arrays(reply.get("output_ids"), triples, vocab_size, where)

    completion = meta.get("completion_tokens")
    if completion is None and finish_type == "abort" and not len(output_ids):
        completion = 0
    completion_tokens = require_int(completion, "completion_tokens", where)
    if completion_tokens != len(output_ids):
        raise EngineReplyError(
            f"{where}: completion_tokens={completion_tokens} but {len(output_ids)} tokens returned"
        )
    if len(output_ids) > max_new_tokens:
        raise EngineReplyError(
            f"{where}: {len(output_ids)} tokens returned, more than max_new_tokens={max_new_tokens}"
        )
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None or finish_type != "abort" or len(output_ids):
        # only a request aborted while still queued comes back without prompt_tokens
        prompt_tokens = require_int(prompt_tokens, "prompt_tokens", where)
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


def generate_request(input_ids: Sequence[int], *, max_new_tokens: int, rid: str, sampling_params: dict,
                     sampling_seed: int, vocab_size: int | None, replay: ReplaySpec, replay_rows: int,
                     where: str) -> dict:
    """The ``/generate`` body of one call (log-probs always asked for, with what training replays);
    ``RequestRejected`` for input ids no engine may see (on SGLang one id outside the vocabulary
    kills the engine). An integer numpy array of ids stays one in the body (the transport encodes
    it as the JSON list SGLang reads); any other sequence is copied into a list."""
    if max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not len(input_ids):
        raise RequestRejected(f"{where}: no input ids to send")
    try:
        check_token_ids(input_ids, vocab_size, f"{where}: input_ids")
    except ValueError as exc:
        raise RequestRejected(str(exc)) from None
    payload = {
        "input_ids": input_ids if isinstance(input_ids, np.ndarray) else list(input_ids),
        "sampling_params": {**sampling_params, "max_new_tokens": max_new_tokens, "sampling_seed": sampling_seed},
        "return_logprob": True,
        "rid": rid,
    }
    ask_for_replay(payload, replay, replay_rows)
    return payload


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
