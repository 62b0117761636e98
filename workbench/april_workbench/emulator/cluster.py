"""A router and its engines in one process, reachable in-process (``LocalTransport``) or over HTTP."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from april_slime.core.transport import TransportHTTPError, encode_json

from .batching import EmulatedEngine
from .config import EngineConfig
from .cputime import CpuMeter, metered
from .model import SyntheticLM
from .replay import EmulatedReplay
from .server import EngineHandler, Handler, HttpServer, RouterHandler, bind_socket, wire_form

LOCAL_ROUTER_URL = "http://emulator-router"


def local_engine_url(index: int) -> str:
    return f"http://emulator-engine-{index}"


class EmulatorCluster:
    """Engines sharing one synthetic model and one emulated clock, behind one router.

    URLs start as in-process names (``http://emulator-engine-<i>``, ``http://emulator-router``);
    ``serve_http`` puts every handler on a loopback port and switches the URLs to the real ones.
    """

    def __init__(self, num_engines: int = 1, *, model: SyntheticLM | None = None,
                 engine_config: EngineConfig | None = None, seed: int = 0,
                 replay: EmulatedReplay | None = None):
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if model is not None and seed != 0:
            raise ValueError("pass the seed inside model or as seed, not both")
        self.model = model if model is not None else SyntheticLM(seed=seed)
        self.engine_config = engine_config or EngineConfig()
        self.engines = [EmulatedEngine(self.model, self.engine_config, name=f"engine-{i}")
                        for i in range(num_engines)]
        self.engine_handlers = [EngineHandler(e, replay) for e in self.engines]
        self.engine_urls = [local_engine_url(i) for i in range(num_engines)]
        self.router_url = LOCAL_ROUTER_URL
        self.router_handler = RouterHandler(self.engine_handlers, self.engine_urls)
        self._servers: list[HttpServer] = []
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start every engine on the running loop, with one shared emulated time origin."""
        if self._started:
            raise RuntimeError("cluster already started")
        origin = asyncio.get_running_loop().time()
        for engine in self.engines:
            engine.start(origin)
        self._started = True

    async def serve_http(self, host: str = "127.0.0.1", router_port: int = 0,
                         engine_ports: list[int] | None = None) -> None:
        """Serve the router and every engine over HTTP (port 0 = a free port)."""
        if self._servers:
            raise RuntimeError("cluster is already serving HTTP")
        ports = engine_ports if engine_ports is not None else [0] * len(self.engines)
        if len(ports) != len(self.engines):
            raise ValueError(f"{len(self.engines)} engines but {len(ports)} engine ports")
        try:
            for handler, port in zip(self.engine_handlers, ports):
                server = HttpServer(handler, bind_socket(host, port))
                self._servers.append(server)
                await server.start()
            router = HttpServer(self.router_handler, bind_socket(host, router_port))
            self._servers.append(router)
            await router.start()
        except BaseException:
            await self._close_servers()
            raise
        self.engine_urls = [s.url for s in self._servers[:-1]]
        self.router_url = router.url
        self.router_handler.urls = list(self.engine_urls)

    async def close(self) -> None:
        """Abort what is in flight (clients get their partial replies) and stop serving."""
        for engine in self.engines:
            await engine.stop()
        await self._close_servers()

    async def _close_servers(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.close()

    # ------------------------------------------------------------------ access
    def handlers(self) -> dict[str, Handler]:
        """Current URL -> protocol handler (router included)."""
        table: dict[str, Handler] = dict(zip(self.engine_urls, self.engine_handlers))
        table[self.router_url] = self.router_handler
        return table

    def transport(self, **kw: Any) -> LocalTransport:
        return LocalTransport(self, **kw)

    def now(self) -> float:
        """Current emulated time in seconds since start."""
        return self.engines[0].now()

    def bump_weight_version(self, new_version: int | None = None) -> int:
        """Set (default: increment) the weight version on every engine; returns it."""
        version = new_version if new_version is not None else max(e.weight_version for e in self.engines) + 1
        for engine in self.engines:
            engine.update_weight_version(version)
        return version

    def loads(self) -> list[dict[str, int]]:
        return [e.load() for e in self.engines]

    def stats(self) -> dict[str, Any]:
        """Per-engine accounting for benchmarks, the time model and the current emulated time."""
        engines = [dict(e.stats(), url=url) for e, url in zip(self.engines, self.engine_urls)]
        return {
            "emulated_time": self.now(),
            "engines": engines,
            "totals": {key: sum(s[key] for s in engines) for key in (
                "busy_s", "generated_tokens", "decoded_tokens", "prefill_tokens",
                "recomputed_tokens", "retractions", "finished_requests", "aborted_requests")},
            "model": {"seed": self.model.seed, "vocab_size": self.model.vocab_size,
                      "eos_token_id": self.model.eos_token_id, "length": self.model.length.to_dict()},
            "engine_config": self.engine_config.to_dict(),
        }


class LocalTransport:
    """The engine client's Transport, routed to an in-process cluster's handlers by URL.

    The handlers keep no reference to a payload and build every reply afresh, so no copy is
    needed; ``copy_payloads`` adds a JSON round trip each way (what HTTP does) to prove a caller's
    payloads serialise. URLs in ``unreachable`` fail like a refused connection (fault injection).

    Replies come in SGLang's wire form (lists of token ids and ``[logprob, id, None]`` triples),
    unless ``token_arrays``: then a generate reply keeps the engine's arrays (``LogprobArrays``,
    which the client's reply checks read as they are), and no Python object is built per token
    on the way. Both forms carry the same values, bit for bit.

    ``transit_s``: the round trip of a generate or abort outside the engine's own time (HTTP, a
    real engine's front end), half on the way in, half on the way out; 0: instantaneous.
    """

    TRANSIT_PATHS = ("/generate", "/abort_request")

    def __init__(self, cluster: EmulatorCluster, *, copy_payloads: bool = False, token_arrays: bool = False,
                 transit_s: float = 0.0):
        if copy_payloads and token_arrays:
            raise ValueError("copy_payloads sends replies through JSON, which has no token arrays")
        if not (transit_s >= 0.0 and math.isfinite(transit_s)):
            raise ValueError(f"transit_s must be a finite value >= 0, got {transit_s}")
        self.cluster = cluster
        self.copy_payloads = copy_payloads
        self.token_arrays = token_arrays
        self.transit_s = transit_s
        self.unreachable: set[str] = set()
        self.cpu = CpuMeter()  # the handlers' own CPU (the engines' loops count theirs)

    async def request(self, method: str, url: str, path: str, payload: dict | None,
                      timeout_s: float) -> dict:
        url = url.rstrip("/")
        handler = self.cluster.handlers().get(url)
        if handler is None or url in self.unreachable:
            raise ConnectionRefusedError(f"cannot connect to {url}")
        if self.copy_payloads and payload is not None:
            payload = json.loads(encode_json(payload))
        delay = self.transit_s / 2 if self.transit_s and path in self.TRANSIT_PATHS else 0.0
        if delay:
            await asyncio.sleep(delay)
        # No timer of its own: the engine client bounds every attempt with the same ``timeout_s``
        # (``retries.call_with_retries``), and a call in flight holds nothing more than it needs.
        status, body = await metered(handler.handle(method, path, payload), self.cpu)
        if delay:
            await asyncio.sleep(delay)
        if not self.token_arrays:
            body = wire_form(body)
        if self.copy_payloads:
            body = json.loads(json.dumps(body))
        if not 200 <= status < 300:
            raise TransportHTTPError(status, body)
        return body

    async def close(self) -> None:
        """Nothing to release; present so it can stand in wherever an HTTP transport is closed."""
