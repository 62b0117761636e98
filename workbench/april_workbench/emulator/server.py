"""Protocol handlers (engine and router) and the aiohttp front that serves them.

``EngineHandler.handle`` / ``RouterHandler.handle`` take ``(method, path, payload)`` and return
``(status, body)``; the HTTP server and ``LocalTransport`` are both thin wrappers around them, so the
in-process and the socket paths run exactly the same protocol code.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import orjson
from aiohttp import web

from april_slime.core.sglang_protocol import LogprobArrays, check_token_ids

from .batching import AdmissionRefused, EmulatedEngine
from .clocked import EngineStopped
from .replay import EmulatedReplay

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omits it
SGLANG_VERSION = "0.5.23"  # the protocol version spoken (tests/data/sglang-0.5.23-golden.json)

# SGLang 0.5.23's accepted sampling_params; anything else is refused as SGLang refuses it.
SAMPLING_PARAMS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)


class BadRequest(ValueError):
    """The payload breaks the protocol (HTTP 400). ``body`` is the reply, in SGLang's words:
    ``{"error": {"message": ...}}`` for a semantic error, ``{"error": "..."}`` for a schema error."""

    def __init__(self, message: str, *, schema: bool = False):
        super().__init__(message)
        self.body = {"error": message} if schema else {"error": {"message": message}}


class Handler(Protocol):
    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict | None]: ...


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message}}


def _not_found() -> tuple[int, dict]:
    return 404, {"detail": "Not Found"}  # FastAPI's reply for a path SGLang does not serve


def _require_dict(payload: Any, what: str) -> dict:
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise BadRequest(f"{what} body must be a JSON object")
    return payload


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_version(value: Any) -> int:
    if _is_int(value):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise BadRequest(f"new_version must be an integer (or its string), got {value!r}")


class EngineHandler:
    """The native SGLang endpoints of one emulated engine, replying as SGLang 0.5.23 does
    (tests/test_emulator.py checks the replies against ones recorded from the real engine)."""

    def __init__(self, engine: EmulatedEngine, replay: EmulatedReplay | None = None):
        self.engine = engine
        self.replay = replay  # routed experts / top-p kept ids, when the engine emulates them

    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict | None]:
        route = _ENGINE_ROUTES.get(path.rstrip("/") or "/")
        if route is None:
            return _not_found()
        allowed, fn = route
        if method.upper() != allowed:
            return 405, {"detail": "Method Not Allowed"}
        try:
            return 200, await fn(self, payload)
        except BadRequest as exc:
            return 400, exc.body
        except AdmissionRefused as exc:
            return _error(400, str(exc))
        except EngineStopped as exc:
            return _error(503, str(exc))

    # ---------------------------------------------------------------------------- endpoints
    async def _generate(self, payload: Any) -> dict:
        request = parse_generate(payload, self.engine.model.vocab_size)
        if request["rid"] in self.engine._requests:
            raise BadRequest(f"Duplicate request ID detected: {request['rid']}")
        if request["max_new_tokens"] == 0:
            # SGLang answers at once with an empty output; the emulated engine needs >= 1 token
            reply = {"text": "", "output_ids": [], "meta_info": {
                "id": request["rid"], "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(request["input_ids"]), "completion_tokens": 0, "cached_tokens": 0,
                "weight_version": str(self.engine.weight_version), "e2e_latency": 0.0,
                "emulator_version_runs": []}}
            if request["return_logprob"]:
                reply["meta_info"]["output_token_logprobs"] = []
        else:
            reply = await self.engine.generate(**request)
        out = sglang_generate_reply(reply, request["return_logprob"], self.engine.weight_version)
        if self.replay is not None:
            self.replay.annotate(out["meta_info"], payload, out["output_ids"], self.engine.model.vocab_size)
        return out

    async def _abort(self, payload: Any) -> None:
        body = _require_dict(payload, "abort_request")
        abort_all = body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise BadRequest("abort_all must be a boolean", schema=True)
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid: Input should be a valid string", schema=True)
        if abort_all or rid is not None:  # SGLang takes an empty body as a no-op
            self.engine.abort(rid=rid, abort_all=abort_all)
        return None  # SGLang answers 200 with an empty body

    async def _loads(self, payload: Any) -> dict:
        load = self.engine.load()
        now = time.time()
        capacity = load["max_total_num_tokens"]
        entry = {
            "timestamp": now, "dp_rank": 0,
            "num_running_reqs": load["num_running_reqs"], "num_waiting_reqs": load["num_waiting_reqs"],
            "num_used_tokens": load["num_used_tokens"], "max_total_num_tokens": capacity,
            "max_running_requests": self.engine.config.max_running_requests,
            "token_usage": load["num_used_tokens"] / capacity if capacity else 0.0,
            # Not in SGLang's /v1/loads: the emulator's cumulative retractions, for the adaptive
            # concurrency controller (on SGLang 0.5.23 the engine client reads 0 here).
            "num_retractions": load["num_retractions"],
        }
        return {"timestamp": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
                "version": SGLANG_VERSION, "accelerator": None, "num_accelerators": 1, "loads": [entry]}

    async def _model_info(self, payload: Any) -> dict:
        return {"model_path": "emulator", "tokenizer_path": "emulator", "is_generation": True,
                "weight_version": str(self.engine.weight_version), "model_type": "emulator"}

    async def _update_weights_from_disk(self, payload: Any) -> dict:
        body = _require_dict(payload, "update_weights_from_disk")
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path: Field required", schema=True)
        version = body.get("weight_version")
        new_version = self.engine.weight_version if version is None else _parse_version(version)
        if body.get("abort_all_requests", False) is True:
            self.engine.abort(abort_all=True)
        # SGLang takes the weights once every request in flight has finished
        while self.engine._requests:
            await asyncio.sleep(0.005)
        self.engine.update_weight_version(new_version)
        return {"success": True, "num_paused_requests": 0,
                "message": f"Succeeded to update model weights. Weight version updated to {new_version}."}

    async def _update_weight_version(self, payload: Any) -> dict:
        body = _require_dict(payload, "update_weight_version")
        new_version = (_parse_version(body["new_version"]) if body.get("new_version") is not None
                       else self.engine.weight_version + 1)
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise BadRequest("abort_all_requests must be a boolean")
        if abort_all:
            self.engine.abort(abort_all=True)
        self.engine.update_weight_version(new_version)
        return {"success": True, "message": f"Weight version updated to {new_version}",
                "new_version": str(new_version)}

    async def _stats(self, payload: Any) -> dict:
        return self.engine.stats()

    async def _health(self, payload: Any) -> None:
        return None  # SGLang: 200, empty body


_ENGINE_ROUTES: dict[str, tuple[str, Callable[[EngineHandler, Any], Awaitable[dict | None]]]] = {
    "/generate": ("POST", EngineHandler._generate),
    "/abort_request": ("POST", EngineHandler._abort),
    "/v1/loads": ("GET", EngineHandler._loads),
    "/model_info": ("GET", EngineHandler._model_info),
    "/update_weights_from_disk": ("POST", EngineHandler._update_weights_from_disk),
    "/update_weight_version": ("POST", EngineHandler._update_weight_version),
    "/emulator/stats": ("GET", EngineHandler._stats),
    "/health": ("GET", EngineHandler._health),
}


def sglang_generate_reply(reply: dict, return_logprob: bool, current_version: int) -> dict:
    """The emulated engine's reply in SGLang 0.5.23's shape: ``meta_info.weight_versions`` spans,
    the bookkeeping fields SGLang sends, and for a request aborted while still queued (no token)
    SGLang's short form without ``prompt_tokens``. ``emulator_version_runs`` (not SGLang's) stays:
    tests read it."""
    meta = dict(reply["meta_info"])
    n = len(reply["output_ids"])
    runs = meta.get("emulator_version_runs") or []
    if runs:
        spans = [{"version": str(v), "start": start, "end": runs[i + 1][0] if i + 1 < len(runs) else n}
                 for i, (start, v) in enumerate(runs)]
    else:
        spans = [{"version": str(current_version), "start": 0, "end": 0}]
    finish = meta["finish_reason"]
    out: dict[str, Any] = {"id": meta["id"]}
    queued_abort = finish.get("type") == "abort" and n == 0
    if queued_abort:
        out["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
    else:
        if finish.get("type") == "abort":
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        out.update(finish_reason=finish, prompt_tokens=meta["prompt_tokens"],
                   weight_version=meta["weight_version"], num_retractions=0, reasoning_tokens=0)
    out["weight_version"] = meta["weight_version"]
    if return_logprob:
        out["input_token_logprobs"] = []
        out["output_token_logprobs"] = meta.get("output_token_logprobs", [])
        out["output_token_logprobs_length"] = n
    out["completion_tokens"] = n
    if not queued_abort:
        out.update(cached_tokens=meta.get("cached_tokens", 0), cached_tokens_details=None, dp_rank=None)
    out["weight_versions"] = spans
    out["e2e_latency"] = meta.get("e2e_latency", 0.0)
    out["response_sent_to_client_ts"] = time.time()
    out["emulator_version_runs"] = runs
    return {"text": reply.get("text", ""), "output_ids": reply["output_ids"], "meta_info": out}


def wire_form(body: Any) -> Any:
    """``body`` as SGLang puts it on the wire: a generate reply's token arrays (``output_ids``,
    ``LogprobArrays``) become lists and triples, in a copy; anything else is returned as it is."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict) or not isinstance(body.get("output_ids"), np.ndarray):
        return body
    triples = meta.get("output_token_logprobs")
    meta = dict(meta, output_token_logprobs=triples.to_triples()) if isinstance(triples, LogprobArrays) else meta
    return dict(body, output_ids=body["output_ids"].tolist(), meta_info=meta)


