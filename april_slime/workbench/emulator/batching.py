"""One emulated engine: continuous batching over a KV-token budget, in emulated time.

The scheduling mirrors SGLang's event loop: when the head of the waiting queue fits (KV tokens and
``max_running_requests``), a prefill step admits a batch; otherwise every running request decodes
one token per step. A request holds ``len(input) + generated`` KV tokens. When a decode step would
overflow the budget, the newest running requests are retracted: their KV is freed, they go back to
the front of the waiting queue and pay a prefill of prompt + generated tokens when readmitted.

Time: a decode step costs ``t0 + c_req * num_running + c_kv * kv_tokens_in_use`` emulated seconds,
a prefill ``prefill_t0 + prefill_per_token * tokens``. Emulated time is ``loop.time()`` (relative to
the cluster's origin) times ``time_scale``; under the virtual clock the scale is 1 and no real time
passes. The loop advances in macro steps - several decode steps up to the next event (a finish, a
KV overflow, ``max_macro_steps``) - with the time of each step accounted exactly as if stepped one by
one. Arrivals, aborts and weight-version bumps inside a macro step cut it at the step in progress,
so what a client sees is what step-by-step execution would give: an abort returns exactly the
tokens of the steps completed before it.

Tokens are never materialised while running: a request records its generated count and the
positions where its weight version changed, and its tokens are computed (vectorised) from
``SyntheticLM`` when it replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from itertools import repeat
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .model import SampleProfile, SyntheticLM, prompt_key


@dataclass(frozen=True)
class TimeModel:
    """Per-step costs in emulated seconds (defaults loosely: a 4B model, one H100, SGLang)."""

    decode_t0: float = 0.010  # floor of one decode step (weights read, kernel launches)
    decode_per_request: float = 4e-5  # per running request per step
    decode_per_kv_token: float = 3e-8  # per KV token in use (attention reads): 3 ms per 100k
    prefill_t0: float = 0.005  # floor of one prefill step
    prefill_per_token: float = 2e-5  # per prefilled (or recomputed) token: 50k tokens/s
    # Attention of a prefill grows with the context: a request prefilling n tokens from scratch
    # (no prefix cache survives a weight update) pays for n (n + 1) / 2 query-key pairs. This is
    # what makes re-prefilling a resumed 30K-token partial cost more than 30K x prefill_per_token.
    prefill_per_token_pair: float = 0.0
    # CUDA graphs are captured up to this batch (0: every batch); a larger decode batch runs
    # eagerly and pays ``eager_step_extra_s`` of kernel-launch overhead per step.
    graph_max_batch: float = 0.0
    eager_step_extra_s: float = 0.0
    # Roofline of the dense layers: a decode step reads the weights (part of ``decode_t0``) while
    # it computes ``decode_flops_per_request`` seconds of matmuls per request; the two overlap, so
    # the compute only adds time once it exceeds ``decode_overlap_s`` (the weight-read time).
    decode_flops_per_request: float = 0.0
    decode_overlap_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"TimeModel.{name} must be a finite value >= 0, got {value}")
        if self.decode_t0 <= 0.0 and self.decode_per_request <= 0.0:
            raise ValueError("TimeModel: a decode step must cost time (decode_t0 or decode_per_request > 0)")

    def decode_fixed(self, num_running: int) -> float:
        """The part of a decode step that does not depend on the KV in use."""
        eager = (self.eager_step_extra_s
                 if self.graph_max_batch > 0 and num_running > self.graph_max_batch else 0.0)
        compute = max(0.0, self.decode_flops_per_request * num_running - self.decode_overlap_s)
        return self.decode_t0 + eager + self.decode_per_request * num_running + compute

    def decode_step(self, num_running: int, kv_tokens: int) -> float:
        return self.decode_fixed(num_running) + self.decode_per_kv_token * kv_tokens

    def prefill_step(self, tokens: int, token_pairs: float = 0.0) -> float:
        """A prefill of ``tokens`` tokens whose attention covers ``token_pairs`` query-key pairs."""
        return self.prefill_t0 + self.prefill_per_token * tokens + self.prefill_per_token_pair * token_pairs


@dataclass(frozen=True)
class EngineConfig:
    """Capacity, batching limits and clock of one emulated engine."""

    time: TimeModel = field(default_factory=TimeModel)
    # KV budget in tokens; ~Qwen3-4B (144 KiB per token in bf16) on an 80 GB H100 at 0.8 memory fraction.
    kv_capacity_tokens: int = 350_000
    max_running_requests: int = 1024
    max_prefill_tokens: int = 16384  # tokens admitted per prefill step (one larger request still goes alone)
    admission_reserve_tokens: int = 1024  # KV kept free at admission for the running requests' growth
    # SGLang-style conservative admission: also keep free this fraction of every running request's
    # remaining budget (clipped to admission_clip_new_tokens). 0 = admit whatever fits now.
    admission_new_token_ratio: float = 0.0
    admission_clip_new_tokens: int = 4096
    # SGLang's NewTokenRatioTracker: the ratio above decays by this much per decode step down to
    # ``min_new_token_ratio`` (SGLang: 0.7 -> 0.098 over 600 steps), and after a retraction jumps
    # to (decoded + retract_decode_steps x running) / max_new_tokens of what still runs.
    # 0 = a fixed ratio.
    new_token_ratio_decay: float = 0.0
    min_new_token_ratio: float = 0.0
    retract_decode_steps: int = 20
    # Which running request a KV overflow retracts, and where it waits: "newest-front" (the most
    # recently admitted, back to the head of the queue: vLLM-like) or "sglang" (SGLang 0.5's
    # ScheduleBatch.retract_decode: fewest output tokens first, ties to the longest input, queued
    # at the back).
    retraction: str = "newest-front"
    # Seconds between an abort and its reply (the scheduler frees the request at its next step
    # and the tokenizer manager sends the reply); the engine goes on meanwhile.
    abort_latency_s: float = 0.0
    max_macro_steps: int = 32  # decode steps advanced at once when nothing happens in between
    time_scale: float = 1.0  # emulated seconds per loop second (real clock); 1 under the virtual clock
    timeline_max_points: int = 4096

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be >= 2, got {self.kv_capacity_tokens}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 <= self.admission_reserve_tokens < self.kv_capacity_tokens:
            raise ValueError("admission_reserve_tokens must be in [0, kv_capacity_tokens)")
        if not 0.0 <= self.admission_new_token_ratio <= 1.0:
            raise ValueError("admission_new_token_ratio must be in [0, 1]")
        if self.admission_clip_new_tokens < 0:
            raise ValueError("admission_clip_new_tokens must be >= 0")
        if not 0.0 <= self.min_new_token_ratio <= 1.0 or not self.new_token_ratio_decay >= 0.0:
            raise ValueError("min_new_token_ratio must be in [0, 1] and new_token_ratio_decay >= 0")
        if self.retract_decode_steps < 0:
            raise ValueError("retract_decode_steps must be >= 0")
        if self.retraction not in ("newest-front", "sglang"):
            raise ValueError(f"retraction must be 'newest-front' or 'sglang', got {self.retraction!r}")
        if not (self.abort_latency_s >= 0.0 and math.isfinite(self.abort_latency_s)):
            raise ValueError(f"abort_latency_s must be a finite value >= 0, got {self.abort_latency_s}")
        if self.max_macro_steps < 1:
            raise ValueError(f"max_macro_steps must be >= 1, got {self.max_macro_steps}")
        if not (self.time_scale > 0.0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.timeline_max_points < 2:
            raise ValueError("timeline_max_points must be >= 2")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RequestRejected(ValueError):
    """A generate request the engine cannot take (HTTP 400)."""


class EngineStopped(RuntimeError):
    """The engine is not running (stopped, or its scheduling loop failed): HTTP 503."""


_WAITING, _PREFILL, _RUNNING, _DONE = "waiting", "prefill", "running", "done"


class _Request:
    __slots__ = ("rid", "input_len", "key", "sampling_seed", "max_new_tokens", "profile",
                 "return_logprob", "generated", "version_starts", "version_values", "end_pos",
                 "state", "future", "arrival_t", "retracted")

    def __init__(self, rid: str, input_len: int, key: int, sampling_seed: int, max_new_tokens: int,
                 profile: SampleProfile, return_logprob: bool, future: asyncio.Future, now: float):
        self.rid = rid
        self.input_len = input_len
        self.key = key
        self.sampling_seed = sampling_seed
        self.max_new_tokens = max_new_tokens
        self.profile = profile
        self.return_logprob = return_logprob
        self.generated = 0
        # Weight version of generated tokens, as runs: tokens from absolute position
        # version_starts[i] on were generated under version_values[i].
        self.version_starts: list[int] = []
        self.version_values: list[int] = []
        self.end_pos: int | None = None  # absolute position of the EOS under the current version
        self.state = _WAITING
        self.future = future
        self.arrival_t = now
        self.retracted = False

    @property
    def kv_tokens(self) -> int:
        return self.input_len + self.generated

    @property
    def next_pos(self) -> int:
        return self.input_len + self.generated

    def steps_left(self) -> int:
        """Decode steps until this request finishes (stop or length)."""
        by_length = self.max_new_tokens - self.generated
        if self.end_pos is None:
            return by_length
        return min(by_length, self.end_pos - self.next_pos + 1)


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


class EmulatedEngine:
    """The scheduler and memory model of one engine. All calls run on the event loop's thread."""

    def __init__(self, model: SyntheticLM, config: EngineConfig | None = None, name: str = "engine"):
        self.model = model
        self.config = config or EngineConfig()
        self.name = name
        self.weight_version = 0
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in admission order (retraction takes from the end)
        self._kv_used = 0  # KV tokens of admitted requests (prefill + running)
        self._new_token_ratio = self.config.admission_new_token_ratio
        self._plan: _Plan | None = None
        self._t = 0.0  # emulated time up to which the engine's work is accounted
        self._origin: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False
        # Counters for the benchmark; cumulative.
        self.busy_s = 0.0
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.decode_steps = 0
        self.decoded_tokens = 0  # every token a decode step produced
        self.delivered_tokens = 0  # tokens returned to clients (finished or aborted replies)
        self.prefill_tokens = 0
        self.recomputed_tokens = 0  # prefill of retracted requests (prompt + generated)
        self.retractions = 0
        self.finished_requests = 0
        self.aborted_requests = 0
        self.first_arrival_t: float | None = None
        self.last_reply_t: float | None = None
        self._timeline_t: list[float] = []
        self._timeline_running: list[int] = []
        self._timeline_kv: list[int] = []
        self._timeline_stride = 1
        self._timeline_skip = 0

    # ------------------------------------------------------------------ lifecycle and clock
    def start(self, origin: float | None = None) -> None:
        """Start the scheduling task on the running loop; ``origin`` is loop time of emulated 0."""
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time() if origin is None else origin
        self._t = self.now()
        self._task = self._loop.create_task(self._run(), name=f"emulator-{self.name}")
        self._task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the scheduling loop must not leave clients waiting forever: fail them loudly.
        self._closed = True
        error = EngineStopped(f"{self.name}: scheduling loop failed: {task.exception()!r}")
        for req in list(self._requests.values()):
            req.state = _DONE
            if not req.future.done():
                req.future.set_exception(error)
        self._requests.clear()

    async def stop(self) -> None:
        """Stop scheduling; every request still held gets an abort reply with its tokens so far."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Re-raises a failure of the loop (its clients were already failed by _on_loop_exit).
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._settle_plan_for_abort(self.now())
        for req in list(self._requests.values()):
            self._finish(req, "abort")

    def now(self) -> float:
        if self._loop is None or self._origin is None:
            raise RuntimeError(f"{self.name} is not started")
        return (self._loop.time() - self._origin) * self.config.time_scale

    def _loop_time(self, emulated: float) -> float:
        return self._origin + emulated / self.config.time_scale

    def _poke(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    # ------------------------------------------------------------------ requests
    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int, sampling_seed: int,
               return_logprob: bool = True, ignore_eos: bool = False) -> asyncio.Future:
        """Queue a validated request; the future resolves to the reply dict."""
        if self._closed or self._task is None:
            raise EngineStopped(f"{self.name} is not running")
        if rid in self._requests:
            raise RequestRejected(f"rid {rid!r} is already running on {self.name}")
        need = len(input_ids) + max_new_tokens
        if need > self.config.kv_capacity_tokens - self.config.admission_reserve_tokens:
            raise RequestRejected(
                f"input ({len(input_ids)}) + max_new_tokens ({max_new_tokens}) = {need} tokens cannot "
                f"fit the KV budget of {self.config.kv_capacity_tokens} tokens "
                f"(minus {self.config.admission_reserve_tokens} reserved)")
        key = prompt_key(input_ids)
        profile = self.model.profile(key, sampling_seed)
        if ignore_eos:
            profile = SampleProfile(key, sampling_seed, None)
        now = self.now()
        req = _Request(rid, len(input_ids), key, sampling_seed, max_new_tokens, profile,
                       return_logprob, self._loop.create_future(), now)
        self._requests[rid] = req
        self._waiting.append(req)
        if self.first_arrival_t is None:
            self.first_arrival_t = now
        self._on_arrival(now)
        return req.future

    async def generate(self, rid: str, input_ids: list[int], max_new_tokens: int, sampling_seed: int,
                       return_logprob: bool = True, ignore_eos: bool = False) -> dict:
        future = self.submit(rid, input_ids, max_new_tokens, sampling_seed, return_logprob, ignore_eos)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller went away (client disconnect, timeout): free the request's slot and KV.
            req = self._requests.get(rid)
            if req is not None and req.future is future:
                self._abort_request(req, deliver=False)
            raise

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (unknown rid: no-op) or all; returns how many were aborted."""
        targets = list(self._requests.values()) if abort_all else (
            [self._requests[rid]] if rid in self._requests else [])
        aborted = 0
        for req in targets:
            # settling a finished decode plan for an earlier target can finish later ones
            if req.state == _DONE:
                continue
            self._abort_request(req, deliver=True)
            aborted += 1
        return aborted

    def update_weight_version(self, new_version: int) -> None:
        """Tokens produced from now on carry ``new_version``; running requests continue with it."""
        now = self.now()
        plan = self._plan
        if plan is not None and plan.kind == "decode":
            j = plan.steps_done(now)
            if j >= plan.k:
                self._commit(plan)
            else:
                # Steps 1..j were produced under the old version; the step in progress and every
                # later one produce under the new version. Cut the plan at the step in progress.
                self.weight_version = new_version
                for req in plan.batch:
                    self._set_version(req, req.next_pos + j)
                self._truncate(plan, j + 1)
                self._poke()
                return
        self.weight_version = new_version
        self._poke()

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

    @property
    def num_queued(self) -> int:
        """Requests held (running, prefilling or waiting): the router's load measure."""
        return len(self._requests)

    # ------------------------------------------------------------------ event handling
    def _on_arrival(self, now: float) -> None:
        plan = self._plan
        if plan is None:
            self._poke()
            return
        if plan.kind != "decode":
            return  # the prefill in progress ends first; the arrival is considered after it
        j = plan.steps_done(now)
        if j >= plan.k:
            self._poke()
            return
        # Step by step, the scheduler would look at the waiting queue after the step in progress;
        # cut the plan there if the head of the queue could be admitted at that point.
        kv_then = self._kv_used + len(plan.batch) * (j + 1)
        growth = 0.0
        if self._new_token_ratio > 0.0:
            cfg = self.config
            growth = sum(self._new_token_ratio * min(r.max_new_tokens - r.generated - (j + 1),
                                                     cfg.admission_clip_new_tokens)
                         for r in plan.batch)
        if self._head_admissible(kv_then, len(self._running), growth):
            self._truncate(plan, j + 1)
            self._poke()

    def _abort_request(self, req: _Request, deliver: bool) -> None:
        now = self.now()
        plan = self._plan
        if plan is not None and req in plan.batch:
            if plan.kind == "decode":
                j = plan.steps_done(now)
                if j >= plan.k:
                    self._commit(plan)  # the plan ended before the abort; settle it first
                    if req.state == _DONE:
                        return
                    self._remove_admitted(req)  # still running after the commit: leave the batch
                else:
                    plan.batch.remove(req)
                    self._remove_admitted(req)
                    req.generated += j
                    self.decoded_tokens += j
                    self._truncate(plan, j + 1)
            else:
                plan.batch.remove(req)
                self._kv_used -= req.kv_tokens
        elif req.state == _RUNNING:
            self._remove_admitted(req)
        elif req.state == _WAITING:
            self._waiting.remove(req)
        if deliver:
            self._finish(req, "abort")
        else:
            self._drop(req)
        self._poke()

    def _settle_plan_for_abort(self, now: float) -> None:
        """On shutdown: credit the steps of the plan in progress that completed before ``now``."""
        plan = self._plan
        if plan is None:
            return
        if plan.kind == "decode":
            j = plan.steps_done(now)
            if j >= plan.k:
                self._commit(plan)
                return
            for req in plan.batch:
                req.generated += j
                self.decoded_tokens += j
        self._plan = None

    # ------------------------------------------------------------------ the scheduling loop
    async def _run(self) -> None:
        while True:
            plan = self._plan
            if plan is None:
                plan = self._next_plan()
                if plan is None:
                    await self._sleep_until(None)  # idle until an arrival
                    # The idle gap is not work: the next step starts now. While busy, steps
                    # follow each other back to back on the emulated clock, whatever the lag
                    # of the real loop behind it.
                    self._t = max(self._t, self.now())
                    continue
            while self._plan is plan:
                end = plan.end
                fired = await self._sleep_until(end)
                if self._plan is not plan:
                    break
                if fired and plan.end == end:
                    self._commit(plan)
                elif plan.end <= self.now():
                    self._commit(plan)

    async def _sleep_until(self, emulated: float | None) -> bool:
        """Sleep until the emulated time (True) or a poke (False)."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        handle = None
        if emulated is not None:
            handle = self._loop.call_at(self._loop_time(emulated), _set_if_pending, waiter, True)
        try:
            return await waiter
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

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
            self._plan = _Plan("prefill", batch, start,
                               np.array([start + self.config.time.prefill_step(tokens, pairs)]), tokens)
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

    def _commit(self, plan: _Plan) -> None:
        """The plan's steps have all elapsed: apply them."""
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
                    self._finish(req, "stop")
                elif req.generated >= req.max_new_tokens:
                    self._remove_admitted(req)
                    self._finish(req, "length")
        self._record_timeline(plan.end)

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

    # ------------------------------------------------------------------ replies
    def _drop(self, req: _Request) -> None:
        req.state = _DONE
        del self._requests[req.rid]
        if not req.future.done():
            req.future.cancel()

    def _finish(self, req: _Request, reason: str) -> None:
        req.state = _DONE
        del self._requests[req.rid]
        now = max(self._t, self.now()) if reason == "abort" else self._t
        self.last_reply_t = now if self.last_reply_t is None else max(self.last_reply_t, now)
        self.delivered_tokens += req.generated
        if reason == "abort":
            self.aborted_requests += 1
        else:
            self.finished_requests += 1
        if not req.future.done():
            reply = self._reply(req, reason, now)
            delay = self.config.abort_latency_s if reason == "abort" and not self._closed else 0.0
            if delay > 0.0:
                self._loop.call_at(self._loop_time(now + delay), _set_if_pending, req.future, reply)
            else:
                req.future.set_result(reply)

    def _reply(self, req: _Request, reason: str, now: float) -> dict:
        n = req.generated
        positions = np.arange(req.input_len, req.input_len + n)
        if n:
            idx = np.searchsorted(np.asarray(req.version_starts), positions, side="right") - 1
            versions = np.asarray(req.version_values, dtype=np.int64)[idx]
        else:
            versions = np.zeros(0, dtype=np.int64)
        ids, lps = self.model.tokens(req.key, req.sampling_seed, positions, versions)
        if reason == "stop":
            ids[-1] = self.model.eos_token_id
            finish = {"type": "stop", "matched": self.model.eos_token_id}
        elif reason == "length":
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "abort", "message": "Abort request."}
        ids_list = ids.tolist()
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": req.input_len,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": str(self.weight_version),
            "e2e_latency": now - req.arrival_t,
            # Not part of SGLang's reply: per-token versions as [first output index, version] runs,
            # so tests can check a reply against the reference stream exactly.
            "emulator_version_runs": _runs_from_versions(versions),
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = list(map(list, zip(lps.tolist(), ids_list, repeat(None))))
        return {"text": "", "output_ids": ids_list, "meta_info": meta}

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        now = self.now()
        return {
            "name": self.name,
            "emulated_time": now,
            "busy_s": self.busy_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "idle_s": max(0.0, now - self.busy_s),
            "decode_steps": self.decode_steps,
            "decoded_tokens": self.decoded_tokens,
            "generated_tokens": self.delivered_tokens,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "retractions": self.retractions,
            "finished_requests": self.finished_requests,
            "aborted_requests": self.aborted_requests,
            "first_arrival_t": self.first_arrival_t,
            "last_reply_t": self.last_reply_t,
            "weight_version": self.weight_version,
            "load": self.load(),
            "config": self.config.to_dict(),
            "timeline": {"t": list(self._timeline_t), "num_running": list(self._timeline_running),
                         "kv_used": list(self._timeline_kv)},
        }


def _set_if_pending(fut: asyncio.Future, value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _runs_from_versions(versions: np.ndarray) -> list[list[int]]:
    if versions.size == 0:
        return []
    change = np.flatnonzero(np.diff(versions)) + 1
    starts = np.concatenate(([0], change))
    return [[int(s), int(versions[s])] for s in starts]
