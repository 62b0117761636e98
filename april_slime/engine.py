"""Async client of SGLang-protocol engines.

One ``EngineClient`` talks to every rollout engine of a job (or to the emulator that stands in for
them) through a ``Transport``: ``HttpTransport`` for real servers, or any in-process object with the
same ``request`` coroutine. The client owns three things and nothing else:

* the wire format of SGLang's native API (``/generate``, ``/abort_request``, ``/v1/loads``,
  ``/get_weight_version`` or ``/model_info``, the router's ``/workers``),
* validation of every request and reply at this boundary: token ids sent must lie in
  ``[0, vocab_size)`` (on SGLang one out-of-vocabulary input id kills the whole engine), and a
  reply that breaks the protocol or is plausible but wrong (missing keys, count mismatch, NaN or
  positive log-prob, a token id outside the vocabulary, another request's id, per-token version
  spans that do not cover the output) is refused instead of poisoning a trajectory,
* retries with exponential backoff on failures that are safe to retry, and per-engine error
  counters (``stats``) for metrics.

It keeps no per-request state: which rid runs where, and which engine is healthy, is the
scheduler's business.

Behaviour of SGLang 0.5.23 this client relies on (measured on the real engine): ``/abort_request``
answers HTTP 200 with an empty body; a request aborted while still queued comes back as
``finish_reason: abort`` with no tokens and no ``prompt_tokens``; ``meta_info.weight_versions``
holds spans ``{"version", "start", "end"}`` (end exclusive) over the output tokens when the weights
changed during the call (older builds send only ``weight_version``); ``meta_info.id`` is the rid.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Protocol

import aiohttp

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")

# Engines compute log-probs in float32; a log-softmax can come out a hair above 0. Anything above
# this is not a log-probability.
LOGPROB_TOLERANCE = 1e-4

# Control calls (abort, loads, weight version, worker list) answer at once on a healthy engine; a
# generate may legitimately run for an hour. They get their own, much shorter, per-call timeout.
CONTROL_TIMEOUT_S = 30.0
# An abort is best effort (the request's own reply or deadline settles it): a hung abort must not
# hold anything up for long.
ABORT_TIMEOUT_S = 5.0


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
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                # per-request timeouts are passed to every call
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def request(
        self, method: str, url: str, path: str, payload: dict | None, timeout_s: float
    ) -> Any:
        session = self._get_session()
        try:
            async with session.request(
                method,
                url.rstrip("/") + path,
                json=payload,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                text = await response.text()
                status = response.status
        except asyncio.TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            # ClientConnectorError is already an OSError, but a server that drops the connection
            # mid-reply raises ServerDisconnectedError, which is not: normalise both.
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            try:
                body: Any = json.loads(text)
            except ValueError:
                body = text
            raise TransportHTTPError(status, body)
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"reply is not JSON: {text[:200]!r}") from exc

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


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
    retractions: int  # cumulative since the engine started


@dataclass
class EngineStats:
    """Cumulative counters of one engine's calls (never reset), read by the metrics code."""

    calls: int = 0
    retries: int = 0
    timeouts: int = 0
    connection_errors: int = 0
    server_errors: int = 0  # HTTP 5xx
    client_errors: int = 0  # HTTP 4xx (never retried)
    reply_errors: int = 0  # malformed replies
    failed_calls: int = 0  # calls that raised after all retries
    aborts_after_timeout: int = 0
    failed_aborts_after_timeout: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _normalise_url(url: str) -> str:
    return url.rstrip("/")


