"""One emulated engine: its ``ContinuousBatch`` driven on the event loop, with requests in and replies out.

The engine owns the client side: requests in (``submit``, ``generate``, and the refusals the server
answers with HTTP 400 or 503), aborts, weight-version bumps and the replies; the scheduling task
that sleeps until each planned step ends is its base's (``clocked.ClockedBatch``). Arrivals, aborts
and weight-version bumps inside a macro step cut it at the step in progress, so what a client sees
is what step-by-step execution would give: an abort returns exactly the tokens of the steps
completed before it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .clocked import ClockedBatch, EngineStopped, set_if_pending
from .config import EngineConfig
from .model import SampleProfile, SyntheticLM, prompt_key
from .request import _DONE, _RUNNING, _WAITING, _Request


class AdmissionRefused(ValueError):
    """The emulated engine refuses to admit a generate request (its rid is already running, or it
    can never fit the KV budget); the server answers HTTP 400. Server-side, so not the client's
    ``april_slime.core.engine.RequestRejected``, which is what such an answer becomes there."""


class EmulatedEngine(ClockedBatch):
    """One engine: the batch it inherits, stepped on the loop's clock, plus the requests, aborts
    and replies of its clients. All calls run on the event loop's thread."""

    def __init__(self, model: SyntheticLM, config: EngineConfig | None = None, name: str = "engine"):
        super().__init__(model, config, name)
        self._requests: dict[str, _Request] = {}
        # Reply counters for the benchmark; cumulative (the step counters are the batch's).
        self.delivered_tokens = 0  # tokens returned to clients (finished or aborted replies)
        self.finished_requests = 0
        self.aborted_requests = 0
        self.first_arrival_t: float | None = None
        self.last_reply_t: float | None = None

    async def stop(self) -> None:
        """Stop scheduling; every request still held gets an abort reply with its tokens so far."""
        await self._stop_loop()
        for req in list(self._requests.values()):
            self._finish(req, "abort")

    def _loop_failed(self, error: EngineStopped) -> None:
        for req in list(self._requests.values()):
            req.state = _DONE
            if not req.future.done():
                req.future.set_exception(error)
        self._requests.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, rid: str, input_ids: list[int], max_new_tokens: int, sampling_seed: int,
               return_logprob: bool = True, ignore_eos: bool = False) -> asyncio.Future:
        """Queue a validated request; the future resolves to the reply dict."""
        if self._closed or self._task is None:
            raise EngineStopped(f"{self.name} is not running")
        if rid in self._requests:
            raise AdmissionRefused(f"rid {rid!r} is already running on {self.name}")
        need = len(input_ids) + max_new_tokens
        if need > self.config.kv_capacity_tokens - self.config.admission_reserve_tokens:
            raise AdmissionRefused(
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
            # Not shielded: a caller's cancellation cancels the future too, which the engine reads
            # as "nobody waits for this reply" (every reply checks ``future.done()`` first).
            return await future
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
        if self._head_admissible_after(plan, j):
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
            reply = req.reply(self.model, reason, now, self.weight_version)
            delay = self.config.abort_latency_s if reason == "abort" and not self._closed else 0.0
            if delay > 0.0:
                self._loop.call_at(self._loop_time(now + delay), set_if_pending, req.future, reply)
            else:
                req.future.set_result(reply)

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

