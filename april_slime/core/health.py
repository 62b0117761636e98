"""Engine health: which engines may take requests, and how a step finds out that one may not.

``EngineHealth`` is held by the scheduler across steps. An engine whose call failed (the client
already retried what was safe to retry), that did not answer an abort before the drain deadline,
or that stalled (requests in flight, no reply for ``stall_probe_after_s``, and a failed health
probe) is taken out of dispatch until it answers a health probe (a one-token generate within
``probe_timeout_s``, retried every ``probe_interval_s`` while a step runs). An engine still out
when a step starts is probed again by that step, before its first call is dispatched: one that
answers (a launcher restarted it, on the same address) takes its share of the step's first calls,
which may be all of the step's calls. An engine that let a request, an abort or a probe go
unanswered past its timeout is not waited for (each step would wait ``probe_timeout_s`` on it);
it is probed while the step runs. When every engine is out, all of them are used (their failures
then end the step).

``EngineWatch`` is one step's view of the engines: the step's requests in flight per engine, when
each engine last answered, the dispatch choice (verl's per-engine supplementation: the healthy
engine with the fewest requests of this step in flight, so a refill lands where a slot just
freed), stall detection and the probe tasks, and the engine loads polled for a policy that adapts
its in-flight limit to them. It reports probe outcomes as ``("probe", url,
error)`` events on the step's queue; when a probe finds an engine stalled, the step moves that
engine's calls elsewhere (their trajectories keep what they had). It counts calls, not work items,
so a multi-turn episode's model calls are watched like a trajectory's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from april_slime.core.engine import EngineClient
from april_slime.core.policies import Policy
from april_slime.core.sglang_protocol import EngineError
from april_slime.core.step_context import ConcurrencyChosen, ProbeAnswered, StepContext

logger = logging.getLogger(__name__)


class EngineHealth:
    """Which engines may take requests. One instance per scheduler, kept across steps, so an engine
    that failed stays out of dispatch in the next step until it answers a health probe."""

    def __init__(self, urls: Iterable[str]):
        self.urls = list(urls)
        self.excluded: dict[str, str] = {}  # url -> why it is out of dispatch
        # excluded engines that left something unanswered past its timeout: a step does not wait
        # for their probe before dispatching
        self.unanswering: set[str] = set()
        self.exclusions = 0  # cumulative
        self.readmissions = 0  # cumulative

    def usable(self) -> list[str]:
        """Engines to dispatch to; every engine when all of them are out (nothing better left)."""
        healthy = [u for u in self.urls if u not in self.excluded]
        return healthy or list(self.urls)

    def exclude(self, url: str, reason: str, *, unanswering: bool = False) -> None:
        """``unanswering``: the engine let a request, an abort or a probe go unanswered past its
        timeout (rather than failing it)."""
        if url not in self.excluded:
            self.exclusions += 1
            logger.warning("engine %s taken out of dispatch until it answers a health probe: %s",
                           url, reason)
        self.excluded[url] = reason
        if unanswering:
            self.unanswering.add(url)

    def readmit(self, url: str) -> None:
        self.unanswering.discard(url)
        if self.excluded.pop(url, None) is not None:
            self.readmissions += 1
            logger.info("engine %s answered and is back in dispatch", url)


class EngineWatch:
    """The engines as one step sees them; lives as long as the step."""

    def __init__(self, step: StepContext, health: EngineHealth, client: EngineClient, *,
                 stall_probe_after_s: float | None, probe_timeout_s: float, probe_interval_s: float):
        self.step = step
        self.health = health
        self.client = client
        self.stall_probe_after_s = stall_probe_after_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self.in_flight = {url: 0 for url in client.engine_urls}  # this step's requests per engine
        self.last_activity = {url: 0.0 for url in client.engine_urls}
        self.probes: dict[str, asyncio.Task] = {}
        self.poller: asyncio.Task | None = None

    # ------------------------------------------------------------------ dispatch
    def pick(self) -> str:
        return min(self.health.usable(), key=lambda u: self.in_flight[u])

    def call_started(self, url: str) -> None:
        if self.in_flight[url] == 0:
            self.last_activity[url] = self.step.loop.time()  # the stall clock starts with its first call
        self.in_flight[url] += 1

    def call_ended(self, url: str, answered: bool) -> None:
        self.in_flight[url] -= 1
        if answered:
            self.last_activity[url] = self.step.loop.time()

    def busy(self) -> list[str]:
        """Engines with requests of this step in flight."""
        return [u for u, n in self.in_flight.items() if n > 0]

    # ------------------------------------------------------------------ stalls and probes
    def _stall_deadlines(self) -> dict[str, float]:
        """Busy engines not being probed -> the time at which their silence counts as a stall."""
        after = self.stall_probe_after_s
        if after is None:
            return {}
        return {u: self.last_activity[u] + after for u, n in self.in_flight.items()
                if n > 0 and u not in self.probes}

    def until_stall_check(self) -> float | None:
        deadlines = self._stall_deadlines()
        return max(min(deadlines.values()) - self.step.loop.time(), 0.0) if deadlines else None

    def check_stalls(self) -> None:
        """An engine with requests in flight and no reply for ``stall_probe_after_s`` gets a health
        probe; if that fails too, the step moves its calls elsewhere (``on_probe``)."""
        # a millisecond of slack: a timer set for the deadline may fire a rounding error early
        now = self.step.loop.time() + 1e-3
        for url, deadline in self._stall_deadlines().items():
            if now >= deadline:
                # info, not a warning: a long response (16K tokens at a few hundred tokens/s) is
                # silent this long on a healthy engine; a failed probe warns (``exclude``)
                logger.info("engine %s: %d requests in flight and no reply for %.0f s; probing it",
                            url, self.in_flight[url], now - self.last_activity[url])
                self.start_probe(url)

    async def probe_excluded(self) -> None:
        """At the start of a step, before its first call: every engine out of dispatch is probed
        once, at once, and one that answers is back for the step's first calls. Without the wait an
        engine back since the last step (a launcher restarted it at the same address) would get none
        of them: they are dispatched before any probe can answer, and a step whose calls all fit in
        its first fill (or that needs no call, its groups all buffered) would leave it out whole.
        Engines that left something unanswered past its timeout are not waited for. Those still out
        are probed every ``probe_interval_s`` while the step runs."""
        waited = [u for u in self.health.excluded if u not in self.health.unanswering]
        await asyncio.gather(*(self._probe_once(u) for u in waited))
        for url in list(self.health.excluded):
            self.start_probe(url, first_after_s=self.probe_interval_s if url in waited else 0.0)

    async def _probe_once(self, url: str) -> None:
        started = self.step.loop.time()
        try:
            await self.client.probe(url, timeout_s=self.probe_timeout_s)
        except Exception as e:
            self.step.counters.probe_failures += 1
            # no reply within the timeout: the next steps start without waiting for it
            silent = self.step.loop.time() - started >= self.probe_timeout_s
            logger.info("engine %s, out of dispatch, failed its health probe at the step's start: %s", url, e)
            self.health.exclude(url, self.health.excluded[url], unanswering=silent)
        else:
            self.health.readmit(url)

    def start_probe(self, url: str, first_after_s: float = 0.0) -> None:
        if url not in self.probes:
            self.probes[url] = self.step.loop.create_task(self._probe_loop(url, first_after_s))

    async def _probe_loop(self, url: str, first_after_s: float = 0.0) -> None:
        if first_after_s > 0:
            await asyncio.sleep(first_after_s)
        while True:
            try:
                await self.client.probe(url, timeout_s=self.probe_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.step.report(ProbeAnswered(url, e))
                await asyncio.sleep(self.probe_interval_s)
            else:
                self.step.report(ProbeAnswered(url, None))
                return

    def on_probe(self, url: str, error: Exception | None) -> bool:
        """Handle a probe outcome; True when it found ``url`` stalled (its calls must move)."""
        if error is None:
            self.probes.pop(url, None)
            self.last_activity[url] = self.step.loop.time()
            self.health.readmit(url)
            return False
        self.step.counters.probe_failures += 1
        if url in self.health.excluded:
            return False
        self.step.counters.stalled_engines += 1
        self.health.exclude(url, f"no reply for {self.stall_probe_after_s:g} s with requests in "
                                 f"flight, and the health probe failed: {error}", unanswering=True)
        return True

    # ------------------------------------------------------------------ loads
    def watch_loads(self, policy: Policy, interval_s: float) -> None:
        """Feed the engine loads to a policy that adapts to them (copris with a controller) every
        ``interval_s``; its new limit comes back as a ``("concurrency", n)`` event, so the step
        takes it between events like every other change of its state."""
        self.poller = self.step.loop.create_task(self._poll_loads(policy, interval_s))

    async def _poll_loads(self, policy: Policy, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                loads = await self.client.loads()
            except EngineError as e:
                self.step.counters.load_poll_errors += 1
                logger.warning("reading engine loads failed: %s", e)
                continue
            target = policy.observe(loads, self.step.loop.time())
            if target != policy.in_flight_limit:
                self.step.report(ConcurrencyChosen(target))

    def stop_load_watch(self) -> None:
        if self.poller is not None:
            self.poller.cancel()

    def stop(self) -> None:
        """Probes and the load poller live only as long as the step (an engine still out of
        dispatch is probed again by the next step)."""
        self.stop_load_watch()
        for task in self.probes.values():
            task.cancel()
        self.probes.clear()
