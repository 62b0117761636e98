"""The rollout engines of a job, found again at every step, and the policy version they serve.

A job's engines sit behind its router. ``EngineConnection`` reads the router's list at every step,
so an engine that a launcher's fault tolerance restarted on a new port is picked up; it keeps one
``EngineClient`` while the list stays the same and builds a new one (closing the old) when it
changes. Before a new client's first call it refuses requests that the router would silently strip
(``check_router_fields``).

Policy versions. The trainer counts weight updates and pushes the count to the engines with every
update; SGLang reports it as ``meta_info["weight_version"]`` and on ``GET /get_weight_version``.
That engine-reported number is the policy version: it is what generated each token. The count
restarts with a restarted job while a restored buffer keeps the old numbers, so the first step after
a restore shifts the engines' numbers by a constant (``version_offset``) that continues the saved
numbering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.core.dispatch import DeploymentHints, router_dropped_fields
from april_slime.core.engine import EngineClient, EngineWait
from april_slime.core.replay import ReplaySpec
from april_slime.core.sglang_protocol import EngineError

logger = logging.getLogger(__name__)


class EngineConnection:
    """The job's engine client, rebuilt when the router's list of engines changes."""

    def __init__(self, router_url: str, config: AprilConfig, *, hints: DeploymentHints,
                 expected_engines: int | None, vocab_size: int | None, replay: ReplaySpec,
                 sampling_params: Mapping[str, Any]) -> None:
        self.router_url = router_url
        self.config = config
        self.hints = hints
        self.expected_engines = expected_engines  # how many the launcher starts; None: unknown
        self.vocab_size = vocab_size
        self.replay = replay
        self.sampling_params = sampling_params
        self.client: EngineClient | None = None
        self.version_offset: int | None = None  # set by the first policy_version

    async def refresh(self, check_new: Any = None) -> bool:
        """Read the router's engines; True when the client changed (a new one replaced the last).
        ``check_new(client)`` (async) vets a new client before it is taken; it raises to refuse."""
        config = self.config
        if self.client is None:  # job start: the engines a launcher started may not be listed yet
            wait = EngineWait(expected=self.expected_engines, deadline_s=config.engine_wait_s, stable_reads=3)
        else:  # later steps take what is listed (an engine being restarted joins when listed)
            wait = EngineWait(deadline_s=config.engine_wait_s)
        fresh = await EngineClient.from_router(
            self.router_url, dispatch=config.dispatch, hints=self.hints, wait=wait,
            timeout_s=config.request_timeout_s, max_retries=config.max_retries,
            retry_backoff_s=config.retry_backoff_s, vocab_size=self.vocab_size, replay=self.replay)
        if self.client is not None and fresh.dispatch == self.client.dispatch:
            await fresh.close()
            return False
        try:
            check_router_fields(fresh.dispatch, self.sampling_params, self.replay)
            if check_new is not None:
                await check_new(fresh)
        except BaseException:
            await fresh.close()
            raise
        if self.client is None or fresh.dispatch.mode != self.client.dispatch.mode:
            logger.info("april_slime: %s", fresh.dispatch.describe())
            for note in fresh.dispatch.notes:
                logger.info("april_slime: %s", note)
        if self.client is not None:
            logger.info("rollout engines changed: %s -> %s", self.client.worker_urls, fresh.worker_urls)
            await self.client.close()
        fresh.version_offset = self.version_offset or 0
        self.client = fresh
        return True

    async def policy_version(self, usable: list[str], restored: int | None) -> int:
        """The engines' current weight version, in the job's continuous numbering (``restored``: the
        version saved with the restored buffer, None without one). Asks the engines in dispatch
        (``usable``) and needs one answer: an engine that stopped answering must not hold up the
        step (the scheduler's health probes bring it back)."""
        # the engines out of dispatch are asked only when none in dispatch answers: one of them may
        # be back, and the step's own probes readmit it (else one dead engine would end the job)
        others = [u for u in self.client.engine_urls if u not in usable]
        raw, errors = [], []
        for urls in (usable, others):
            replies = await asyncio.gather(*(self.client.engine_weight_version(u) for u in urls),
                                           return_exceptions=True)
            raw = [r for r in replies if not isinstance(r, BaseException)]
            for url, r in zip(urls, replies):
                if isinstance(r, BaseException):
                    if not isinstance(r, Exception):
                        raise r
                    logger.warning("engine %s did not report its weight version: %s", url, r)
                    errors.append(r)
            if raw:
                break
        if not raw:
            # every engine was asked (in dispatch or not) and none answered: the step cannot start;
            # the last engine's own error says why (a caller retries the step on EngineError)
            raise errors[-1] if errors else EngineError("no rollout engine to ask for its weight version")
        if len(set(raw)) > 1:
            logger.warning("rollout engines report different weight versions %s; using the newest", raw)
        newest = max(raw)
        if self.version_offset is None:
            # after a restore, the first update the engines received is the saved policy's successor
            self.version_offset = max(0, restored + 1 - newest) if restored is not None else 0
            self.client.version_offset = self.version_offset
            if self.version_offset:
                logger.info("engine weight versions restarted after restore; shifting by %d to continue "
                            "the saved numbering (saved policy version %d)", self.version_offset, restored)
        return newest + self.version_offset

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


def check_router_fields(dispatch: Any, sampling_params: Mapping[str, Any], replay: ReplaySpec) -> None:
    """Before the first call: a job whose requests carry a field the router drops cannot run with
    router dispatch (its replies would silently lack what the field asks for)."""
    if dispatch.mode != "router":
        return
    probe = {"sampling_params": dict(sampling_params), "return_routed_experts": replay.routed}
    dropped = router_dropped_fields(probe)
    if dropped:
        raise AprilConfigError(f"april_dispatch: {dispatch.describe()}, but the router drops {', '.join(dropped)}, "
                               "which this job's requests need; run the engines without the router's help "
                               "(april_dispatch: direct, regular workers)")