def _check_number(params: dict, key: str) -> None:
    value = params.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        kind = "string" if isinstance(value, str) else type(value).__name__
        raise BadRequest(f"invalid type: {kind} {json.dumps(value)}, expected f64", schema=True)


def parse_generate(payload: Any, vocab_size: int) -> dict[str, Any]:
    """Validate a /generate body into ``EmulatedEngine.generate`` keyword arguments, refusing what
    SGLang 0.5.23 refuses with its messages (and ``stream``, which the emulator does not serve)."""
    body = _require_dict(payload, "generate")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object", schema=True)
    unknown = sorted(set(params) - set(SAMPLING_PARAMS))
    if unknown:
        raise BadRequest(f"unknown field `{unknown[0]}`, expected one of "
                         + ", ".join(f"`{p}`" for p in SAMPLING_PARAMS), schema=True)
    for key in ("temperature", "top_p", "min_p"):
        _check_number(params, key)
    for key in ("return_logprob", "stream"):
        if key in body and not isinstance(body[key], bool):
            kind = "string" if isinstance(body[key], str) else type(body[key]).__name__
            raise BadRequest(f"invalid type: {kind} {json.dumps(body[key])}, expected a boolean", schema=True)
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        kind = "string" if isinstance(ignore_eos, str) else type(ignore_eos).__name__
        raise BadRequest(f"invalid type: {kind} {json.dumps(ignore_eos)}, expected a boolean", schema=True)
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    # a list, as JSON gives it; in process (LocalTransport) the client's own int32 array as it is
    if not isinstance(input_ids, (list, np.ndarray)):
        raise BadRequest("input_ids must be a list of token ids", schema=True)
    if not len(input_ids):
        raise BadRequest("input_ids cannot be empty.")
    try:
        check_token_ids(input_ids, vocab_size, "input_ids")  # the client's check: in C, for long inputs
    except ValueError:  # then the emulator's own rules, and SGLang's words
        if not all(_is_int(t) for t in input_ids):
            raise BadRequest("input_ids must hold integers only (batched input is not supported by the "
                             "emulator)") from None
        if min(input_ids) < 0 or max(input_ids) >= vocab_size:
            # SGLang 0.5.23 does not check this: an id >= vocab size kills the engine's scheduler
            raise BadRequest(f"input_ids must lie in [0, {vocab_size})") from None
    temperature = params.get("temperature", 1.0)
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = params.get("top_p", 1.0)
    if top_p is not None and not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new_tokens):
        raise BadRequest(f"invalid type: {type(max_new_tokens).__name__}, expected u32", schema=True)
    if max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    for key in ("stop", "stop_token_ids", "stop_regex"):
        if params.get(key):  # the synthetic model ends responses with EOS only
            raise BadRequest(f"sampling_params.{key} is not supported by the emulator (it stops on EOS only)")
    if body.get("stream", False):
        raise BadRequest("stream is not supported by the emulator (SGLang would stream server-sent events)")
    sampling_seed = params.get("sampling_seed", 0)
    if sampling_seed is None:
        sampling_seed = 0
    if not _is_int(sampling_seed):
        raise BadRequest(f"sampling_params.sampling_seed must be an integer, got {sampling_seed!r}")
    return_logprob = body.get("return_logprob", False)
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest("rid must be a non-empty string")
    return {"rid": rid, "input_ids": input_ids, "max_new_tokens": max_new_tokens,
            "sampling_seed": sampling_seed, "return_logprob": return_logprob, "ignore_eos": ignore_eos}


