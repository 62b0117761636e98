"""How a job's requests spread over its engines, from the plugin's own calls: each ``/generate`` the
engine client sends (health probes aside) is a span on one engine, from when it was sent to when its
reply (or error) came back. From the spans: each engine's share of the requests, of the tokens its
replies carried, and of the time it was busy (engine-seconds with at least one of the job's requests
on it: the union of its spans, so ten requests at once count once). Counts and shares, never speeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from april_slime.core.transport import HttpTransport


def reply_token_count(reply) -> int | None:
    """The tokens a ``/generate`` reply brought back, its ``output_ids`` a list or an array
    (``transport.decode_generate_reply``); None for a reply that is not a JSON object."""
    if not isinstance(reply, dict):
        return None
    ids = reply.get("output_ids")
    return 0 if ids is None else len(ids)


@dataclass(frozen=True)
class Span:
    url: str
    start: float
    end: float
    tokens: int  # output tokens of the reply; 0 for a call that failed


def record_spans(monkeypatch) -> list[Span]:
    """Spans of every generate the plugin sends from now on (through ``HttpTransport``)."""
    spans: list[Span] = []
    request = HttpTransport.request

    async def recording(self, method, url, path, payload, timeout_s):
        if path != "/generate" or str((payload or {}).get("rid", "")).startswith("april-probe-"):
            return await request(self, method, url, path, payload, timeout_s)
        start, tokens = time.monotonic(), 0
        try:
            reply = await request(self, method, url, path, payload, timeout_s)
            tokens = reply_token_count(reply) or 0
            return reply
        finally:
            spans.append(Span(url.rstrip("/"), start, time.monotonic(), tokens))

    monkeypatch.setattr(HttpTransport, "request", recording)
    return spans


def busy_seconds(spans: list[Span]) -> float:
    """The length of the union of the spans' intervals."""
    busy, reach = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s.start):
        if span.end > reach:
            busy += span.end - max(span.start, reach)
            reach = span.end
    return busy


def shares(spans: list[Span], engines: list[str]) -> dict[str, dict[str, float]]:
    """Per engine: its share of the requests, of the tokens and of the busy engine-seconds."""
    per = {url: [s for s in spans if s.url == url] for url in engines}
    stray = {s.url for s in spans} - set(engines)
    if stray:
        raise AssertionError(f"requests went to {sorted(stray)}, which are not the engines {engines}")
    totals = {"requests": len(spans), "tokens": sum(s.tokens for s in spans),
              "busy": sum(busy_seconds(p) for p in per.values())}
    out = {}
    for url, mine in per.items():
        values = {"requests": len(mine), "tokens": sum(s.tokens for s in mine), "busy": busy_seconds(mine)}
        out[url] = {key: values[key] / totals[key] if totals[key] else 0.0 for key in values}
    return out
