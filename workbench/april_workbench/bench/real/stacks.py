"""The engines a comparison runs on: the local CPU stack, engines a user already runs, or their
emulated twin.

Each is a ``Stack``: the engine URLs the scheduler dispatches to (and the router, when there is
one), a transport to reach them, what happens to the engines between two steps, and what the
bench can read of their CPU. Between two steps of an arm the engines get the arm's next policy
version (``/update_weight_version``: each arm numbers its own steps, and arms take turns on the
same engines) and lose their prefix cache (``/flush_cache``), which is what a weight update does
to them: a partial resumed in the next step re-prefills its whole context, as in a real job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from april_slime.core.transport import HttpTransport, Transport, TransportHTTPError

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Stack(Protocol):
    engine_urls: list[str]
    router_url: str | None
    transport: Transport
    kind: str  # "local", "url" or "emulated"
    # the engines' weight version when the comparison started: every arm counts its versions from
    # it, so the engines' version never goes back (other users of the engines may rely on that)
    version_base: int

    async def next_version(self, version: int) -> None:
        """Between two steps: the engines take ``version`` and drop their prefix cache."""

    def engine_cpu_s(self) -> float | None:
        """CPU seconds the engines' processes used so far (None: not readable from here)."""


async def _post_each(transport: Transport, urls: list[str], path: str, body: dict | None) -> None:
    async def one(url: str) -> None:
        for attempt in range(3):
            try:
                await transport.request("POST", url, path, body, 60.0)
                return
            except ValueError:
                return  # /flush_cache answers plain text
            except ConnectionError:
                # a pooled keep-alive connection the server closed as it was reused: a new one
                # will do (the engine's own calls are retried by the client for the same reason)
                if attempt == 2:
                    raise

    await asyncio.gather(*(one(u) for u in urls))


class HttpStack:
    """Real SGLang engines over HTTP: the local stack's, or a user's (``--url``)."""

    def __init__(self, engine_urls: list[str], router_url: str | None, kind: str,
                 process_groups: list[int] | None = None):
        self.engine_urls = engine_urls
        self.router_url = router_url
        self.kind = kind
        self.process_groups = process_groups or []
        self.transport: Transport = HttpTransport()
        self.version_base = 0

    async def start(self) -> None:
        versions = []
        for url in self.engine_urls:
            info = await self.transport.request("GET", url, "/model_info", None, 60.0)
            try:
                versions.append(int(info.get("weight_version")))
            except (AttributeError, TypeError, ValueError):
                versions.append(0)  # a version that is no number: counted from 0
        self.version_base = max(versions, default=0)

    async def next_version(self, version: int) -> None:
        await _post_each(self.transport, self.engine_urls, "/update_weight_version", {"new_version": str(version)})
        await _post_each(self.transport, self.engine_urls, "/flush_cache", None)

    def engine_cpu_s(self) -> float | None:
        if not self.process_groups:
            return None
        return process_group_cpu_s(set(self.process_groups))

    async def close(self) -> None:
        await self.transport.close()


def process_group_cpu_s(groups: set[int]) -> float:
    """User + system CPU seconds of every live process in ``groups`` (from /proc; a process that
    exited is no longer counted, so read it around a step, not across an engine's life)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        if int(fields[2]) in groups:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


async def discover(url: str) -> tuple[list[str], str | None]:
    """The engines behind ``url``: a router's workers (``GET /workers``), or ``url`` itself when it
    is an engine. Several comma-separated URLs are engines."""
    urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
    if len(urls) > 1:
        return urls, None
    transport = HttpTransport()
    try:
        try:
            reply: Any = await transport.request("GET", urls[0], "/workers", None, 30.0)
        except (TransportHTTPError, ValueError):
            return urls, None
        listed = reply.get("workers") or reply.get("urls") if isinstance(reply, dict) else None
        if not listed:
            return urls, None
        return [(w["url"] if isinstance(w, dict) else str(w)).rstrip("/") for w in listed], urls[0]
    finally:
        await transport.close()


@dataclass
class LocalEngines:
    engine_urls: list[str]
    router_url: str
    process_groups: list[int]  # each engine's processes (its server, scheduler, detokenizer)
    model: Path


# the local model's own stop rate per token: what a slime rollout on it (``slime_dump``) sees; the
# comparisons ask for exact lengths and ignore it
LOCAL_EOS_RATE = 1 / 64


@contextlib.contextmanager
def local(engines: int, log_dir: Path, *, max_running_requests: int = 64,
          max_total_tokens: int = 32768) -> Iterator[LocalEngines]:
    """The local CPU stack: a tiny Qwen3 on ``engines`` SGLang 0.5.23 CPU engines behind
    sglang-router."""
    from april_workbench.localstack import local_stack, real_stack_missing
    from april_workbench.tiny_qwen3 import build_tiny_qwen3

    missing = real_stack_missing()
    if missing:
        raise RuntimeError(missing)
    model = build_tiny_qwen3(log_dir / "model", eos_rate=LOCAL_EOS_RATE)
    with local_stack(model, n_engines=engines, max_running_requests=max_running_requests,
                     max_total_tokens=max_total_tokens, log_dir=log_dir / "logs") as stack:
        yield LocalEngines(stack.engine_urls, stack.router_url, [e.pid for e in stack.engines if e.pid], model)


class EmulatedStack:
    """The emulated twin: ``spec``'s engines on the virtual clock, in process."""

    kind = "emulated"

    def __init__(self, spec: Any, seed: int = 0):
        from april_workbench.emulator import EmulatorCluster, SyntheticLM

        self.spec = spec
        self.cluster = EmulatorCluster(spec.num_engines, model=SyntheticLM(seed=seed),
                                       engine_config=spec.engine_config())
        self.engine_urls = list(self.cluster.engine_urls)
        self.router_url = self.cluster.router_url
        self.transport: Transport | None = None
        self.version_base = 0

    async def start(self) -> None:
        await self.cluster.start()
        self.transport = self.cluster.transport(transit_s=self.spec.transit_s)

    async def next_version(self, version: int) -> None:
        # the emulator keeps no prefix cache: every prefill is from scratch already
        await self.transport.request("POST", self.router_url, "/update_weight_version",
                                     {"new_version": str(version)}, 60.0)

    def engine_cpu_s(self) -> float | None:
        return None

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        await self.cluster.close()
