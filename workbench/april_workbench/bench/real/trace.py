"""Where a step's time goes: every model call of the step as the client saw it, and the breakdown
the bench reports per step.

``TracingTransport`` wraps the transport a comparison's clients share and records each
``/generate`` (engine, sent, replied, input and output tokens, and the engine's own ``e2e_latency``
where it reports one) on the loop's clock, which is the virtual clock in the emulated twin. From
those records, the scheduler's timeline and its metrics, ``breakdown`` derives:

* ``step_s``: the whole step; ``target_s``: until the target was met; ``drain_s``: the rest, the
  abort latency (abort sent, partial replies back);
* ``engine_idle_s``: engine-seconds before the target with none of the step's calls on the engine
  (summed over engines): the bubble;
* ``free_slots``: for a policy with an in-flight limit (copris), the mean number of its N' slots
  empty while work was waiting, before the target (refill gaps, ``april_refill_batch`` batches
  included);
* ``in_flight``: mean calls in flight before the target (all engines);
* ``transit_ms``: per call, the client's wall time minus the engine's ``e2e_latency`` (HTTP, the
  engine's front end, the client's own loop): what each round trip costs beyond generation;
* ``client_cpu_s`` / ``engine_cpu_s``: CPU seconds of the bench's process (the client) and of the
  engines' processes during the step, where they can be read.
"""

from __future__ import annotations

import asyncio
import bisect
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from april_slime.core.step_metrics import TimelinePoint
from april_slime.core.transport import Transport


@dataclass
class CallRecord:
    url: str
    sent: float
    replied: float
    input_tokens: int
    output_tokens: int
    engine_s: float | None  # the engine's e2e_latency
    finish: str


class TracingTransport:
    """A transport that records every ``/generate`` it carries (``records``)."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.records: list[CallRecord] = []

    async def request(self, method: str, url: str, path: str, payload: dict | None, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        reply = await self.inner.request(method, url, path, payload, timeout_s)
        if path == "/generate" and isinstance(reply, dict):
            meta = reply.get("meta_info") or {}
            engine_s = meta.get("e2e_latency")
            finish = meta.get("finish_reason") or {}
            self.records.append(CallRecord(
                url, sent, loop.time(), len(payload.get("input_ids", ())) if payload else 0,
                int(meta.get("completion_tokens") or 0),
                float(engine_s) if isinstance(engine_s, (int, float)) else None,
                str(finish.get("type") if isinstance(finish, dict) else finish)))
        return reply

    async def close(self) -> None:  # the stack owns the inner transport
        return None


class StepFunction:
    """A piecewise-constant function of time from (time, value from then on) points; 0 before the
    first."""

    def __init__(self, points: Iterable[tuple[float, float]]):
        pts = sorted(points, key=lambda p: p[0])
        self.times = [t for t, _ in pts]
        self.values = [v for _, v in pts]

    def __call__(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        return self.values[i] if i >= 0 else 0.0


def integrate(functions: Sequence[StepFunction], f: Callable[..., float], start: float, end: float) -> float:
    """The integral over [start, end] of ``f(values of functions)``, exact for step functions."""
    cuts = sorted({start, end, *(t for fn in functions for t in fn.times if start < t < end)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        total += (b - a) * f(*(fn(a) for fn in functions))
    return total


def in_flight(calls: Sequence[CallRecord], t0: float) -> StepFunction:
    """Calls in flight (time since t0)."""
    events = sorted([(c.sent - t0, 1) for c in calls] + [(c.replied - t0, -1) for c in calls])
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, float(n)))
    return StepFunction(out)


def breakdown(calls: Sequence[CallRecord], t0: float, step_s: float, target_s: float,
              timeline: Sequence[TimelinePoint], engine_urls: Sequence[str]) -> dict[str, float]:
    """The per-step breakdown (module doc) of the calls sent in [t0, t0 + step_s]."""
    target_s = min(max(target_s, 0.0), step_s)
    work = StepFunction((p.time, 1.0 if p.work_remaining else 0.0) for p in timeline)
    idle = 0.0
    for url in engine_urls:
        mine = in_flight([c for c in calls if c.url == url], t0)
        idle += integrate([mine], lambda n: n == 0, 0.0, target_s)
    total = in_flight(calls, t0)
    limits = [(p.time, float(p.limit)) for p in timeline if p.limit is not None]
    free = 0.0
    if limits:
        limit = StepFunction(limits)
        free = integrate([limit, total, work], lambda lim, n, w: max(0.0, lim - n) if w > 0 else 0.0,
                         0.0, target_s)
    transit = [(c.replied - c.sent) - c.engine_s for c in calls if c.engine_s is not None]
    per_s = 1.0 / target_s if target_s > 0 else 0.0
    return {
        "step_s": step_s, "target_s": target_s, "drain_s": step_s - target_s,
        "calls": float(len(calls)), "in_flight": integrate([total], float, 0.0, target_s) * per_s,
        "engine_idle_s": idle, "free_slots": free * per_s,
        "transit_ms": 1e3 * statistics.fmean(transit) if transit else float("nan"),
    }