async def _call_with_retries(
    transport: Transport,
    url: str,
    method: str,
    path: str,
    payload: dict | None,
    *,
    timeout_s: float,
    max_retries: int,
    retry_backoff_s: float,
    stats: EngineStats,
    before_retry_after_timeout: Callable[[], Awaitable[None]] | None = None,
) -> Any:
    """One logical call with up to ``max_retries`` retries after the first attempt.

    Retried: connection errors, HTTP 5xx, timeouts. Never retried: HTTP 4xx (the request itself is
    wrong, repeating it cannot help) and non-JSON 2xx bodies. The backoff is deterministic
    (``retry_backoff_s * 2**k``) so that runs under the emulator's virtual clock are reproducible.
    """
    stats.calls += 1
    last_error = "no attempt made"
    for attempt in range(max_retries + 1):
        if attempt > 0:
            stats.retries += 1
            await asyncio.sleep(retry_backoff_s * 2 ** (attempt - 1))
        try:
            # The client enforces the deadline itself, so in-process transports need not; it reads
            # the loop's clock, which keeps timeouts meaningful under a virtual-time loop.
            async with asyncio.timeout(timeout_s):
                return await transport.request(method, url, path, payload, timeout_s)
        except TransportHTTPError as exc:
            if 400 <= exc.status < 500:
                stats.client_errors += 1
                stats.failed_calls += 1
                raise RequestRejected(
                    f"engine {url} rejected {method} {path} with HTTP {exc.status}: {exc.body}",
                    exc.status,
                ) from exc
            stats.server_errors += 1
            last_error = f"HTTP {exc.status}: {exc.body}"
        except asyncio.TimeoutError:
            # Must come before OSError: TimeoutError is a subclass of OSError.
            stats.timeouts += 1
            last_error = f"no reply within {timeout_s:g} s"
            if before_retry_after_timeout is not None and attempt < max_retries:
                await before_retry_after_timeout()
        except (ConnectionError, OSError) as exc:
            stats.connection_errors += 1
            last_error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:
            stats.reply_errors += 1
            stats.failed_calls += 1
            raise EngineReplyError(f"engine {url} {method} {path}: {exc}") from exc
        logger.warning(
            "engine %s %s %s failed (attempt %d of %d): %s",
            url, method, path, attempt + 1, max_retries + 1, last_error,
        )
    stats.failed_calls += 1
    raise EngineUnavailable(
        f"engine {url} {method} {path} failed after {max_retries + 1} attempts; "
        f"last error: {last_error}"
    )


def _parse_weight_version(value: Any, where: str) -> int:
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
        if not math.isfinite(logprob):
            raise EngineReplyError(f"{where}: log-prob at position {pos} is not finite ({logprob})")
        if logprob > LOGPROB_TOLERANCE:
            raise EngineReplyError(
                f"{where}: log-prob at position {pos} is {logprob} > 0, not a log-probability"
            )
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise EngineReplyError(f"{where}: token id at position {pos} is {token_id!r}")
        logprobs.append(float(logprob))
        token_ids.append(token_id)
    return logprobs, token_ids


def check_token_ids(ids: list[int], vocab_size: int | None, what: str) -> None:
    """Every id must be an int in ``[0, vocab_size)`` (any int >= 0 when the size is unknown).
    Raises ``ValueError`` naming the first bad position."""
    if not ids:
        return
    if all(type(t) is int for t in ids):
        low, high = min(ids), max(ids)
        if low >= 0 and (vocab_size is None or high < vocab_size):
            return
    for pos, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (
                vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{what}: token id {t!r} at position {pos} is not an integer in {bound}")


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
        version = _parse_weight_version(span.get("version"), f"{where} weight_versions[{i}]")
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
    reply: Any, *, engine_url: str, rid: str, max_new_tokens: int, vocab_size: int | None = None
) -> GenerateResult:
    """Validate one SGLang ``/generate`` reply and turn it into a ``GenerateResult``."""
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
    if not isinstance(triples, list):
        raise EngineReplyError(
            f"{where}: meta_info.output_token_logprobs missing or not a list (was the request sent "
            "with return_logprob=true?)"
        )
    logprobs, triple_ids = _split_logprob_triples(triples, where)

    output_ids = reply.get("output_ids")
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
    weight_version = _parse_weight_version(meta.get("weight_version"), where)
    spans = meta.get("weight_versions")
    version_runs = (_parse_version_spans(spans, len(output_ids), where) if spans is not None
                    else None)

    return GenerateResult(
        output_ids=list(output_ids),
        logprobs=logprobs,
        finish_reason=finish_type,
        weight_version=weight_version,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        engine_url=engine_url,
        version_runs=version_runs,
    )


