"""One logical engine call with its retries, and the per-engine counters those calls keep.

``call_with_retries`` is what every call of the engine client (``engine.py``) goes through: one
attempt on the transport under the client's own deadline, then up to ``max_retries`` more on
failures that are safe to retry, with a deterministic backoff. ``EngineStats`` counts what
happened, per engine, for the metrics code.

A generate call is in flight for as long as its engine generates (minutes, at 16K-token responses),
so everything a call holds while it waits lives into the oldest garbage-collector generation; at
thousands of calls in flight those objects are what the full collections walk. The retry loop
therefore keeps its state in one coroutine frame and builds nothing per call beyond the
deadline's timer (none when the transport keeps the deadline itself): a timed-out attempt's
abort is a callback the caller passes once (a bound method), not a closure made for every call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from april_slime.core.sglang_protocol import EngineError, EngineReplyError, EngineUnavailable, RequestRejected
from april_slime.core.transport import Transport, TransportHTTPError

logger = logging.getLogger(__name__)

# Control calls (abort, loads, weight version, worker list) answer at once on a healthy engine; a
# generate may legitimately run for an hour. They get their own, much shorter, per-call timeout.
CONTROL_TIMEOUT_S = 30.0
# An abort is best effort (the request's own reply or deadline settles it): a hung abort must not
# hold anything up for long.
ABORT_TIMEOUT_S = 5.0


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
    retractions_in_replies: int = 0  # sum of meta_info.num_retractions of generate replies

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


async def call_with_retries(
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
    abort_after_timeout: Callable[[str, str], Awaitable[None]] | None = None,
    rid: str = "",
) -> Any:
    """One logical call with up to ``max_retries`` retries after the first attempt.

    Retried: connection errors, HTTP 5xx, timeouts. Never retried: HTTP 4xx (the request itself is
    wrong, repeating it cannot help) and non-JSON 2xx bodies. The backoff is deterministic
    (``retry_backoff_s * 2**k``) so that runs under the emulator's virtual clock are reproducible.
    Before a retry that follows a timeout, ``abort_after_timeout(url, rid)`` is awaited (the
    timed-out attempt may still run on the engine).
    """
    stats.calls += 1
    last_error = "no attempt made"
    loop = asyncio.get_running_loop()
    enforces_timeout = getattr(transport, "enforces_timeout", False)
    held_s = 0.0  # the engine held the attempts this long (EngineError.engine_s)
    for attempt in range(max_retries + 1):
        if attempt > 0:
            stats.retries += 1
            await asyncio.sleep(retry_backoff_s * 2 ** (attempt - 1))
        sent = loop.time()
        try:
            if enforces_timeout:  # its own timer (no second one held while the engine generates)
                return await transport.request(method, url, path, payload, timeout_s)
            # Otherwise the client enforces the deadline itself, so in-process transports need
            # not; it reads the loop's clock, which keeps timeouts meaningful under a virtual-time loop.
            async with asyncio.timeout(timeout_s):
                return await transport.request(method, url, path, payload, timeout_s)
        except TransportHTTPError as exc:
            held_s += loop.time() - sent
            if 400 <= exc.status < 500:
                stats.client_errors += 1
                stats.failed_calls += 1
                raise held(RequestRejected(
                    f"engine {url} rejected {method} {path} with HTTP {exc.status}: {exc.body}",
                    exc.status,
                ), held_s) from exc
            stats.server_errors += 1
            last_error = f"HTTP {exc.status}: {exc.body}"
        except TimeoutError:
            # Must come before OSError: TimeoutError is a subclass of OSError.
            held_s += loop.time() - sent
            stats.timeouts += 1
            last_error = f"no reply within {timeout_s:g} s"
            if abort_after_timeout is not None and attempt < max_retries:
                await abort_after_timeout(url, rid)
        except (ConnectionError, OSError) as exc:
            held_s += loop.time() - sent
            stats.connection_errors += 1
            last_error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:
            held_s += loop.time() - sent
            stats.reply_errors += 1
            stats.failed_calls += 1
            raise held(EngineReplyError(f"engine {url} {method} {path}: {exc}"), held_s) from exc
        logger.warning(
            "engine %s %s %s failed (attempt %d of %d): %s",
            url, method, path, attempt + 1, max_retries + 1, last_error,
        )
    stats.failed_calls += 1
    raise held(EngineUnavailable(
        f"engine {url} {method} {path} failed after {max_retries + 1} attempts; "
        f"last error: {last_error}"
    ), held_s)


def held(error: EngineError, held_s: float) -> EngineError:
    """``error`` carrying how long the engine held the call's attempts (``EngineError.engine_s``)."""
    error.engine_s = held_s
    return error


async def fan_out(calls: list[Awaitable[None]], what: str) -> None:
    """Run ``calls`` (one per engine) at once; one success is enough, all failing raises the first
    error (an abort through the router: a worker without the rid does nothing)."""
    if len(calls) == 1:  # direct dispatch: the call itself, with no task around it
        await calls[0]
        return
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    for error in errors:
        if not isinstance(error, Exception):
            raise error
    if errors and len(errors) == len(results):
        raise errors[0]
    for error in errors:
        logger.warning("%s: one engine failed: %s", what, error)