class RouterHandler:
    """The router front: dispatch of /generate to the least-loaded engine, broadcast of the rest."""

    def __init__(self, engines: list[EngineHandler], urls: list[str]):
        if len(engines) != len(urls) or not engines:
            raise ValueError("router needs one url per engine and at least one engine")
        self.engines = engines
        self.urls = list(urls)
        self._next = 0  # round-robin start among equally loaded engines

    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict | None]:
        path = path.rstrip("/") or "/"
        method = method.upper()
        routes = {"/workers": "GET", "/generate": "POST", "/abort_request": "POST",
                  "/update_weight_version": "POST", "/update_weights_from_disk": "POST", "/model_info": "GET",
                  "/v1/loads": "GET", "/emulator/stats": "GET", "/health": "GET"}
        if path not in routes:
            return _not_found()
        if method != routes[path]:
            return 405, {"detail": "Method Not Allowed"}
        if path == "/workers":
            # sglang-router's reply (slime reads the urls from it)
            return 200, {"workers": [{"url": url, "is_healthy": True, "worker_type": "regular"}
                                     for url in self.urls], "total": len(self.urls)}
        if path == "/generate":
            return await self._pick().handle(method, path, payload)
        if path in ("/update_weight_version", "/update_weights_from_disk"):
            # Resolve "next version" once so every engine lands on the same number.
            key = "new_version" if path == "/update_weight_version" else "weight_version"
            try:
                body = dict(_require_dict(payload, path.lstrip("/")))
            except BadRequest as exc:
                return 400, exc.body
            if body.get(key) is None and key == "new_version":
                body[key] = str(max(e.engine.weight_version for e in self.engines) + 1)
            payload = body
        if path in ("/abort_request", "/update_weight_version", "/update_weights_from_disk"):
            replies = [await e.handle(method, path, payload) for e in self.engines]
            bad = next((r for r in replies if r[0] != 200), None)
            return bad if bad is not None else replies[0]
        if path in ("/model_info", "/health"):
            return await self.engines[0].handle(method, path, payload)
        if path == "/v1/loads":
            return 200, {"loads": [dict(e.engine.load(), url=url) for e, url in zip(self.engines, self.urls)]}
        return 200, {"engines": [dict(e.engine.stats(), url=url) for e, url in zip(self.engines, self.urls)]}

    def _pick(self) -> EngineHandler:
        n = len(self.engines)
        order = [(self._next + i) % n for i in range(n)]
        best = min(order, key=lambda i: self.engines[i].engine.num_queued)
        self._next = (best + 1) % n
        return self.engines[best]