def _parse_worker_urls(reply: Any, router_url: str) -> list[str]:
    """Accept ``{"urls": [...]}``, ``{"workers": [...]}`` or a bare list; items are URLs or
    objects with a ``url`` key (the shapes of sglang-router's and its gateway's worker lists)."""
    if isinstance(reply, dict):
        items = reply.get("urls", reply.get("workers"))
    else:
        items = reply
    if not isinstance(items, list):
        raise EngineReplyError(f"router {router_url} GET /workers: no worker list in {reply!r}")
    urls = []
    for item in items:
        url = item.get("url") if isinstance(item, dict) else item
        if not isinstance(url, str) or not url:
            raise EngineReplyError(f"router {router_url} GET /workers: bad worker entry {item!r}")
        urls.append(_normalise_url(url))
    return urls


def _parse_load(reply: Any, url: str) -> EngineLoad:
    """SGLang reports one entry per data-parallel rank; an engine's load is their sum."""
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
        retractions=total("num_retractions"),
    )


class EngineClient:
    """Calls SGLang-protocol engines; see the module docstring for what it owns."""

    def __init__(
        self,
        engine_urls: list[str],
        *,
        transport: Transport | None = None,
        timeout_s: float = 3600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        vocab_size: int | None = None,
    ) -> None:
        if not engine_urls:
            raise EngineError("no engine urls given")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"vocab_size must be an integer >= 1 or None, got {vocab_size!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {retry_backoff_s}")
        self.engine_urls = [_normalise_url(u) for u in engine_urls]
        self._owns_transport = transport is None
        self.transport: Transport = transport if transport is not None else HttpTransport()
        self.timeout_s = timeout_s
        self.control_timeout_s = min(timeout_s, CONTROL_TIMEOUT_S)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        # token ids sent and received must lie below it; None (unknown) checks only ids >= 0
        self.vocab_size = vocab_size
        self.stats: dict[str, EngineStats] = {url: EngineStats() for url in self.engine_urls}

    @classmethod
    async def from_router(cls, router_url: str, **kw) -> "EngineClient":
        """Build a client for every engine the router lists (``GET {router}/workers``).

        A router URL is expected (slime always starts ``sglang-router``). A URL that answers
        ``/workers`` with HTTP 404 but answers as an SGLang engine (its weight version) is taken
        as the job's only engine, with a warning; anything else fails with an error saying that a
        router URL is expected.
        """
        router_url = _normalise_url(router_url)
        transport = kw.pop("transport", None)
        owns_transport = transport is None
        if owns_transport:
            transport = HttpTransport()
        try:
            try:
                reply = await _call_with_retries(
                    transport,
                    router_url,
                    "GET",
                    "/workers",
                    None,
                    timeout_s=min(kw.get("timeout_s", 3600.0), CONTROL_TIMEOUT_S),
                    max_retries=kw.get("max_retries", 3),
                    retry_backoff_s=kw.get("retry_backoff_s", 1.0),
                    stats=EngineStats(),
                )
                urls = _parse_worker_urls(reply, router_url)
            except RequestRejected as exc:
                if exc.status != 404:
                    raise
                urls = [await cls._single_engine(router_url, transport, kw)]
            if not urls:
                raise EngineError(f"router {router_url} lists no engines")
            client = cls(urls, transport=transport, **kw)
        except BaseException:
            if owns_transport:
                await transport.close()
            raise
        client._owns_transport = owns_transport
        return client

    @classmethod
    async def _single_engine(cls, url: str, transport: Transport, kw: dict) -> str:
        probe = cls([url], transport=transport, **kw)
        try:
            await probe.weight_version(url)
        except EngineError as exc:
            raise EngineError(
                f"{url} is not a router: GET /workers answered HTTP 404, and it does not answer as "
                f"an SGLang engine either ({exc}); a router URL is expected (sglang-router, slime's "
                "--sglang-router-ip/--sglang-router-port)"
            ) from exc
        logger.warning(
            "%s has no /workers (HTTP 404): a router URL is expected; it answers as an SGLang "
            "engine, so it is used as the only rollout engine", url,
        )
        return url

    def _stats(self, url: str) -> EngineStats:
        return self.stats.setdefault(url, EngineStats())

    def _counting_reply_errors(self, url: str, parse: Callable[..., Any], *args: Any) -> Any:
        try:
            return parse(*args)
        except EngineReplyError:
            self._stats(url).reply_errors += 1
            raise

    async def _call(
        self,
        url: str,
        method: str,
        path: str,
        payload: dict | None,
        *,
        timeout_s: float,
        before_retry_after_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> Any:
        return await _call_with_retries(
            self.transport,
            url,
            method,
            path,
            payload,
            timeout_s=timeout_s,
            max_retries=self.max_retries,
            retry_backoff_s=self.retry_backoff_s,
            stats=self._stats(url),
            before_retry_after_timeout=before_retry_after_timeout,
        )

    async def generate(
        self,
        engine_url: str,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        rid: str,
        sampling_params: dict,
        sampling_seed: int,
    ) -> GenerateResult:
        """One generate call. The reply is validated; an aborted reply with partial (or zero)
        tokens is a normal result with ``finish_reason == "abort"``.

        Token ids outside ``[0, vocab_size)`` are refused before anything is sent
        (``RequestRejected``): on SGLang one such id kills the engine.

        What a retry guarantees: it resends the same rid and input ids after the timed-out attempt
        was aborted, so at most one copy runs at a time and a reply is always the continuation of
        exactly these input ids. It does not guarantee the same sample: SGLang ignores
        ``sampling_seed`` unless the server runs with deterministic inference, so a retried call
        draws a fresh continuation (equally valid, from the same policy; greedy decoding repeats).
        """
        engine_url = _normalise_url(engine_url)
        if max_new_tokens < 1:
            raise ValueError(f"rid {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if not input_ids:
            raise RequestRejected(f"engine {engine_url} rid {rid}: no input ids to send")
        try:
            check_token_ids(input_ids, self.vocab_size, f"engine {engine_url} rid {rid}: input_ids")
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {
                **sampling_params,
                "max_new_tokens": max_new_tokens,
                "sampling_seed": sampling_seed,
            },
            "return_logprob": True,
            "rid": rid,
        }

        # A timed-out generate may still be running on the engine: the client only stopped
        # waiting. Retrying straight away would have the engine generate the same sample twice at
        # once (and, with the same rid, clash with the first copy). So abort that rid first; this is
        # best effort, because an engine that cannot answer an abort either is down (nothing is
        # running) or will fail the retry as well.
        async def abort_timed_out_request() -> None:
            stats = self._stats(engine_url)
            stats.aborts_after_timeout += 1
            try:
                timeout_s = min(self.control_timeout_s, ABORT_TIMEOUT_S)
                async with asyncio.timeout(timeout_s):
                    await self.transport.request(
                        "POST", engine_url, "/abort_request", {"rid": rid}, timeout_s
                    )
            except (TransportHTTPError, asyncio.TimeoutError, OSError, ValueError) as exc:
                stats.failed_aborts_after_timeout += 1
                logger.warning(
                    "engine %s: abort of timed-out rid %s failed (%s); retrying anyway",
                    engine_url, rid, exc,
                )

        reply = await self._call(
            engine_url,
            "POST",
            "/generate",
            payload,
            timeout_s=self.timeout_s,
            before_retry_after_timeout=abort_timed_out_request,
        )
        return self._counting_reply_errors(
            engine_url,
            lambda: parse_generate_reply(
                reply, engine_url=engine_url, rid=rid, max_new_tokens=max_new_tokens,
                vocab_size=self.vocab_size,
            ),
        )

    async def abort(
        self,
        engine_url: str,
        rid: str | None = None,
        abort_all: bool = False,
        *,
        timeout_s: float | None = None,
        max_retries: int | None = None,
    ) -> None:
        """Ask an engine to abort one request (or all). Its generate call then returns the partial
        response with finish reason "abort". Raises after retries; callers that treat an abort as
        best effort pass a short ``timeout_s`` and ``max_retries=0`` and catch ``EngineError``.
        The reply body is not read (SGLang answers 200 with an empty body)."""
        engine_url = _normalise_url(engine_url)
        if (rid is None) == (not abort_all):
            raise ValueError("abort needs exactly one of rid or abort_all=True")
        payload: dict = {"abort_all": True} if abort_all else {"rid": rid}
        await _call_with_retries(
            self.transport, engine_url, "POST", "/abort_request", payload,
            timeout_s=self.control_timeout_s if timeout_s is None else timeout_s,
            max_retries=self.max_retries if max_retries is None else max_retries,
            retry_backoff_s=self.retry_backoff_s, stats=self._stats(engine_url),
        )

    async def probe(self, engine_url: str, timeout_s: float) -> None:
        """Health probe: a one-token generate answered within ``timeout_s`` (what SGLang's own
        ``/health_generate`` does). One attempt; raises ``EngineError`` when the engine fails it.
        An engine that accepts requests but never answers fails here, where ``/health`` alone
        could still answer."""
        engine_url = _normalise_url(engine_url)
        payload = {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "rid": f"april-probe-{uuid.uuid4().hex}",
        }
        reply = await _call_with_retries(
            self.transport, engine_url, "POST", "/generate", payload, timeout_s=timeout_s,
            max_retries=0, retry_backoff_s=0.0, stats=EngineStats(),
        )
        if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
            raise EngineReplyError(f"engine {engine_url}: health probe reply is not a generate reply")

    async def loads(self) -> list[EngineLoad]:
        """Current load of every engine, queried concurrently, in ``engine_urls`` order."""

        async def one(url: str) -> EngineLoad:
            reply = await self._call(
                url, "GET", "/v1/loads", None, timeout_s=self.control_timeout_s
            )
            return self._counting_reply_errors(url, _parse_load, reply, url)

        # Every query runs to its end (no task is left behind unobserved); the first failure wins.
        results = await asyncio.gather(
            *(one(url) for url in self.engine_urls), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def weight_version(self, engine_url: str) -> int:
        engine_url = _normalise_url(engine_url)
        path = "/get_weight_version"
        try:
            reply = await self._call(engine_url, "GET", path, None, timeout_s=self.control_timeout_s)
        except EngineError as exc:
            # Upstream SGLang answers the old path with 404 and serves the version from
            # /model_info; slime's own SGLang patch keeps the old path, so try that one first.
            cause = exc.__cause__
            if not (isinstance(cause, TransportHTTPError) and cause.status == 404):
                raise
            path = "/model_info"
            reply = await self._call(engine_url, "GET", path, None, timeout_s=self.control_timeout_s)
        value = reply.get("weight_version") if isinstance(reply, dict) else None
        return self._counting_reply_errors(
            engine_url, _parse_weight_version, value, f"engine {engine_url} GET {path}"
        )

    async def close(self) -> None:
        """Close the transport if this client created it (a passed-in transport is the caller's)."""
        if self._owns_transport:
            close = getattr(self.transport, "close", None)
            if close is not None:
                await close()
