"""Which engines a job has: the router's list of workers, read until it is complete.

slime starts ``sglang-router`` in front of its engines and registers each engine with it; the
engine client reads ``GET {router}/workers`` (``EngineClient.from_router``) until the list is what
``EngineWait`` asks for, then takes the dispatch ``dispatch.choose`` picks for those workers. A URL
that has no ``/workers`` but answers as an SGLang engine is taken as the job's only engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from april_slime.core.dispatch import DeploymentHints, Dispatch, choose, parse_workers
from april_slime.core.retries import CONTROL_TIMEOUT_S, EngineStats, call_with_retries
from april_slime.core.sglang_protocol import EngineError, RequestRejected
from april_slime.core.transport import Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineWait:
    """What ``from_router`` waits for before it takes the router's list of engines.

    slime registers each engine it starts with ``POST {router}/workers`` and carries on at any 2xx;
    sglang-router 0.3 answers ``202 Worker addition queued`` and lists the engine only after its own
    health check, so a list read just after start-up can be short, or empty. The client therefore
    reads ``/workers`` every ``poll_s`` until it lists ``expected`` engines (the number the launcher
    started), or, where that number is unknown, until a non-empty list has read the same
    ``stable_reads`` times in a row; past ``deadline_s`` it fails, saying what it waited for."""

    expected: int | None = None
    deadline_s: float = 300.0
    poll_s: float = 0.5
    stable_reads: int = 1

    def __post_init__(self) -> None:
        if self.expected is not None and self.expected < 1:
            raise ValueError(f"expected must be >= 1 or None, got {self.expected}")
        if not (self.deadline_s >= 0 and self.poll_s > 0 and self.stable_reads >= 1):
            raise ValueError(f"bad engine wait {self}")

    def describe(self) -> str:
        if self.expected is not None:
            return f"the {self.expected} engine(s) the launcher started"
        if self.stable_reads > 1:
            return f"a non-empty list of engines that reads the same {self.stable_reads} times in a row"
        return "at least one engine"

    def satisfied(self, engines: list[str], same_reads: int) -> bool:
        if not engines:
            return False
        if self.expected is not None:
            return len(engines) >= self.expected
        return same_reads >= self.stable_reads


ANY_ENGINE = EngineWait()  # the default: the first non-empty list of engines


async def discover(router_url: str, transport: Transport, dispatch: str, hints: DeploymentHints | None,
                   wait: EngineWait, *, timeout_s: float, max_retries: int, retry_backoff_s: float,
                   answers_as_engine: Callable[[], Awaitable[None]]) -> Dispatch:
    """The router's workers, once they are what ``wait`` asks for, and the dispatch chosen for them
    (``dispatch.choose``); a URL without ``/workers`` is the job's only engine if
    ``answers_as_engine()`` passes (see ``EngineClient.from_router``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    previous: list[str] | None = None
    same_reads = reads = 0
    while True:
        reads += 1
        try:
            reply = await call_with_retries(
                transport, router_url, "GET", "/workers", None,
                timeout_s=min(timeout_s, CONTROL_TIMEOUT_S), max_retries=max_retries,
                retry_backoff_s=retry_backoff_s, stats=EngineStats(),
            )
        except RequestRejected as exc:
            if exc.status != 404:
                raise
            return await _bare_engine(router_url, answers_as_engine)
        workers = parse_workers(reply, router_url)
        engines = sorted({w.url for w in workers})  # a DP-aware router lists an engine once per rank
        same_reads = same_reads + 1 if engines == previous else 1
        previous = engines
        waited = loop.time() - started
        if wait.satisfied(engines, same_reads):
            if reads > 1:
                logger.info("router %s lists %d engine(s) after %.1f s: %s", router_url, len(engines), waited, engines)
            return choose(dispatch, router_url, workers, hints)
        if waited >= wait.deadline_s:
            listed = f"lists {len(engines)} engine(s) {engines}" if engines else "lists no engines"
            raise EngineError(
                f"router {router_url} {listed} after {waited:.0f} s of waiting for {wait.describe()}; an "
                "engine is registered with POST /workers, and sglang-router lists it only once its own "
                "health check passed: see the router's log for an engine that failed it "
                "(april_engine_wait_s sets how long to wait)"
            )
        await asyncio.sleep(min(wait.poll_s, max(wait.deadline_s - waited, 0.0)))


async def _bare_engine(router_url: str, answers_as_engine: Callable[[], Awaitable[None]]) -> Dispatch:
    """``router_url`` has no ``/workers``: it is used alone if it answers as an SGLang engine."""
    try:
        await answers_as_engine()
    except EngineError as exc:
        raise EngineError(
            f"{router_url} is not a router: GET /workers answered HTTP 404, and it does not answer as "
            f"an SGLang engine either ({exc}); a router URL is expected (sglang-router, slime's "
            "--sglang-router-ip/--sglang-router-port)"
        ) from exc
    logger.warning(
        "%s has no /workers (HTTP 404): a router URL is expected; it answers as an SGLang "
        "engine, so it is used as the only rollout engine", router_url,
    )
    return Dispatch.direct([router_url], "a single engine, no router")