# ------------------------------------------------------------------------------------ HTTP front
def make_app(handler: Handler) -> web.Application:
    async def endpoint(request: web.Request) -> web.Response:
        payload = None
        if request.body_exists:
            raw = await request.read()
            if raw.strip():
                try:
                    payload = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    status, body = 400, {"error": "request body is not valid JSON"}
                    return web.json_response(body, status=status)
        status, body = await handler.handle(request.method, request.path, payload)
        if body is None:
            return web.Response(status=status)  # SGLang's empty replies (/abort_request, /health)
        return web.Response(body=_encode_json(wire_form(body)), status=status, content_type="application/json")

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", endpoint)
    return app


def _encode_json(body: Any) -> bytes:
    """orjson, as SGLang encodes its replies (a 16K-token reply in a fraction of the standard
    library's time); the standard library for what orjson does not take (numpy scalars in stats)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0 = a free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """One aiohttp app served on a bound socket; ``url`` is where it listens."""

    def __init__(self, handler: Handler, sock: socket.socket):
        self._runner = web.AppRunner(make_app(handler), handle_signals=False, access_log=None,
                                     handler_cancellation=True)
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"

    async def start(self) -> None:
        await self._runner.setup()
        # uvicorn's (SGLang's server) accept backlog: aiohttp's default of 128 drops the connects of
        # a first fill of hundreds of requests per engine, which then wait out a SYN retransmit
        await web.SockSite(self._runner, self._sock, backlog=2048).start()

    async def close(self) -> None:
        await self._runner.cleanup()
        self._sock.close()

