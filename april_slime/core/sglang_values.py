"""The errors an engine call can end in, and the checks of the values an SGLang reply holds (weight
versions, counts, log-prob triples, token ids): shared by the reply parser (``sglang_protocol``)
and the reader of replay data (``replay_wire``). A value that is not what the protocol promises
raises ``EngineReplyError`` naming the field and the position.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

# Engines compute log-probs in float32; a log-softmax can come out a hair above 0. Anything above
# this is not a log-probability.
LOGPROB_TOLERANCE = 1e-4


class EngineError(RuntimeError):
    """An engine call failed; the message names the engine and the reason.

    ``engine_s``: the seconds the engine held the call's attempts (each from its send to its
    failure; the client's backoff between attempts left out), set by the client on a call that
    was sent; None where nothing was sent or the client did not say."""

    engine_s: float | None = None


class EngineUnavailable(EngineError):
    """Connection errors, HTTP 5xx or timeouts that outlasted every retry."""


class EngineReplyError(EngineError):
    """The engine answered, but the reply breaks the protocol (missing keys, counts, NaN)."""


class ReplayReplyError(EngineReplyError):
    """A reply lacks, or breaks, what training replays; ``part`` names which: ``routed_experts``,
    ``top_p_ids``, ``top_p_log_probs`` or ``sampler_topk`` (``core.replay_wire``)."""

    def __init__(self, message: str, part: str) -> None:
        super().__init__(message)
        self.part = part


class RequestRejected(EngineError):
    """The request itself is wrong: the engine answered HTTP 4xx (``status``), or the client
    refused to send it (``status`` None; e.g. a token id outside the vocabulary). Resending the
    same request, to this engine or another, cannot help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


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


def require_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineReplyError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def split_logprob_triples(triples: list, where: str) -> tuple[list[float], list[int]]:
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


def check_token_ids(ids: Sequence[int], vocab_size: int | None, what: str) -> None:
    """Every id must be an int in ``[0, vocab_size)`` (any int >= 0 when the size is unknown).
    Raises ``ValueError`` naming the first bad position. ``ids`` is a list, or a 1-d integer numpy
    array (a trajectory's input, ``Trajectory.input_array``)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"{what}: an array of {ids.dtype} and shape {ids.shape}, not token ids")
        if not ids.size or (int(ids.min()) >= 0 and (vocab_size is None or int(ids.max()) < vocab_size)):
            return
        ids = ids.tolist()  # the loop below names the first bad position
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
