"""How one JSON request reaches an engine: the ``Transport`` protocol and its aiohttp implementation.

The client (``engine.py``) owns timeouts, retries and validation; a transport only moves bytes and
reports what happened, so an in-process stand-in (the emulator's cluster) can take its place.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import aiohttp
import orjson


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
    ``/abort_request``) is returned as ``None``.
    """

    async def request(
        self, method: str, url: str, path: str, payload: dict | None, timeout_s: float
    ) -> dict: ...


# How long an idle pooled connection is kept for reuse. SGLang's HTTP server (uvicorn) closes an idle
# connection 5 s after its last reply went out (SGLANG_TIMEOUT_KEEP_ALIVE); aiohttp keeps one 15 s by
# default after the client read that reply. A call sent in between goes out on a connection the
# server has closed and fails with "Server disconnected" (then waits out the client's retry
# backoff): the first refills of a step after a short training phase, a sparse refill. On a busy
# machine a reply is read a second or more after it was sent, so the client's margin must cover
# that too; and a call that still meets a closed connection before any reply is sent again at once
# on a fresh one (``request``).
KEEPALIVE_S = 2.0


_JSON_HEADERS = {"Content-Type": "application/json"}


def encode_json(value: Any) -> bytes:
    """A request body: orjson, with numpy arrays (a request's input ids) written as JSON lists."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


class HttpTransport:
    """``Transport`` over aiohttp with one shared session (connection pooling across requests).

    The session is created on first use, inside the running loop, so the transport can be built
    anywhere. Connection limits are lifted: the scheduler decides how many requests are in flight,
    and a pool cap here would silently queue them behind the client's timeout.
    """

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
                # per-request timeouts are passed to every call
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def request(
        self, method: str, url: str, path: str, payload: dict | None, timeout_s: float
    ) -> Any:
        session = self._get_session()
        for fresh in (False, True):
            answered = False
            try:
                async with session.request(
                    method,
                    url.rstrip("/") + path,
                    data=None if payload is None else encode_json(payload),
                    headers=None if payload is None else _JSON_HEADERS,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as response:
                    answered = True
                    raw = await response.read()
                    status = response.status
                break
            except TimeoutError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # closed before it answered anything ("Server disconnected", or "Can not write
                # request body" when the close lands while the call is written): a pooled
                # connection the server had just dropped as idle (KEEPALIVE_S), which never read
                # this request. A refused connect is a new connection, not a stale one: no resend.
                stale = not isinstance(exc, aiohttp.ClientConnectorError)
                if stale and not answered and not fresh:
                    continue
                raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
            except aiohttp.ClientError as exc:
                # ClientConnectorError is already an OSError, but a server that drops the connection
                # mid-reply raises ServerDisconnectedError, which is not: normalise both.
                raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            try:
                body: Any = decode_json(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            raise TransportHTTPError(status, body)
        if not raw.strip():
            return None
        try:
            return decode_json(raw)
        except ValueError as exc:
            raise ValueError(f"reply is not JSON: {raw[:200].decode('utf-8', 'replace')!r}") from exc

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
