"""How one JSON request reaches an engine: the ``Transport`` protocol and its HTTP implementation.

The client (``engine.py``) owns timeouts, retries and validation; a transport only moves bytes and
reports what happened, so an in-process stand-in (the emulator's cluster) can take its place.
"""

from __future__ import annotations

import gc
import json
from typing import Any, Protocol

import orjson

from april_slime.core.http_client import ConnectionPool
from april_slime.core.sglang_protocol import compact_generate_reply


def decode_json(raw: bytes) -> Any:
    """A reply body -> its JSON value. orjson (what SGLang itself encodes with) decodes a
    16K-token reply about 4x faster than the standard library. What orjson refuses and the
    standard library reads (NaN and Infinity literals, numbers beyond a double, lone surrogates) is
    read by the latter, so the reply checks see the value and name what is wrong with it. One
    difference stays: an integer beyond 64 bits comes back as a double (as in SGLang's own
    orjson), which every check that wants an integer refuses. Raises ``ValueError`` when the body
    is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def decode_generate_reply(raw: bytes) -> Any:
    """A ``/generate`` reply body -> its JSON value, with a well-formed reply's per-token lists
    already in the form an in-process engine hands over and the reply checks read as they are:
    ``meta_info.output_token_logprobs`` as ``LogprobArrays`` and ``output_ids`` as the same int64
    array (``compact_generate_reply``). A reply the whole-list checks cannot vouch for keeps its
    lists, for the checks to name what is wrong.

    Collections are paused meanwhile. Decoding a 16K-token reply makes 16K lists (one per
    triple), and the young collections its allocations trigger would find the half-built reply alive
    and promote it: thousands of objects into the oldest generation per reply, a full collection
    every few replies. Paused, the lists are made and freed without any collection seeing them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        reply = decode_json(raw)
        compact_generate_reply(reply)
        return reply
    finally:
        if enabled:
            gc.enable()


class TransportHTTPError(Exception):
    """An engine answered with a non-2xx status; ``body`` is its decoded JSON (or text) reply."""

    def __init__(self, status: int, body):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class Transport(Protocol):
    """Moves one JSON request to an engine and returns its decoded JSON reply.

    Raises ``TransportHTTPError(status, body)`` on a non-2xx reply, ``ConnectionError``/``OSError``
    when the engine cannot be reached or drops the connection, ``asyncio.TimeoutError`` when
    ``timeout_s`` passes, and ``ValueError`` when a 2xx body is not JSON. An empty 2xx body (SGLang's
    ``/abort_request``) is returned as ``None``. A ``/generate`` reply's per-token values may come as
    arrays (``decode_generate_reply``: ``output_ids`` an int64 array, ``meta_info.output_token_logprobs``
    a ``LogprobArrays``), which the reply checks read as they are.

    The engine client bounds every attempt by ``timeout_s`` on the loop's clock itself, so a
    transport need not keep a deadline; one that does declares ``enforces_timeout = True`` and the
    client adds no timer of its own.
    """

    async def request(
        self, method: str, url: str, path: str, payload: dict | None, timeout_s: float
    ) -> dict: ...


# How long an idle pooled connection is kept for reuse. SGLang's HTTP server (uvicorn) closes an idle
# connection 5 s after its last reply went out (SGLANG_TIMEOUT_KEEP_ALIVE). A call sent in between
# goes out on a connection the server has closed: the first refills of a step after a short
# training phase, a sparse refill. On a busy machine a reply is read a second or more after it was
# sent, so the client's margin must cover that too; and a call that still meets a closed connection
# before any reply is sent again at once on a fresh one (``http_client.ConnectionPool``).
KEEPALIVE_S = 2.0


def encode_json(value: Any) -> bytes:
    """A request body: orjson, with numpy arrays (a request's input ids) written as JSON lists."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


class HttpTransport:
    """``Transport`` over HTTP/1.1 keep-alive connections (``http_client``), pooled per engine.

    No connection limit: the scheduler decides how many requests are in flight, and a pool cap
    here would silently queue them behind the client's timeout. A request in flight holds a
    handful of tracked objects (its connection is pooled), which is what keeps full garbage
    collections short with thousands of generate calls in flight.
    """

    enforces_timeout = True  # each connection keeps its call's deadline (``http_client``)

    def __init__(self) -> None:
        self.pool = ConnectionPool(KEEPALIVE_S)

    async def request(
        self, method: str, url: str, path: str, payload: dict | None, timeout_s: float
    ) -> Any:
        status, raw = await self.pool.request(method, url, path, None if payload is None else encode_json(payload),
                                              timeout_s)
        if not 200 <= status < 300:
            try:
                body: Any = decode_json(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            raise TransportHTTPError(status, body)
        if not raw.strip():
            return None
        try:
            return decode_generate_reply(raw) if path == "/generate" else decode_json(raw)
        except ValueError as exc:
            raise ValueError(f"reply is not JSON: {raw[:200].decode('utf-8', 'replace')!r}") from exc

    async def close(self) -> None:
        self.pool.close()
