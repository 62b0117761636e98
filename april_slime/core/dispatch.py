"""Where a job's model calls go: straight to the engines, or through slime's router.

slime always starts ``sglang-router`` in front of its engines. The client reads the router's
``GET /workers`` and then dispatches in one of two modes:

* ``direct``: every generate goes to an engine the scheduler picks (per-engine supplementation:
  the healthy engine with the fewest requests of the step in flight, so a refill lands where a slot
  just freed) and every abort to that engine, by rid. The router is not on the data path.
* ``router``: every generate goes to the router (``POST {router}/generate``), which places it by
  its own policy. sglang-router has no ``/abort_request``, so an abort is fanned out to every
  worker the router listed, as slime's own ``abort`` does; a worker that never saw the rid answers
  200 and does nothing.

What each mode costs:

* direct gives load-aware placement counted in the plugin's own requests, engine-level health
  (a stalled engine is probed and taken out of dispatch), and exact aborts (one call per rid);
  it bypasses whatever the router does: pairing prefill and decode workers (PD disaggregation), the
  DP rank a DP-aware router assigns, and the prefix affinity of ``cache_aware`` (a resumed partial
  lands on the least-loaded engine, not on the one whose radix cache holds its prefix).
* router keeps the router's policy (prefix affinity, PD pairing, DP ranks) but the scheduler sees
  the router as one engine: placement is the router's, health is the router's (a worker the router
  still lists keeps getting requests), and an abort costs one call per worker instead of one.
  sglang-router re-serialises each request into its own schema and drops the fields it does not
  know (measured on 0.3.2: ``sampling_params.custom_params``, ``return_routed_experts``,
  ``routed_experts_start_len``); the client refuses to send a request that carries one of them.

``choose`` picks the mode: ``april_dispatch: direct`` or ``router`` is taken as it is (direct is
refused where it cannot reach the engines at all: PD workers, DP-rank URLs); ``auto`` picks router
when direct dispatch would bypass what the router must do (PD disaggregation, a DP-aware router),
else direct. A ``cache_aware`` router policy alone does not switch ``auto`` to router: it is
sglang-router's default, so every slime job has it; ``Dispatch.notes`` says what direct dispatch
gives up there, and the job can choose ``router``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from april_slime.core.config import DISPATCH_MODES
from april_slime.core.sglang_protocol import EngineError, EngineReplyError, normalise_url

# Fields sglang-router 0.3.2 drops when it re-serialises a /generate request (measured against a
# recording worker). Text-rendering fields (``spaces_between_special_tokens``) are dropped too,
# but change nothing the plugin reads (it decodes the token ids itself), so they pass.
ROUTER_DROPPED_SAMPLING_PARAMS = ("custom_params",)
ROUTER_DROPPED_FIELDS = ("return_routed_experts", "routed_experts_start_len")


class DispatchError(EngineError):
    """The requested dispatch cannot serve this deployment; the message says why and what to set."""


@dataclass(frozen=True)
class Worker:
    """One entry of the router's ``/workers``: its URL as listed, the engine it lives on (a DP-aware
    router lists ``http://host:port@rank``), its type (regular, prefill, decode) and DP rank."""

    listed_url: str
    url: str
    worker_type: str = "regular"
    dp_rank: int | None = None


def parse_workers(reply: Any, router_url: str) -> list[Worker]:
    """``{"urls": [...]}``, ``{"workers": [...]}`` or a bare list; items are URLs or objects with a
    ``url`` key and, from sglang-router, a ``worker_type``."""
    items = reply.get("urls", reply.get("workers")) if isinstance(reply, dict) else reply
    if not isinstance(items, list):
        raise EngineReplyError(f"router {router_url} GET /workers: no worker list in {reply!r}")
    workers = []
    for item in items:
        url = item.get("url") if isinstance(item, dict) else item
        if not isinstance(url, str) or not url:
            raise EngineReplyError(f"router {router_url} GET /workers: bad worker entry {item!r}")
        kind = item.get("worker_type") if isinstance(item, dict) else None
        base, rank = url, None
        head, sep, tail = url.rpartition("@")
        if sep and tail.isdigit() and "://" in head:
            base, rank = head, int(tail)
        workers.append(Worker(normalise_url(url), normalise_url(base), str(kind or "regular"), rank))
    return workers


