"""The batch of one emulated engine: continuous batching over a KV-token budget, in emulated time.

The scheduling mirrors SGLang's event loop: when the head of the waiting queue fits (KV tokens and
``max_running_requests``), a prefill step admits a batch; otherwise every running request decodes
one token per step. A request holds ``len(input) + generated`` KV tokens. When a decode step would
overflow the budget, the newest running requests are retracted: their KV is freed, they go back to
the front of the waiting queue and pay a prefill of prompt + generated tokens when readmitted.

Emulated time is ``loop.time()`` (relative to the cluster's origin) times ``time_scale``; under the
virtual clock the scale is 1 and no real time passes. The batch advances in macro steps - several
decode steps up to the next event (a finish, a KV overflow, ``max_macro_steps``) - with the time of
each step accounted exactly as if stepped one by one. The engine that drives it
(``batching.EmulatedEngine``) cuts a plan at the step in progress when an event lands inside it.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

from .config import EngineConfig
from .model import SyntheticLM
from .request import _PREFILL, _RUNNING, _WAITING, _Request


class _Plan:
    """A step in progress: a prefill of ``batch``, or ``k`` decode steps of ``batch``."""

    __slots__ = ("kind", "batch", "start", "ends", "k", "tokens")

    def __init__(self, kind: str, batch: list[_Request], start: float, ends: np.ndarray, tokens: int = 0):
        self.kind = kind
        self.batch = batch
        self.start = start
        self.ends = ends  # emulated end time of every step
        self.k = len(ends)
        self.tokens = tokens

    @property
    def end(self) -> float:
        return float(self.ends[self.k - 1])

    def steps_done(self, now: float) -> int:
        return min(self.k, int(np.searchsorted(self.ends[: self.k], now, side="right")))


class ContinuousBatch:
    """The queues, KV budget, steps and step counters of one engine, on its emulated clock.

    Synchronous and told nothing of clients: it plans the next step, applies a plan whose steps
    have elapsed and hands back the requests that finished; ``EmulatedEngine`` replies to them.
    """

    def __init__(self, model: SyntheticLM, config: EngineConfig | None = None, name: str = "engine"):
        self.model = model
        self.config = config or EngineConfig()
        self.name = name
        self.weight_version = 0
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in admission order (retraction takes from the end)
        self._kv_used = 0  # KV tokens of admitted requests (prefill + running)
        self._new_token_ratio = self.config.admission_new_token_ratio
        self._plan: _Plan | None = None
        self._t = 0.0  # emulated time up to which the engine's work is accounted
        self._origin: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Counters for the benchmark; cumulative.
        self.busy_s = 0.0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.decode_steps = 0
        self.decoded_tokens = 0  # every token a decode step produced
        self.prefill_tokens = 0
        self.recomputed_tokens = 0  # prefill of retracted requests (prompt + generated)
        self.retractions = 0
        self._timeline_t: list[float] = []
        self._timeline_running: list[int] = []
        self._timeline_kv: list[int] = []
        self._timeline_stride = 1
        self._timeline_skip = 0

    # ------------------------------------------------------------------ clock and load
    def now(self) -> float:
        if self._loop is None or self._origin is None:
            raise RuntimeError(f"{self.name} is not started")
        return (self._loop.time() - self._origin) * self.config.time_scale

    def _loop_time(self, emulated: float) -> float:
        return self._origin + emulated / self.config.time_scale

    def load(self) -> dict[str, int]:
        kv_used = self._kv_used
        plan = self._plan
        if plan is not None and plan.kind == "decode" and self._loop is not None:
            # Counters commit at the end of a macro step; report the KV of the steps done so far.
            kv_used += len(plan.batch) * plan.steps_done(self.now())
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting),
            "num_used_tokens": kv_used,
            "max_total_num_tokens": self.config.kv_capacity_tokens,
            "num_retractions": self.retractions,
        }

    # ------------------------------------------------------------------ steps
    def _next_plan(self) -> _Plan | None:
        """Decide the next step at the current accounting time (prefill first, as SGLang does)."""
        if not self._running and not self._waiting:
            return None
        # Back to back while requests are running; an engine with nothing running starts when
        # it is told (arrivals), not before.
        start = self._t if self._running else max(self._t, self.now())
        self._t = start
        batch = self._admit()
        if batch:
            tokens = sum(r.kv_tokens for r in batch)
            pairs = sum(r.kv_tokens * (r.kv_tokens + 1) / 2.0 for r in batch)
            cost = self.config.time.prefill_step(tokens, pairs, len(batch))
            self._plan = _Plan("prefill", batch, start, np.array([start + cost]), tokens)
            return self._plan
        if not self._running:
            # Nothing fits even in an empty engine; submit() rejects such requests, so this
            # is a broken invariant, not a load condition.
            raise RuntimeError(f"{self.name}: waiting request cannot be admitted into an empty engine")
        self._retract_to_fit()
        n = len(self._running)
        cap = self.config.kv_capacity_tokens
        k = min(self.config.max_macro_steps, (cap - self._kv_used) // n)
        for req in self._running:
            if not req.version_starts or req.version_values[-1] != self.weight_version:
                self._set_version(req, req.next_pos)
            k = min(k, req.steps_left())
        tm = self.config.time
        kv = self._kv_used + n * np.arange(k)
        durations = tm.decode_fixed(n) + tm.decode_per_kv_token * kv
        self._plan = _Plan("decode", list(self._running), start, start + np.cumsum(durations))
        return self._plan

    def _growth_reserve(self, req: _Request) -> float:
        """KV kept free at admission for ``req``'s future growth (conservative admission)."""
        cfg = self.config
        return self._new_token_ratio * min(req.max_new_tokens - req.generated,
                                           cfg.admission_clip_new_tokens)

    def _head_admissible(self, kv_used: int, num_running: int, growth: float = 0.0) -> bool:
        if not self._waiting or num_running >= self.config.max_running_requests:
            return False
        head = self._waiting[0]
        need = kv_used + head.kv_tokens + self.config.admission_reserve_tokens
        if self._new_token_ratio > 0.0:
            need += growth + self._growth_reserve(head)
        return need <= self.config.kv_capacity_tokens

    def _head_admissible_after(self, plan: _Plan, j: int) -> bool:
        """Whether the head of the waiting queue could be admitted after step ``j + 1`` of decode ``plan``."""
        kv_then = self._kv_used + len(plan.batch) * (j + 1)
        growth = 0.0
        if self._new_token_ratio > 0.0:
            cfg = self.config
            growth = sum(self._new_token_ratio * min(r.max_new_tokens - r.generated - (j + 1),
                                                     cfg.admission_clip_new_tokens)
                         for r in plan.batch)
        return self._head_admissible(kv_then, len(self._running), growth)

    def _admit(self) -> list[_Request]:
        batch: list[_Request] = []
        tokens = 0
        growth = 0.0
        if self._new_token_ratio > 0.0:
            growth = sum(self._growth_reserve(r) for r in self._running)
        while self._head_admissible(self._kv_used, len(self._running) + len(batch), growth):
            head = self._waiting[0]
            if batch and tokens + head.kv_tokens > self.config.max_prefill_tokens:
                break
            if self._new_token_ratio > 0.0:
                growth += self._growth_reserve(head)
            self._waiting.popleft()
            head.state = _PREFILL
            self._kv_used += head.kv_tokens
            tokens += head.kv_tokens
            batch.append(head)
        return batch

    def _retract_to_fit(self) -> None:
        """Retract running requests until one more decode step fits the KV budget."""
        cap = self.config.kv_capacity_tokens
        if self._kv_used + len(self._running) <= cap:
            return
        sglang = self.config.retraction == "sglang"
        if sglang:
            # ScheduleBatch.retract_decode pops from the end of this order: fewest output tokens
            # (then longest input) leave first. Kept in admission order otherwise.
            victims = sorted(self._running, key=lambda r: (r.generated, -r.input_len), reverse=True)
        while len(self._running) > 1 and self._kv_used + len(self._running) > cap:
            req = victims.pop() if sglang else self._running[-1]
            self._running.remove(req)
            self._kv_used -= req.kv_tokens
            req.state = _WAITING
            req.retracted = True
            if sglang:
                self._waiting.append(req)
            else:
                self._waiting.appendleft(req)
            self.retractions += 1
        if self.config.new_token_ratio_decay > 0.0:
            decoded = sum(r.generated for r in self._running)
            budget = sum(r.max_new_tokens for r in self._running)
            self._new_token_ratio = min(
                1.0, (decoded + self.config.retract_decode_steps * len(self._running)) / (budget + 1))

    def _set_version(self, req: _Request, pos: int) -> None:
        """From absolute position ``pos`` on, ``req`` generates under the engine's version."""
        if req.version_starts and req.version_starts[-1] == pos:
            req.version_values[-1] = self.weight_version
        elif not req.version_values or req.version_values[-1] != self.weight_version:
            req.version_starts.append(pos)
            req.version_values.append(self.weight_version)
        limit = req.input_len + req.max_new_tokens
        req.end_pos = self.model.first_stop(req.profile, pos, limit, self.weight_version)

    def _truncate(self, plan: _Plan, k: int) -> None:
        plan.k = max(1, min(plan.k, k))

    def _apply(self, plan: _Plan) -> list[tuple[_Request, str]]:
        """The plan's steps have all elapsed: apply them; returns the requests they finished, with
        the reason, for the engine to reply to (in batch order)."""
        finished: list[tuple[_Request, str]] = []
        self._plan = None
        self._t = plan.end
        elapsed = plan.end - plan.start
        self.busy_s += elapsed
        if plan.kind == "prefill":
            self.prefill_s += elapsed
            self.prefill_tokens += plan.tokens
            for req in plan.batch:
                if req.retracted:
                    self.recomputed_tokens += req.kv_tokens
                    req.retracted = False
                req.state = _RUNNING
                self._running.append(req)
        else:
            k = plan.k
            self.decode_s += elapsed
            self.decode_steps += k
            self.decoded_tokens += k * len(plan.batch)
            self._kv_used += k * len(plan.batch)
            if self.config.new_token_ratio_decay > 0.0:
                self._new_token_ratio = max(self.config.min_new_token_ratio,
                                            self._new_token_ratio - self.config.new_token_ratio_decay * k)
            for req in plan.batch:
                req.generated += k
                if req.end_pos is not None and req.next_pos > req.end_pos:
                    self._remove_admitted(req)
                    finished.append((req, "stop"))
                elif req.generated >= req.max_new_tokens:
                    self._remove_admitted(req)
                    finished.append((req, "length"))
        self._record_timeline(plan.end)
        return finished

    def _remove_admitted(self, req: _Request) -> None:
        self._running.remove(req)
        self._kv_used -= req.kv_tokens

    def _record_timeline(self, t: float) -> None:
        self._timeline_skip += 1
        if self._timeline_skip < self._timeline_stride:
            return
        self._timeline_skip = 0
        self._timeline_t.append(t)
        self._timeline_running.append(len(self._running))
        self._timeline_kv.append(self._kv_used)
        if len(self._timeline_t) >= self.config.timeline_max_points:
            # Keep every other point and sample half as often from now on.
            for series in (self._timeline_t, self._timeline_running, self._timeline_kv):
                del series[1::2]
            self._timeline_stride *= 2
