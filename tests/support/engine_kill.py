"""What the engine-kill tests keep outside the scheduler, to check it from what they see: where
every group handed out is (``GroupLedger``), every generate attempt and how it ended
(``CallLog``, filled by ``RecordingTransport``), and the partial responses the buffer held
(``buffered_prefixes``). Shared by the fast tier (emulated engines, ``tests/test_engine_kill.py``)
and the real tier (SGLang CPU engines, ``tests/real/test_engine_kill_real.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tests.support.engine_spans import reply_token_count


class GroupLedger:
    """Every group the prompt source handed out is, after every step, in exactly one place:
    delivered once, in the buffer, or dropped with a reason the scheduler reported."""

    def __init__(self) -> None:
        self.handed_out: set[str] = set()
        self.delivered: list[str] = []
        self.dropped: dict[str, str] = {}

    def check(self, buffered: set[str], where: str) -> None:
        delivered = set(self.delivered)
        assert len(delivered) == len(self.delivered), f"{where}: a group was delivered twice"
        assert not delivered & buffered, f"{where}: a delivered group is still buffered"
        assert not set(self.dropped) & (delivered | buffered), f"{where}: a dropped group came back"
        missing = self.handed_out - delivered - buffered - set(self.dropped)
        assert not missing, f"{where}: groups lost: {sorted(missing)[:10]}"
        extra = (delivered | buffered) - self.handed_out
        assert not extra, f"{where}: groups from nowhere: {sorted(extra)[:10]}"

    def summary(self, buffered: set[str]) -> str:
        return (f"{len(self.handed_out)} groups handed out, {len(self.delivered)} delivered, {len(buffered)} "
                f"buffered, {len(self.dropped)} dropped {sorted(set(self.dropped.values()))}")


@dataclass
class Attempt:
    """One generate attempt as the transport saw it (a client retry is an attempt of its own)."""

    rid: str
    url: str
    sent: float  # loop time
    input_len: int  # prompt + the partial response the call continues
    ended: float | None = None
    tokens: int | None = None  # output tokens of its reply; None: it ended in an error
    error: str | None = None

    @property
    def item(self) -> str:
        return self.rid.rsplit("#", 1)[0]

    @property
    def call_number(self) -> int:
        return int(self.rid.rsplit("#", 1)[1])


@dataclass
class CallLog:
    """Every generate attempt of the plugin's calls (health probes left out), in sending order."""

    attempts: list[Attempt] = field(default_factory=list)

    def to(self, url: str) -> list[Attempt]:
        return [a for a in self.attempts if a.url == url]

    def in_flight(self, url: str) -> list[Attempt]:
        return [a for a in self.attempts if a.url == url and a.ended is None]

    def failed_calls(self, url: str, since: float, until: float = float("inf")) -> dict[str, Attempt]:
        """rid -> last attempt, of the calls on ``url`` whose last attempt ended in an error between
        ``since`` and ``until`` (the calls an engine fault at ``since`` took)."""
        last: dict[str, Attempt] = {}
        for a in self.attempts:
            if a.url == url and a.ended is not None and since <= a.ended <= until:
                last[a.rid] = a
        return {rid: a for rid, a in last.items() if a.error is not None}

    def running_at(self, url: str, t: float) -> set[str]:
        """rids of the calls with an attempt on ``url`` in flight at time ``t``."""
        return {a.rid for a in self.attempts
                if a.url == url and a.sent <= t and (a.ended is None or a.ended >= t)}

    def first_call(self, rid: str) -> Attempt | None:
        """The first attempt of the first call of ``rid``'s work item (its prompt alone)."""
        head = rid.rsplit("#", 1)[0]
        return next((a for a in self.attempts if a.item == head), None)

    def next_call(self, rid: str) -> Attempt | None:
        """The first attempt of the call that followed ``rid`` for the same work item."""
        head, n = rid.rsplit("#", 1)
        want = f"{head}#{int(n) + 1}"
        return next((a for a in self.attempts if a.rid == want), None)


class RecordingTransport:
    """A transport that records every generate attempt into ``log`` and passes it to ``inner``;
    ``on_request(method, url, path, payload)``, when set, runs before a request goes out (a test
    places a fault there)."""

    def __init__(self, inner: Any, log: CallLog, clock=None) -> None:
        self.inner = inner
        self.log = log
        self.clock = clock
        self.on_request = None

    def _now(self) -> float:
        return self.clock() if self.clock is not None else asyncio.get_running_loop().time()

    async def request(self, method: str, url: str, path: str, payload: dict | None, timeout_s: float) -> Any:
        if self.on_request is not None:
            self.on_request(method, url.rstrip("/"), path, payload)
        if path != "/generate" or str((payload or {}).get("rid", "")).startswith("april-"):
            return await self.inner.request(method, url, path, payload, timeout_s)
        attempt = Attempt(payload["rid"], url.rstrip("/"), self._now(), len(payload["input_ids"]))
        self.log.attempts.append(attempt)
        try:
            reply = await self.inner.request(method, url, path, payload, timeout_s)
        except BaseException as e:
            attempt.ended, attempt.error = self._now(), f"{type(e).__name__}: {e}"
            raise
        attempt.ended, attempt.tokens = self._now(), reply_token_count(reply) or 0
        return reply

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


def buffered_prefixes(groups) -> dict[str, tuple[list[int], list[float]]]:
    """uid -> (response ids, log-probs) of every buffered trajectory holding tokens."""
    return {t.uid: (list(t.response_ids), list(t.logprobs)) for g in groups for t in g.trajectories
            if t.response_ids}


def check_prefixes_kept(before: dict[str, tuple[list[int], list[float]]], trajectories, where: str) -> int:
    """Every trajectory of ``trajectories`` (delivered or still buffered) that ``before`` held starts
    with what it held; returns how many of them grew (were resumed)."""
    grew = 0
    for t in trajectories:
        if t.uid not in before:
            continue
        ids, lps = before[t.uid]
        assert list(t.response_ids[:len(ids)]) == ids and list(t.logprobs[:len(lps)]) == lps, (
            f"{where}: {t.uid} lost the {len(ids)} tokens it had buffered")
        grew += len(t.response_ids) > len(ids)
    return grew
