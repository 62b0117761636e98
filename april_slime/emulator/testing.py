"""Start an emulated cluster inside the running event loop, for tests and benchmarks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from .batching import EngineConfig
from .cluster import EmulatorCluster, LocalTransport
from .model import LengthModel, SyntheticLM


@dataclass
class RunningCluster:
    router_url: str
    engine_urls: list[str]
    cluster: EmulatorCluster
    transport: LocalTransport  # in-process access to the same handlers (also works over HTTP URLs)


def build_cluster(num_engines: int = 2, seed: int = 0, *, length: LengthModel | str | None = None,
                  engine_config: EngineConfig | None = None, vocab_size: int | None = None,
                  eos_token_id: int | None = None, **engine_overrides: Any) -> EmulatorCluster:
    """An unstarted cluster; ``engine_overrides`` are ``EngineConfig`` fields (``time_scale``,
    ``kv_capacity_tokens``, ``max_running_requests``, ``time=TimeModel(...)``, ...)."""
    if isinstance(length, str):
        length = LengthModel.parse(length)
    model_kw: dict[str, Any] = {"seed": seed}
    if length is not None:
        model_kw["length"] = length
    if vocab_size is not None:
        model_kw["vocab_size"] = vocab_size
    if eos_token_id is not None:
        model_kw["eos_token_id"] = eos_token_id
    config = replace(engine_config or EngineConfig(), **engine_overrides)
    return EmulatorCluster(num_engines, model=SyntheticLM(**model_kw), engine_config=config)


@contextlib.asynccontextmanager
async def start_cluster(num_engines: int = 2, seed: int = 0, *, time_scale: float = 50.0,
                        http: bool = True, host: str = "127.0.0.1",
                        **kw: Any) -> AsyncIterator[RunningCluster]:
    """Router + engines in the current loop; over HTTP on free loopback ports unless ``http`` is
    False (then the URLs are in-process names for ``transport``, e.g. under ``run_virtual``, where
    ``time_scale`` should be 1). Other keywords as for ``build_cluster``. Tears down on exit."""
    cluster = build_cluster(num_engines, seed, time_scale=time_scale, **kw)
    await cluster.start()
    try:
        if http:
            await cluster.serve_http(host)
        yield RunningCluster(cluster.router_url, list(cluster.engine_urls), cluster, cluster.transport())
    finally:
        await cluster.close()
