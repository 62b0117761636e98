"""``april-slime calibrate``: measure a live SGLang engine and write an engine spec the bench loads.

What it measures, on one engine (a router's first worker, from ``GET /workers``):

* decode step time over a batch x context grid that reaches the regime the bench runs in: by
  default batches 1 to 256 (within the engine's running-request limit) and, per batch, contexts of
  64 and 1,024 tokens and one that fills 80% of the KV pool (``plan_grid``). A point is a batch of
  ``B`` requests of ``C`` prompt tokens generating ``M`` tokens (``ignore_eos``) against the same
  batch generating ``M / 3``; the difference is ``2 M / 3`` decode steps of the whole batch holding
  ``B (C + m)`` KV tokens (the staggered admission at the start cancels out). A least-squares fit
  gives ``decode_t0 + decode_per_request B + decode_per_kv_token K``; the spec records the fit's
  worst relative error on the grid and its extrapolation error (the point of most KV left out of a
  second fit and predicted by it), and the largest batch and KV the grid reached, so a bench run
  beyond them reads as the extrapolation it is;
* prefill time over prompt lengths (one request, one token) and over batches of short requests
  (``prefill_batches`` requests of ``PREFILL_BATCH_TOKENS`` tokens, one token each):
  ``prefill_t0 + prefill_per_request r + prefill_per_token n + prefill_per_token_pair n (n + 1) / 2``
  for ``r`` requests of ``n`` tokens in all. ``prefill_per_request`` is what a request costs the
  engine beyond its tokens, its way in and out included (HTTP, tokenizer manager, detokenizer):
  on a GPU little, on engines sharing a machine's cores (the local CPU stack) a real share of a
  step. SGLang's prefill samples a request's first token; the emulator's first decode step does, so
  each prefill point is fitted less one decode step of its batch (what the emulator adds back);
* the transit: each generate's wall time less the engine's own ``e2e_latency`` (SGLang reports it),
  the median over the decode grid's calls (HTTP and the engine's front end while batches run), which
  the emulated transport adds to every generate and abort; each prefill point is fitted less its
  own calls' transit, the abort latency less the grid's;
* KV capacity and the running-request limit from ``/v1/loads`` and ``/server_info``, and the GPUs
  per engine (tensor x pipeline x data parallel size from ``/server_info``, or ``--gpus-per-engine``):
  the training phase of a spec runs on every GPU of the job;
* abort latency: a long request aborted by rid once the engine reports it running, time until its
  reply is back.

A decode point is the median over ``--repeats`` tries of a long and a short batch timed back to
back (a shared machine's slow spell lands on both halves of a try); a point whose decode steps
come out free (noise larger than the steps) is measured again with more tokens. A prefill point is
the fastest of its tries (the least disturbed). Token ids are small (< 100), so any vocabulary takes them: an id
past the vocabulary kills an SGLang engine. The spec JSON keeps the raw grid under ``measurements``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from april_slime.core.transport import HttpTransport, Transport, TransportHTTPError

from .spec import ENGINE_PRESETS


class CalibrationError(RuntimeError):
    """The engine could not be measured (unreachable, malformed replies, failed requests)."""


class _Engine:
    """One engine spoken to through a ``Transport`` (HTTP unless given one; the tests pass the
    emulator's in-process transport and run on its virtual clock). Times are the event loop's clock,
    which is the machine's monotonic clock on a real loop."""

    def __init__(self, url: str, timeout_s: float, transport: Transport | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._own_transport = transport is None
        self.transport: Transport = HttpTransport() if transport is None else transport
        # each generate's wall time less the engine's own e2e_latency, where the engine reports one
        self.transits: list[float] = []

    async def close(self) -> None:
        if self._own_transport:
            await self.transport.close()

    async def _request(self, method: str, path: str, body: dict | None) -> Any:
        try:
            return await self.transport.request(method, self.url, path, body, self.timeout_s)
        except TransportHTTPError as exc:
            raise CalibrationError(f"{method} {self.url}{path}: HTTP {exc.status}: {str(exc.body)[:200]}") from exc
        except (TimeoutError, OSError) as exc:
            raise CalibrationError(f"{method} {self.url}{path}: {exc!r}") from exc

    async def get(self, path: str) -> Any:
        return await self._request("GET", path, None)

    async def post(self, path: str, body: dict) -> Any:
        return await self._request("POST", path, body)

    async def generate(self, prompt_len: int, max_new_tokens: int, rid: str | None = None) -> dict:
        ids = [3 + (i * 7) % 97 for i in range(prompt_len)]
        body = {"input_ids": ids, "rid": rid or uuid.uuid4().hex,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                    "temperature": 1.0}}
        loop = asyncio.get_running_loop()
        sent = loop.time()
        reply = await self.post("/generate", body)
        if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
            raise CalibrationError(f"/generate on {self.url}: malformed reply {str(reply)[:200]}")
        engine_s = reply["meta_info"].get("e2e_latency")
        if isinstance(engine_s, (int, float)) and not isinstance(engine_s, bool):
            self.transits.append(max(0.0, loop.time() - sent - float(engine_s)))
        return reply

    async def batch_time(self, batch: int, prompt_len: int, max_new_tokens: int) -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        replies = await asyncio.gather(*(self.generate(prompt_len, max_new_tokens)
                                         for _ in range(batch)))
        elapsed = loop.time() - t0
        for r in replies:
            done = r["meta_info"].get("completion_tokens")
            if done != max_new_tokens:
                raise CalibrationError(f"/generate on {self.url}: asked for {max_new_tokens} tokens "
                                       f"with ignore_eos, got {done} ({r['meta_info'].get('finish_reason')})")
        return elapsed


    async def running(self) -> int:
        loads = await self.get("/v1/loads")
        entries = loads.get("loads") if isinstance(loads, dict) else None
        if not entries:
            raise CalibrationError(f"{self.url}/v1/loads: no loads in {str(loads)[:200]}")
        return int(sum(e.get("num_running_reqs", 0) for e in entries))


MAX_TOKEN_GROWTH = 8  # a point whose steps come out free is measured again with up to 8 x the tokens
PREFILL_BATCH_TOKENS = 32  # the prompt of each request of a prefill batch point


def plan_grid(batches: Sequence[int] | None, contexts: Sequence[int] | None, *, capacity: int,
              max_running: int | None, context_len: int | None, decode_tokens: int,
              fill: float = 0.8) -> list[tuple[int, int]]:
    """The (batch, prompt tokens) points to measure. ``None`` picks the default, which reaches the
    bench's regime: batches 1, 4, 16, 64, 256 within the running-request limit (and the limit
    itself when it is lower), contexts 64 and 1,024 and, per batch, the context that fills ``fill``
    of the KV pool. Room is kept for a point measured again with ``MAX_TOKEN_GROWTH`` x the
    tokens (within the context, SGLang ends a request 2 tokens short of it; within the pool); a
    point whose batch would not fit in the pool is left out."""
    limit = max_running or 256
    if batches is None:
        batches = sorted({b for b in (1, 4, 16, 64, 256) if b <= limit} | ({limit} if limit < 256 else set()))
    most = MAX_TOKEN_GROWTH * decode_tokens
    longest = (context_len or 1 << 30) - most - 16
    points: list[tuple[int, int]] = []
    for batch in batches:
        fill_context = int(fill * capacity / batch) - most
        wanted = list(contexts) if contexts is not None else [64, 1024, fill_context]
        for context in sorted(set(wanted)):
            context = min(context, longest)
            if context >= 1 and batch * (context + most) <= 0.9 * capacity and (batch, context) not in points:
                points.append((batch, context))
    return points


def fit_report(rows: Sequence[Sequence[float]], y: Sequence[float]) -> dict[str, float]:
    """How well the linear step law holds: its worst relative error on the grid, and the error at
    the point of most KV when that point is left out of the fit (what extrapolating costs)."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    coef = _fit(a, b)
    predicted = a @ coef
    report = {"max_relative_error": float(np.max(np.abs(predicted - b) / np.maximum(b, 1e-12)))}
    top = int(np.argmax(a[:, 2]))
    rest = [i for i in range(len(b)) if i != top]
    if len(rest) >= 3:
        partial = _fit(a[rest], b[rest])
        report.update(extrapolated_point=float(a[top, 2]), extrapolation_relative_error=float(
            abs(a[top] @ partial - b[top]) / max(b[top], 1e-12)))
    return report


async def _engine_url(url: str, timeout_s: float, transport: Transport | None = None) -> tuple[str, int]:
    """The engine to measure and how many engines there are: a router's first worker, or ``url``."""
    urls = await _engine_urls(url, timeout_s, transport)
    return urls[0], len(urls)


async def _engine_urls(url: str, timeout_s: float, transport: Transport | None = None) -> list[str]:
    """A router's workers, or ``url`` itself."""
    probe = _Engine(url, timeout_s, transport)
    try:
        try:
            workers = await probe.get("/workers")
        except CalibrationError:
            return [url.rstrip("/")]
        # sglang-router 0.3: {"workers": [{"url": ...}]}; older routers: {"urls": [...]}
        listed = workers.get("workers") or workers.get("urls") if isinstance(workers, dict) else None
        if isinstance(listed, list) and listed:
            return [(w["url"] if isinstance(w, dict) else str(w)).rstrip("/") for w in listed]
        return [url.rstrip("/")]
    finally:
        await probe.close()


async def _optional(engine: _Engine, *paths: str) -> Any:
    """The first of ``paths`` the engine answers (server info and model info are optional:
    older SGLang and the emulator lack some of them)."""
    for path in paths:
        try:
            return await engine.get(path)
        except (CalibrationError, ValueError):
            continue
    return None


def _context_length(*replies: Any) -> int | None:
    """The engine's context length, from whichever info reply states it."""
    for reply in replies:
        if isinstance(reply, dict):
            for key in ("context_length", "max_context_length", "max_model_len"):
                value = reply.get(key)
                if isinstance(value, int) and value > 0:
                    return value
    return None


def _fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drops a column that comes out negative)."""
    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    active = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            out = np.zeros(a.shape[1])
            out[active] = np.maximum(coef, 0.0)
            return out
        active.pop(int(np.argmin(coef)))


def _gpus_per_engine(info: Any) -> int | None:
    """Tensor x pipeline x data parallel size, from ``/server_info`` (SGLang flattens its server
    arguments into it); None when the engine does not say."""
    if not isinstance(info, dict) or not isinstance(info.get("tp_size"), int):
        return None
    size = 1
    for key in ("tp_size", "pp_size", "dp_size"):
        value = info.get(key)
        if isinstance(value, int) and value >= 1:
            size *= value
    return size


async def measure(url: str, *, batches: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                  decode_tokens: int = 16, prefill_lengths: Sequence[int] = (64, 512, 2048),
                  prefill_batches: Sequence[int] = (8, 32), repeats: int = 2, timeout_s: float = 120.0,
                  transport: Transport | None = None, concurrent: bool = False) -> dict[str, Any]:
    """Measure the engine behind ``url`` (a router or an engine); ``transport``: how to reach it
    (default HTTP). ``concurrent``: every engine behind the router runs each grid point at the same
    time and the times are their mean: an engine as it runs while the others are busy too, which
    differs from one engine alone where engines share a machine's cores (the local CPU stack)."""
    urls = await _engine_urls(url, timeout_s, transport)
    engine_url, num_engines = urls[0], len(urls)
    engine = _Engine(engine_url, timeout_s, transport)
    others = [_Engine(u, timeout_s, transport) for u in urls[1:]] if concurrent else []

    async def timed(batch: int, prompt_len: int, new: int) -> float:
        if not others:
            return await engine.batch_time(batch, prompt_len, new)
        times = await asyncio.gather(*(e.batch_time(batch, prompt_len, new) for e in (engine, *others)))
        return float(np.mean(times))

    try:
        loads = await engine.get("/v1/loads")
        info = await _optional(engine, "/server_info", "/get_server_info")
        model = await _optional(engine, "/model_info")
        per_engine = loads.get("loads") if isinstance(loads, dict) else None
        if not per_engine or "max_total_num_tokens" not in per_engine[0]:
            raise CalibrationError(f"{engine_url}/v1/loads has no max_total_num_tokens: {str(loads)[:200]}")
        capacity = int(per_engine[0]["max_total_num_tokens"])
        max_running = info.get("max_running_requests") if isinstance(info, dict) else None
        max_running = max_running or per_engine[0].get("max_running_requests")
        models = await _optional(engine, "/v1/models")  # OpenAI-style: data[0].max_model_len
        cards = models.get("data") if isinstance(models, dict) else None
        context_len = _context_length(info, model, *(cards if isinstance(cards, list) else []))
        points = plan_grid(batches, contexts, capacity=capacity, max_running=max_running,
                           context_len=context_len, decode_tokens=decode_tokens)
        if len(points) < 3 or len({b for b, _ in points}) < 2:
            raise CalibrationError(f"the grid leaves {len(points)} (batch, context) points within the KV pool of "
                                   f"{capacity} tokens on {engine_url}: lower --batches / --contexts")
        longest = max(prefill_lengths) + 1
        if context_len is not None and longest > context_len:
            raise CalibrationError(f"the prefill grid needs {longest} tokens per request but {engine_url} "
                                   f"serves a context of {context_len}: lower --prefill-lengths")
        await engine.generate(16, 2)  # warm-up: first requests pay one-off costs

        async def fastest(batch: int, prompt_len: int, new: int) -> float:
            return min([await timed(batch, prompt_len, new) for _ in range(repeats)])

        decode_rows, decode_y, grid = [], [], []
        for batch, context in points:
            # Two lengths, both long enough for the whole batch to be running: the requests
            # arrive and are prefilled one after another, and that staggered start cancels out.
            # Noise larger than the steps (a loaded machine) shows as free steps: measure again
            # with more tokens, up to MAX_TOKEN_GROWTH x.
            # Each try times the long batch and the short one back to back, and the step is the
            # median of the tries' differences: a slow spell of a shared machine lands on both
            # halves of a try rather than on one half of the comparison.
            tokens = decode_tokens
            while True:
                short = max(2, tokens // 3)
                pairs = []
                for _ in range(repeats):
                    pairs.append((await timed(batch, context, tokens), await timed(batch, context, short)))
                difference = float(np.median([a - b for a, b in pairs]))
                if difference > 0 or tokens >= MAX_TOKEN_GROWTH * decode_tokens:
                    break
                tokens *= 2
            if difference <= 0:
                raise CalibrationError(f"decode steps at batch {batch} x {context} tokens measured as free "
                                       f"(noise larger than {tokens} steps): raise --decode-tokens or --repeats")
            full, first = min(a for a, _ in pairs), min(b for _, b in pairs)
            step = difference / (tokens - short)
            kv = batch * (context + (tokens + short) / 2.0)
            decode_rows.append([1.0, batch, kv])
            decode_y.append(step)
            grid.append({"batch": batch, "context": context, "decode_tokens": tokens,
                         "short_tokens": short, "time_full_s": full, "time_short_s": first,
                         "decode_step_s": step, "kv_tokens": kv})
        t0, per_request, per_kv = _fit(decode_rows, decode_y)
        # the round trip outside the engine, as it is while batches run (the decode grid's calls)
        grid_transits = [x for e in (engine, *others) for x in e.transits]
        transit = float(np.median(grid_transits)) if grid_transits else 0.0
        prefill_rows, prefill_y, prefill_grid = [], [], []
        shapes = [(1, n) for n in prefill_lengths] + [(r, PREFILL_BATCH_TOKENS) for r in prefill_batches if r > 1]
        for requests, n in shapes:
            seen = len(engine.transits)
            t = await fastest(requests, n, 1)
            # the engine's part of it: less the point's own round trips (the emulated transport adds
            # the transit back) and, since SGLang's prefill samples the first token and the
            # emulator's first decode step does, less one decode step of the batch
            point_transit = float(np.median(engine.transits[seen:])) if engine.transits[seen:] else 0.0
            step = t0 + per_request * requests + per_kv * requests * (n + 1)
            prefill_rows.append([1.0, requests, requests * n, requests * n * (n + 1) / 2.0])
            prefill_y.append(t - step - point_transit)
            prefill_grid.append({"requests": requests, "tokens": n, "time_s": t, "decode_step_s": step,
                                 "transit_s": point_transit})
        p0, p_req, p_tok, p_pair = _fit(prefill_rows, prefill_y)

        # abort latency: a long request, aborted by rid once the engine reports it running
        rid = "calibrate-abort-" + uuid.uuid4().hex
        # long enough to still be decoding when the abort lands, within the context and the pool
        budget = min(capacity // 2, (context_len or 4096) - 32, 100_000)
        task = asyncio.ensure_future(engine.generate(16, budget, rid))
        while await engine.running() < 1 and not task.done():
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await engine.post("/abort_request", {"rid": rid})
        reply = await asyncio.wait_for(task, timeout_s)
        abort_latency = loop.time() - sent
        finish = reply["meta_info"].get("finish_reason") or {}
        if finish.get("type") != "abort":
            raise CalibrationError(f"abort of {rid} on {engine_url} did not abort it: {finish}")
    finally:
        for e in (engine, *others):
            await e.close()
    if t0 <= 0 and per_request <= 0:
        raise CalibrationError("decode steps measured as free: the grid is too small for this engine")
    return {
        "engine_url": engine_url, "num_engines": num_engines, "gpus_per_engine": _gpus_per_engine(info),
        "concurrent": bool(others),
        "model_path": model.get("model_path") if isinstance(model, dict) else None,
        "kv_capacity_tokens": capacity, "max_running_requests": max_running,
        "decode_t0": float(t0), "decode_per_request": float(per_request),
        "decode_per_kv_token": float(per_kv), "prefill_t0": float(p0), "prefill_per_request": float(p_req),
        "prefill_per_token": float(p_tok), "prefill_per_token_pair": float(p_pair),
        "abort_latency_s": abort_latency, "transit_s": transit, "decode_grid": grid, "prefill_grid": prefill_grid,
        "decode_fit": fit_report(decode_rows, decode_y),
        "largest_batch": max(b for b, _ in points), "largest_kv_tokens": max(r[2] for r in decode_rows),
    }


def engine_spec(m: dict[str, Any], base_preset: str, name: str | None = None,
                gpus_per_engine: int | None = None) -> dict[str, Any]:
    """The spec JSON (``EngineSpec.from_dict``) for measurement ``m``. GPUs per engine: the
    argument, else what the engine reported, else the base preset's (a 4 x TP2 node is 8 GPUs,
    and the training phase runs on all of them)."""
    gpus = gpus_per_engine or m.get("gpus_per_engine") or ENGINE_PRESETS[base_preset].gpus_per_engine
    spec: dict[str, Any] = {
        "base_preset": base_preset,
        "name": name or f"calibrated:{m['engine_url']}",
        "model": str(m["model_path"] or ENGINE_PRESETS[base_preset].model),
        "num_engines": int(m["num_engines"]), "gpus_per_engine": int(gpus),
        "decode_t0": m["decode_t0"], "decode_per_request": m["decode_per_request"],
        "decode_per_kv_token": m["decode_per_kv_token"], "prefill_t0": m["prefill_t0"],
        "prefill_per_token": m["prefill_per_token"],
        "prefill_per_token_pair": m["prefill_per_token_pair"],
        "prefill_per_request": m.get("prefill_per_request", 0.0),
        "kv_capacity_tokens": int(m["kv_capacity_tokens"]),
        # the abort's reply crosses the transit the emulated transport adds on its own
        "abort_latency_s": max(0.0, m["abort_latency_s"] - m.get("transit_s", 0.0)),
        "transit_s": m.get("transit_s", 0.0),
        # measured steps already are what the engine does at each batch, graphs or not
        "cuda_graph_max_bs": 0, "enforce_eager": False,
        "source": f"april-slime calibrate {m['engine_url']} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        "measurements": m,
    }
    if m.get("max_running_requests"):
        spec["max_running_requests"] = int(m["max_running_requests"])
    return spec


def emulated_batch_time(spec: Any, batch: int, prompt_len: int, max_new_tokens: int) -> float:
    """Seconds the emulator, running ``spec``, takes for a batch like ``_Engine.batch_time``'s."""
    from april_workbench.emulator import EmulatedEngine, SyntheticLM, run_virtual

    async def run() -> float:
        engine = EmulatedEngine(SyntheticLM(), spec.engine_config())
        engine.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ids = [3 + (i * 7) % 97 for i in range(prompt_len)]
        await asyncio.gather(*(engine.generate(f"r{i}", ids, max_new_tokens, i, ignore_eos=True)
                               for i in range(batch)))
        elapsed = loop.time() - t0
        await engine.stop()
        return elapsed

    return run_virtual(run())


async def _real_batch_times(url: str, shapes: Sequence[tuple[int, int, int]], repeats: int,
                            timeout_s: float) -> list[float]:
    engine_url, _ = await _engine_url(url, timeout_s)
    engine = _Engine(engine_url, timeout_s)
    try:
        return [min([await engine.batch_time(b, p, n) for _ in range(repeats)]) for b, p, n in shapes]
    finally:
        await engine.close()


def compare(url: str, spec: Any, shapes: Sequence[tuple[int, int, int]], repeats: int = 3,
            timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Real vs emulated time of batches (batch, prompt, new tokens) outside the calibration grid
    (call it outside an event loop: the emulated side runs on its own virtual clock)."""
    real = asyncio.run(_real_batch_times(url, shapes, repeats, timeout_s))
    out = []
    for (batch, prompt_len, new), real_s in zip(shapes, real):
        emulated = emulated_batch_time(spec, batch, prompt_len, new)
        out.append({"batch": batch, "prompt_len": prompt_len, "new_tokens": new,
                    "real_s": real_s, "emulated_s": emulated, "ratio": emulated / real_s})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="april-slime calibrate",
        description="Measure a live SGLang engine (or a router's first worker): decode step time "
                    "over a batch x context grid, prefill time, KV capacity, abort latency; write "
                    "an engine spec for `april-slime bench --engine-spec`.")
    p.add_argument("--url", required=True, help="engine or sglang-router URL")
    p.add_argument("--out", default=None, metavar="PATH", help="write the spec JSON here (default: stdout)")
    p.add_argument("--base-preset", default="h100-qwen3-4b", choices=sorted(ENGINE_PRESETS),
                   help="preset the fields not measured (model shape, training phase) come from")
    p.add_argument("--name", default=None, help="spec name (default: calibrated:<engine url>)")
    p.add_argument("--batches", default="auto",
                   help="decode grid batch sizes (auto: 1, 4, 16, 64, 256 within the engine's running limit)")
    p.add_argument("--contexts", default="auto",
                   help="decode grid prompt lengths (auto: 64, 1024 and, per batch, one that fills 80%% of "
                        "the KV pool)")
    p.add_argument("--gpus-per-engine", type=int, default=None,
                   help="GPUs each engine runs on (default: tp x pp x dp from /server_info, else the base preset's)")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens decoded per grid point (>= 6)")
    p.add_argument("--prefill-lengths", default="64,512,2048", help="prefill grid prompt lengths")
    p.add_argument("--prefill-batches", default="8,32",
                   help=f"prefill grid batch sizes (requests of {PREFILL_BATCH_TOKENS} tokens at once)")
    p.add_argument("--concurrent", action="store_true",
                   help="run every grid point on every engine behind the router at once (engines that share "
                        "a machine's cores, as on the local CPU stack); default: the first engine alone")
    p.add_argument("--repeats", type=int, default=3,
                   help="tries per point (decode: the median difference is kept; prefill: the fastest)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP call")
    return p


def _ints(text: str, what: str, minimum: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"--{what} must be integers >= {minimum}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batches = None if args.batches == "auto" else _ints(args.batches, "batches", 1)
        contexts = None if args.contexts == "auto" else _ints(args.contexts, "contexts", 1)
        prefill = _ints(args.prefill_lengths, "prefill-lengths", 1)
        prefill_batches = _ints(args.prefill_batches, "prefill-batches", 1)
        if args.decode_tokens < 6 or args.repeats < 1 or not args.timeout > 0:
            raise ValueError("--decode-tokens must be >= 6, --repeats >= 1, --timeout > 0")
        if args.gpus_per_engine is not None and args.gpus_per_engine < 1:
            raise ValueError(f"--gpus-per-engine must be >= 1, got {args.gpus_per_engine}")
        if (batches is not None and len(set(batches)) < 2) or (
                batches is not None and contexts is not None and len(set(batches)) * len(set(contexts)) < 3):
            raise ValueError("the grid needs >= 2 batch sizes and >= 3 (batch, context) points")
        if len(set(prefill)) < 2:
            raise ValueError("the prefill grid needs >= 2 lengths")
        m = asyncio.run(measure(args.url, batches=batches, contexts=contexts,
                                decode_tokens=args.decode_tokens, prefill_lengths=prefill,
                                prefill_batches=prefill_batches, repeats=args.repeats, timeout_s=args.timeout,
                                concurrent=args.concurrent))
    except (ValueError, CalibrationError) as exc:
        print(f"april-slime calibrate: {exc}", file=sys.stderr)
        return 2
    spec = engine_spec(m, args.base_preset, args.name, args.gpus_per_engine)
    text = json.dumps(spec, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    print(f"april-slime calibrate: {m['engine_url']}: decode {m['decode_t0'] * 1e3:.2f} ms "
          f"+ {m['decode_per_request'] * 1e6:.1f} us/request + {m['decode_per_kv_token'] * 1e9:.2f} "
          f"ns/KV token; prefill {m['prefill_t0'] * 1e3:.1f} ms + {m['prefill_per_request'] * 1e3:.2f} ms/request "
          f"+ {m['prefill_per_token'] * 1e6:.1f} us/token; KV {m['kv_capacity_tokens']:,} tokens; "
          f"abort {m['abort_latency_s'] * 1e3:.0f} ms; transit {m['transit_s'] * 1e3:.1f} ms; "
          f"{spec['gpus_per_engine']} GPU(s) per engine", file=sys.stderr)
    fit = m["decode_fit"]
    extrapolation = (f", {fit['extrapolation_relative_error']:.1%} at {fit['extrapolated_point']:,.0f} KV tokens "
                     f"when that point is left out" if "extrapolation_relative_error" in fit else "")
    print(f"april-slime calibrate: grid up to batch {m['largest_batch']} and {m['largest_kv_tokens']:,.0f} KV "
          f"tokens; step law worst error on the grid {fit['max_relative_error']:.1%}{extrapolation}; a bench "
          f"run beyond the grid extrapolates the linear law", file=sys.stderr)
    return 0