@dataclass(frozen=True)
class DeploymentHints:
    """What the job's own arguments say about the router (slime's ``--router-*`` and
    ``--prefill-num-servers`` / ``--sglang-config``); the workers' list says the rest."""

    pd_disaggregation: bool = False
    dp_aware_router: bool = False
    router_policy: str | None = None


@dataclass(frozen=True)
class Dispatch:
    """The chosen mode, the engines behind it, and why it was chosen.

    ``targets`` are what the scheduler dispatches to (and watches as "engines"): the engines in
    direct mode, the router alone in router mode. ``engines`` are the engines themselves, for loads,
    weight versions and aborts."""

    mode: str
    engines: tuple[str, ...]
    router_url: str | None = None
    reason: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def targets(self) -> list[str]:
        return [self.router_url] if self.mode == "router" else list(self.engines)

    def is_router(self, url: str) -> bool:
        return self.mode == "router" and normalise_url(url) == self.router_url

    def abort_urls(self, target: str) -> list[str]:
        """Where an abort of a request sent to ``target`` must go."""
        return list(self.engines) if self.is_router(target) else [normalise_url(target)]

    def describe(self) -> str:
        where = f"through the router {self.router_url}" if self.mode == "router" else "straight to the engines"
        return f"{self.mode} dispatch ({where}; {len(self.engines)} engines): {self.reason}"

    @classmethod
    def direct(cls, engine_urls: list[str], reason: str = "engines given") -> Dispatch:
        return cls("direct", tuple(_unique(normalise_url(u) for u in engine_urls)), None, reason)


def _unique(urls) -> list[str]:
    seen: dict[str, None] = {}
    for url in urls:
        seen.setdefault(url, None)
    return list(seen)


def choose(setting: str, router_url: str, workers: list[Worker], hints: DeploymentHints | None = None) -> Dispatch:
    """The dispatch ``setting`` (auto | direct | router) gives for these workers; ``DispatchError``
    when direct dispatch is asked for where it cannot reach the engines."""
    if setting not in DISPATCH_MODES:
        raise DispatchError(f"april_dispatch: must be one of {', '.join(DISPATCH_MODES)}; got {setting!r}")
    hints = hints or DeploymentHints()
    router_url = normalise_url(router_url)
    engines = tuple(_unique(w.url for w in workers))
    pd = sorted({w.worker_type for w in workers} & {"prefill", "decode"})
    ranked = [w.listed_url for w in workers if w.dp_rank is not None]
    needs_router = []
    if pd or hints.pd_disaggregation:
        seen = f"the router lists {' and '.join(pd)} workers" if pd else "slime runs prefill servers"
        needs_router.append(f"PD disaggregation ({seen}: only the router pairs a prefill with a decode worker)")
    if ranked or hints.dp_aware_router:
        seen = f"it lists DP ranks such as {ranked[0]}" if ranked else "slime's --router-dp-aware is set"
        needs_router.append(f"a DP-aware router ({seen}: the router assigns each request its DP rank)")
    notes = []
    if hints.router_policy == "cache_aware":
        notes.append("the router's cache_aware policy places a request where its prefix is cached; direct "
                     "dispatch places it by load instead (a resumed partial re-prefills on another engine "
                     "unless it lands where it ran); april_dispatch: router keeps the router's placement")
    if setting == "direct":
        if pd or ranked:
            raise DispatchError(f"april_dispatch: direct cannot reach these engines: {needs_router[0]}; "
                                "use april_dispatch: router (or auto)")
        return Dispatch("direct", engines, router_url, "set by april_dispatch: direct", tuple(notes))
    if setting == "router":
        return Dispatch("router", engines, router_url, "set by april_dispatch: router", tuple(notes))
    if needs_router:
        return Dispatch("router", engines, router_url, "chosen for " + "; ".join(needs_router), tuple(notes))
    return Dispatch("direct", engines, router_url, "chosen: the router does nothing here that direct dispatch "
                    "bypasses (regular workers, no DP-aware routing)", tuple(notes))


def router_dropped_fields(payload: dict) -> list[str]:
    """The fields of a /generate payload that the router would drop silently."""
    params = payload.get("sampling_params") or {}
    dropped = [f"sampling_params.{k}" for k in ROUTER_DROPPED_SAMPLING_PARAMS if params.get(k) not in (None, {})]
    return dropped + [k for k in ROUTER_DROPPED_FIELDS if payload.get(k) not in (None, False)]
