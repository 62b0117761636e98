"""Protocol handlers (engine and router) and the aiohttp front that serves them.

``EngineHandler.handle`` / ``RouterHandler.handle`` take ``(method, path, payload)`` and return
``(status, body)``; the HTTP server and ``LocalTransport`` are both thin wrappers around them, so the
in-process and the socket paths run exactly the same protocol code.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web

from .batching import EmulatedEngine, EngineStopped, RequestRejected

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omits it


class BadRequest(ValueError):
    """The payload breaks the protocol (HTTP 400)."""


class Handler(Protocol):
    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict]: ...


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "code": status}}


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
    """The native SGLang endpoints of one emulated engine."""

    def __init__(self, engine: EmulatedEngine):
        self.engine = engine

    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict]:
        route = _ENGINE_ROUTES.get(path.rstrip("/") or "/")
        if route is None:
            return _error(404, f"no endpoint {path}")
        allowed, fn = route
        if method.upper() != allowed:
            return _error(405, f"{path} takes {allowed}, not {method}")
        try:
            return 200, await fn(self, payload)
        except (BadRequest, RequestRejected) as exc:
            return _error(400, str(exc))
        except EngineStopped as exc:
            return _error(503, str(exc))

    # ---------------------------------------------------------------------------- endpoints
    async def _generate(self, payload: Any) -> dict:
        request = parse_generate(payload, self.engine.model.vocab_size)
        return await self.engine.generate(**request)

    async def _abort(self, payload: Any) -> dict:
        body = _require_dict(payload, "abort_request")
        abort_all = body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise BadRequest("abort_all must be a boolean")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        if not abort_all and rid is None:
            raise BadRequest("abort_request needs rid or abort_all")
        self.engine.abort(rid=rid, abort_all=abort_all)
        return {"success": True}

    async def _loads(self, payload: Any) -> dict:
        return {"loads": [self.engine.load()]}

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
        return {"success": True, "new_version": str(new_version)}

    async def _get_weight_version(self, payload: Any) -> dict:
        return {"weight_version": str(self.engine.weight_version)}

    async def _stats(self, payload: Any) -> dict:
        return self.engine.stats()

    async def _health(self, payload: Any) -> dict:
        return {"status": "ok"}


_ENGINE_ROUTES: dict[str, tuple[str, Callable[[EngineHandler, Any], Awaitable[dict]]]] = {
    "/generate": ("POST", EngineHandler._generate),
    "/abort_request": ("POST", EngineHandler._abort),
    "/v1/loads": ("GET", EngineHandler._loads),
    "/update_weight_version": ("POST", EngineHandler._update_weight_version),
    "/get_weight_version": ("GET", EngineHandler._get_weight_version),
    "/emulator/stats": ("GET", EngineHandler._stats),
    "/health": ("GET", EngineHandler._health),
}


def parse_generate(payload: Any, vocab_size: int) -> dict[str, Any]:
    """Validate a /generate body into ``EmulatedEngine.generate`` keyword arguments."""
    body = _require_dict(payload, "generate")
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise BadRequest("input_ids is required (the emulator has no tokenizer; text is not accepted)")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list of token ids")
    if not all(_is_int(t) for t in input_ids):
        raise BadRequest("input_ids must hold integers only (batched input is not supported)")
    if min(input_ids) < 0 or max(input_ids) >= vocab_size:
        raise BadRequest(f"input_ids must lie in [0, {vocab_size})")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling_seed = params.get("sampling_seed", 0)
    if sampling_seed is None:
        sampling_seed = 0
    if not _is_int(sampling_seed):
        raise BadRequest(f"sampling_params.sampling_seed must be an integer, got {sampling_seed!r}")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("sampling_params.ignore_eos must be a boolean")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob must be a boolean")
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

    async def handle(self, method: str, path: str, payload: Any) -> tuple[int, dict]:
        path = path.rstrip("/") or "/"
        method = method.upper()
        routes = {"/workers": "GET", "/generate": "POST", "/abort_request": "POST",
                  "/update_weight_version": "POST", "/get_weight_version": "GET",
                  "/v1/loads": "GET", "/emulator/stats": "GET", "/health": "GET"}
        if path not in routes:
            return _error(404, f"no endpoint {path}")
        if method != routes[path]:
            return _error(405, f"{path} takes {routes[path]}, not {method}")
        if path == "/workers":
            return 200, {"urls": list(self.urls)}
        if path == "/generate":
            return await self._pick().handle(method, path, payload)
        if path == "/update_weight_version":
            # Resolve "next version" once so every engine lands on the same number.
            try:
                body = dict(_require_dict(payload, "update_weight_version"))
                if body.get("new_version") is None:
                    body["new_version"] = str(max(e.engine.weight_version for e in self.engines) + 1)
            except BadRequest as exc:
                return _error(400, str(exc))
            payload = body
        if path in ("/abort_request", "/update_weight_version"):
            replies = [await e.handle(method, path, payload) for e in self.engines]
            bad = next((r for r in replies if r[0] != 200), None)
            return bad if bad is not None else replies[0]
        if path in ("/get_weight_version", "/health"):
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
                    status, body = _error(400, "request body is not valid JSON")
                    return web.json_response(body, status=status)
        status, body = await handler.handle(request.method, request.path, payload)
        return web.json_response(body, status=status)

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", endpoint)
    return app


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
        await web.SockSite(self._runner, self._sock).start()

    async def close(self) -> None:
        await self._runner.cleanup()
        self._sock.close()

