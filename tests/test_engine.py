"""EngineClient against scripted SGLang-protocol servers on loopback, and an in-memory transport."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from april_slime.core.engine import EngineClient, EngineWait
from april_slime.core.sglang_protocol import (
    EngineError,
    EngineLoad,
    EngineReplyError,
    EngineUnavailable,
    RequestRejected,
    parse_generate_reply,
)
from april_slime.core.transport import HttpTransport, TransportHTTPError

FAST = dict(max_retries=3, retry_backoff_s=0.001)


def generate_reply(
    rid: str = "r0",
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
    finish: str = "stop",
    version: Any = "3",
    prompt_tokens: int = 4,
) -> dict:
    tokens = [11, 12, 13] if tokens is None else tokens
    logprobs = [-0.5 - i for i in range(len(tokens))] if logprobs is None else logprobs
    return {
        "text": "",
        "output_ids": list(tokens),
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": finish},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "weight_version": version,
        },
    }


class ScriptedServer:
    """An aiohttp server whose reply to each path is scripted per test.

    ``script[path]`` is a list consumed one entry per request (the last entry repeats); an entry is
    a dict (JSON 200), ``(status, body)``, or an async callable ``f(request_json) -> response``.
    Every request is recorded as ``(path, json)`` in ``requests``.
    """

    def __init__(self) -> None:
        self.script: dict[str, list] = {}
        self.requests: list[tuple[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, body))
        entries = self.script.get(request.path)
        if not entries:
            return web.json_response({"error": "not scripted"}, status=404)
        entry = entries.pop(0) if len(entries) > 1 else entries[0]
        if callable(entry):
            entry = await entry(body)
        if isinstance(entry, web.StreamResponse):
            return entry
        if isinstance(entry, tuple):
            status, payload = entry
            if isinstance(payload, str):
                return web.Response(status=status, text=payload)
            return web.json_response(payload, status=status)
        return web.json_response(entry)

    async def start(self) -> ScriptedServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


@pytest.fixture
async def server():
    srv = await ScriptedServer().start()
    yield srv
    await srv.stop()


@pytest.fixture
async def server2():
    srv = await ScriptedServer().start()
    yield srv
    await srv.stop()


def free_port() -> int:
    """A loopback port with nothing listening on it (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def call_generate(client: EngineClient, url: str, **kw) -> Any:
    args = dict(
        max_new_tokens=8, rid="r0", sampling_params={"temperature": 1.0, "top_p": 0.9},
        sampling_seed=42,
    )
    args.update(kw)
    return await client.generate(url, [1, 2, 3, 4], **args)


# ---------------------------------------------------------------------------------- generate


async def test_generate_happy_path(server):
    server.script["/generate"] = [generate_reply(tokens=[5, 6, 7], version="3")]
    client = EngineClient([server.url + "/"], **FAST)
    try:
        result = await call_generate(client, server.url)
    finally:
        await client.close()
    assert result.output_ids.tolist() == [5, 6, 7]
    assert result.logprobs.tolist() == [-0.5, -1.5, -2.5]
    assert result.finish_reason == "stop"
    assert result.weight_version == 3
    assert (result.prompt_tokens, result.completion_tokens) == (4, 3)
    assert result.engine_url == server.url
    ((path, sent),) = server.requests
    assert path == "/generate"
    assert sent == {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {
            "temperature": 1.0, "top_p": 0.9, "max_new_tokens": 8, "sampling_seed": 42,
        },
        "return_logprob": True,
        "rid": "r0",
    }
    assert client.engine_urls == [server.url]
    stats = client.stats[server.url]
    assert (stats.calls, stats.retries, stats.failed_calls) == (1, 0, 0)


async def test_generate_without_output_ids_uses_logprob_triples(server):
    reply = generate_reply(tokens=[9, 8])
    del reply["output_ids"]
    server.script["/generate"] = [reply]
    client = EngineClient([server.url], **FAST)
    try:
        result = await call_generate(client, server.url)
    finally:
        await client.close()
    assert result.output_ids.tolist() == [9, 8]


async def test_aborted_reply_with_zero_tokens_is_valid(server):
    server.script["/generate"] = [generate_reply(tokens=[], finish="abort", version=7)]
    client = EngineClient([server.url], **FAST)
    try:
        result = await call_generate(client, server.url)
    finally:
        await client.close()
    assert result.finish_reason == "abort"
    assert result.output_ids.tolist() == [] and result.logprobs.tolist() == []
    assert result.weight_version == 7


async def test_default_weight_version_is_zero(server):
    server.script["/generate"] = [generate_reply(version="default")]
    client = EngineClient([server.url], **FAST)
    try:
        assert (await call_generate(client, server.url)).weight_version == 0
    finally:
        await client.close()


def _mutated(mutate: Callable[[dict], None]) -> dict:
    reply = generate_reply(rid="rid-77", tokens=[5, 6, 7])
    mutate(reply)
    return reply


def _set_meta(key: str, value: Any) -> Callable[[dict], None]:
    return lambda r: r["meta_info"].__setitem__(key, value)


MALFORMED = {
    "missing_meta_info": (lambda r: r.pop("meta_info"), "no meta_info"),
    "count_mismatch": (lambda r: r["output_ids"].append(8), "4 output_ids but 3"),
    "nan_logprob": (
        lambda r: r["meta_info"]["output_token_logprobs"][1].__setitem__(0, math.nan),
        "position 1",
    ),
    "inf_logprob": (
        lambda r: r["meta_info"]["output_token_logprobs"][2].__setitem__(0, -math.inf),
        "position 2",
    ),
    "null_logprob": (
        lambda r: r["meta_info"]["output_token_logprobs"][0].__setitem__(0, None),
        "position 0",
    ),
    "bad_finish_type": (_set_meta("finish_reason", {"type": "eos"}), "finish_reason"),
    "finish_reason_none": (_set_meta("finish_reason", None), "finish_reason"),
    "wrong_token_in_triple": (
        lambda r: r["meta_info"]["output_token_logprobs"][1].__setitem__(1, 99),
        "token 99",
    ),
    "missing_weight_version": (lambda r: r["meta_info"].pop("weight_version"), "weight_version"),
    "garbage_weight_version": (_set_meta("weight_version", "v-three"), "weight_version"),
    "completion_tokens_mismatch": (_set_meta("completion_tokens", 5), "completion_tokens=5"),
    "missing_logprobs": (lambda r: r["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    "positive_logprob": (
        lambda r: r["meta_info"]["output_token_logprobs"][1].__setitem__(0, 0.7),
        "position 1 is 0.7 > 0",
    ),
    "reply_of_another_rid": (_set_meta("id", "rid-78"), "another request"),
    "spans_with_gap": (
        _set_meta("weight_versions", [{"version": "2", "start": 0, "end": 1},
                                      {"version": "3", "start": 2, "end": 3}]),
        "does not continue the spans at token 1",
    ),
    "spans_short": (
        _set_meta("weight_versions", [{"version": "2", "start": 0, "end": 2}]),
        "cover 2 of 3",
    ),
    "spans_bad_version": (
        _set_meta("weight_versions", [{"version": "x", "start": 0, "end": 3}]),
        "weight_versions[0]",
    ),
    "too_many_tokens": (
        lambda r: r.update(generate_reply(rid="rid-77", tokens=list(range(9)))),
        "more than max_new_tokens=8",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_generate_reply_raises(server, case):
    mutate, fragment = MALFORMED[case]
    server.script["/generate"] = [_mutated(mutate)]
    client = EngineClient([server.url], **FAST)
    try:
        with pytest.raises(EngineReplyError) as info:
            await call_generate(client, server.url, rid="rid-77")
    finally:
        await client.close()
    message = str(info.value)
    assert fragment in message
    assert server.url in message and "rid-77" in message
    assert len(server.requests) == 1  # a malformed reply is not retried
    assert client.stats[server.url].reply_errors == 1


async def test_non_json_reply_raises_reply_error(server):
    server.script["/generate"] = [(200, "<html>gateway</html>")]
    client = EngineClient([server.url], **FAST)
    try:
        with pytest.raises(EngineReplyError, match="not JSON"):
            await call_generate(client, server.url)
    finally:
        await client.close()


# ---------------------------------------------------------------------------- retries / errors


async def test_503_twice_then_success(server):
    server.script["/generate"] = [
        (503, {"error": "busy"}), (503, {"error": "busy"}), generate_reply(),
    ]
    client = EngineClient([server.url], **FAST)
    try:
        result = await call_generate(client, server.url)
    finally:
        await client.close()
    assert result.output_ids.tolist() == [11, 12, 13]
    assert server.paths() == ["/generate"] * 3
    # every attempt resends the same rid and input
    assert all(body == server.requests[0][1] for _, body in server.requests)
    stats = client.stats[server.url]
    assert (stats.retries, stats.server_errors, stats.failed_calls) == (2, 2, 0)


async def test_5xx_until_retries_run_out(server):
    server.script["/generate"] = [(500, {"error": "boom"})]
    client = EngineClient([server.url], max_retries=2, retry_backoff_s=0.001)
    try:
        with pytest.raises(EngineUnavailable) as info:
            await call_generate(client, server.url)
    finally:
        await client.close()
    assert len(server.requests) == 3
    assert server.url in str(info.value) and "/generate" in str(info.value)
    assert "HTTP 500" in str(info.value)


async def test_connection_refused_after_max_retries():
    url = f"http://127.0.0.1:{free_port()}"
    client = EngineClient([url], max_retries=2, retry_backoff_s=0.001)
    try:
        with pytest.raises(EngineUnavailable) as info:
            await call_generate(client, url)
    finally:
        await client.close()
    message = str(info.value)
    assert url in message and "/generate" in message and "3 attempts" in message
    stats = client.stats[url]
    assert (stats.connection_errors, stats.retries, stats.failed_calls) == (3, 2, 1)


async def test_backoff_doubles(server):
    server.script["/generate"] = [(503, "busy"), (503, "busy"), (503, "busy"), generate_reply()]
    client = EngineClient([server.url], max_retries=3, retry_backoff_s=0.05)
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        await call_generate(client, server.url)
        elapsed = loop.time() - start
    finally:
        await client.close()
    assert elapsed >= 0.05 + 0.1 + 0.2 - 0.01


async def test_400_is_not_retried(server):
    server.script["/generate"] = [(400, {"error": {"message": "prompt too long"}})]
    client = EngineClient([server.url], **FAST)
    try:
        with pytest.raises(EngineError) as info:
            await call_generate(client, server.url)
    finally:
        await client.close()
    assert not isinstance(info.value, (EngineUnavailable, EngineReplyError))
    assert "400" in str(info.value) and "prompt too long" in str(info.value)
    assert len(server.requests) == 1
    assert client.stats[server.url].retries == 0


async def test_timeout_aborts_rid_before_retry(server):
    """The first generate hangs like a long decode; the client must abort that rid on the engine
    and only then resend it, so the sample never runs twice at once."""
    aborted = asyncio.Event()
    running: list[str] = []  # rids the engine is generating right now

    async def slow_generate(body):
        running.append(body["rid"])
        try:
            await asyncio.wait_for(aborted.wait(), timeout=5)
        finally:
            running.remove(body["rid"])
        return generate_reply(rid=body["rid"], tokens=[11], finish="abort")

    async def fast_generate(body):
        assert body["rid"] not in running, "sample generated twice concurrently"
        return generate_reply(rid=body["rid"])

    async def abort(body):
        aborted.set()
        await asyncio.sleep(0)  # let the hung generate observe the abort
        return {"success": True}

    server.script["/generate"] = [slow_generate, fast_generate]
    server.script["/abort_request"] = [abort]
    client = EngineClient([server.url], timeout_s=0.2, max_retries=2, retry_backoff_s=0.001)
    try:
        result = await call_generate(client, server.url, rid="slow-1")
    finally:
        await client.close()
    assert result.output_ids.tolist() == [11, 12, 13] and result.finish_reason == "stop"
    assert server.paths() == ["/generate", "/abort_request", "/generate"]
    assert server.requests[1][1] == {"rid": "slow-1"}
    stats = client.stats[server.url]
    assert (stats.timeouts, stats.aborts_after_timeout, stats.retries) == (1, 1, 1)


async def test_timeouts_exhausted_raise_unavailable(server):
    async def hang(body):
        await asyncio.sleep(5)
        return generate_reply()

    server.script["/generate"] = [hang]
    server.script["/abort_request"] = [{"success": True}]
    client = EngineClient([server.url], timeout_s=0.1, max_retries=1, retry_backoff_s=0.001)
    try:
        with pytest.raises(EngineUnavailable, match="no reply within 0.1 s"):
            await call_generate(client, server.url, rid="h")
    finally:
        await client.close()
    # one abort between the two attempts; none after the last (the caller decides then)
    assert server.paths() == ["/generate", "/abort_request", "/generate"]


# ------------------------------------------------------------------------ control endpoints


async def test_abort_payloads(server):
    server.script["/abort_request"] = [{"success": True}]
    client = EngineClient([server.url], **FAST)
    try:
        await client.abort(server.url, rid="a1")
        await client.abort(server.url, abort_all=True)
        with pytest.raises(ValueError):
            await client.abort(server.url)
        with pytest.raises(ValueError):
            await client.abort(server.url, rid="a1", abort_all=True)
    finally:
        await client.close()
    assert server.requests == [
        ("/abort_request", {"rid": "a1"}), ("/abort_request", {"abort_all": True}),
    ]


async def test_abort_failure_raises(server):
    server.script["/abort_request"] = [(502, "bad gateway")]
    client = EngineClient([server.url], max_retries=1, retry_backoff_s=0.001)
    try:
        with pytest.raises(EngineUnavailable, match="/abort_request"):
            await client.abort(server.url, rid="x")
    finally:
        await client.close()
    assert len(server.requests) == 2


async def test_weight_version_falls_back_to_model_info_on_404(server):
    # Upstream SGLang moved the version to /model_info and answers the old path with 404.
    server.script["/get_weight_version"] = [(404, {"detail": "deprecated"})]
    server.script["/model_info"] = [{"model_path": "m", "weight_version": "5"}]
    client = EngineClient([server.url], **FAST)
    try:
        assert await client.weight_version(server.url) == 5
        assert server.paths() == ["/get_weight_version", "/model_info"]
        server.script["/get_weight_version"] = [(400, {"detail": "bad"})]
        with pytest.raises(EngineError, match="HTTP 400"):
            await client.weight_version(server.url)
    finally:
        await client.close()


async def test_weight_version(server):
    server.script["/get_weight_version"] = [{"weight_version": "12"}, {"weight_version": None}]
    client = EngineClient([server.url], **FAST)
    try:
        assert await client.weight_version(server.url) == 12
        with pytest.raises(EngineReplyError, match="no weight_version"):
            await client.weight_version(server.url)
    finally:
        await client.close()


async def test_a_version_offset_moves_every_version_the_engines_report(server):
    """After a restore the engines' versions are shifted into the job's numbering: the reply's
    version, each token's (per-token spans) and the engine's current version move together, and
    the engine's own number stays readable."""
    reply = generate_reply(tokens=[5, 6, 7], version="2")
    reply["meta_info"]["weight_versions"] = [{"version": "1", "start": 0, "end": 2},
                                             {"version": "2", "start": 2, "end": 3}]
    server.script["/generate"] = [reply]
    server.script["/get_weight_version"] = [{"weight_version": "2"}, {"weight_version": "2"}]
    client = EngineClient([server.url], version_offset=10, **FAST)
    try:
        result = await call_generate(client, server.url)
        assert result.weight_version == 12 and result.version_runs.plain() == [[11, 2], [12, 1]]
        assert await client.weight_version(server.url) == 12
        assert await client.engine_weight_version(server.url) == 2
    finally:
        await client.close()


async def test_loads_parsing(server, server2):
    server.script["/v1/loads"] = [{"loads": [{
        "num_running_reqs": 5, "num_waiting_reqs": 2, "num_used_tokens": 1000,
        "max_total_num_tokens": 4000, "num_retractions": 3,
    }]}]
    # two data-parallel ranks, optional keys missing (as real SGLang may omit them)
    server2.script["/v1/loads"] = [{"loads": [
        {"num_running_reqs": 1, "num_waiting_reqs": 0},
        {"num_running_reqs": 2, "num_waiting_reqs": 4, "token_usage": 0.5},
    ]}]
    client = EngineClient([server.url, server2.url], **FAST)
    try:
        loads = await client.loads()
    finally:
        await client.close()
    assert loads == [
        EngineLoad(server.url, num_running=5, num_waiting=2, used_tokens=1000,
                   capacity_tokens=4000, retractions=3),
        EngineLoad(server2.url, num_running=3, num_waiting=4, used_tokens=0,
                   capacity_tokens=0, retractions=0),
    ]


async def test_loads_with_one_engine_down(server):
    server.script["/v1/loads"] = [{"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}]}]
    down = f"http://127.0.0.1:{free_port()}"
    client = EngineClient([server.url, down], max_retries=1, retry_backoff_s=0.001)
    try:
        with pytest.raises(EngineUnavailable, match=down):
            await client.loads()
    finally:
        await client.close()


async def test_loads_malformed(server):
    server.script["/v1/loads"] = [{"queue": 3}]
    client = EngineClient([server.url], **FAST)
    try:
        with pytest.raises(EngineReplyError, match="no list of loads"):
            await client.loads()
    finally:
        await client.close()


# ------------------------------------------------------------------------------ from_router


@pytest.mark.parametrize(
    "shape",
    [
        lambda urls: {"urls": urls},
        lambda urls: {"workers": [{"url": u, "model_id": "m"} for u in urls]},
        lambda urls: [{"url": u} for u in urls],
    ],
    ids=["urls", "workers", "list_of_dicts"],
)
async def test_from_router(server, server2, shape):
    server.script["/workers"] = [shape([server2.url, server2.url + "/"])]
    server2.script["/get_weight_version"] = [{"weight_version": "4"}]
    client = await EngineClient.from_router(server.url, **FAST)
    try:
        assert client.engine_urls == [server2.url]  # one engine, listed twice
        assert await client.weight_version(client.engine_urls[0]) == 4
    finally:
        await client.close()
    assert client.max_retries == FAST["max_retries"]


async def test_from_router_without_engines_fails_at_the_deadline_saying_what_it_waited_for(server):
    server.script["/workers"] = [{"urls": []}]
    with pytest.raises(EngineError, match=r"lists no engines after \d+ s of waiting for at least one engine"):
        await EngineClient.from_router(server.url, wait=EngineWait(deadline_s=0.05, poll_s=0.01), **FAST)
    assert worker_reads(server) >= 2  # it waited: read again before the deadline


def worker_reads(server) -> int:
    return sum(path == "/workers" for path, _ in server.requests)


async def test_from_router_waits_for_the_engines_the_launcher_started(server, server2):
    """slime registers an engine with POST /workers; sglang-router answers 202 and lists it only after
    its health check. Here the router lists nothing, then one of the two engines, then both: the client
    must take the list only once it holds both."""
    other = "http://127.0.0.1:1"
    server.script["/workers"] = [{"urls": []}, {"urls": [server2.url]}, {"urls": [server2.url]},
                                 {"urls": [server2.url, other]}]
    client = await EngineClient.from_router(server.url, wait=EngineWait(expected=2, poll_s=0.01), **FAST)
    try:
        assert sorted(client.engine_urls) == sorted([server2.url, other])
        assert worker_reads(server) == 4
    finally:
        await client.close()


async def test_from_router_short_of_the_expected_engines_names_what_it_has(server, server2):
    server.script["/workers"] = [{"urls": [server2.url]}]
    with pytest.raises(EngineError, match=r"lists 1 engine\(s\) .* waiting for the 2 engine\(s\) the launcher started"):
        await EngineClient.from_router(server.url, wait=EngineWait(expected=2, deadline_s=0.05, poll_s=0.01), **FAST)


async def test_from_router_without_a_count_takes_the_first_list_that_holds_still(server, server2):
    other = "http://127.0.0.1:1"
    # a DP-aware router lists an engine once per rank: still one engine, and the same list
    server.script["/workers"] = [{"urls": [server2.url]}, {"urls": [server2.url, other]},
                                 {"urls": [server2.url, other + "@0", other + "@1"]}, {"urls": [server2.url, other]}]
    client = await EngineClient.from_router(server.url, wait=EngineWait(stable_reads=3, poll_s=0.01), **FAST)
    try:
        assert sorted(client.worker_urls) == sorted([server2.url, other])
        assert worker_reads(server) == 4
    finally:
        await client.close()


def test_engine_wait_refuses_nonsense():
    with pytest.raises(ValueError):
        EngineWait(expected=0)
    with pytest.raises(ValueError):
        EngineWait(poll_s=0)


async def test_from_router_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailable, match="/workers"):
        await EngineClient.from_router(url, max_retries=1, retry_backoff_s=0.001)


def test_constructor_rejects_bad_settings():
    with pytest.raises(EngineError):
        EngineClient([])
    with pytest.raises(ValueError):
        EngineClient(["http://x"], timeout_s=0)
    with pytest.raises(ValueError):
        EngineClient(["http://x"], max_retries=-1)


# ------------------------------------------------------------------------- custom transport


class InMemoryEngine:
    """A transport with no sockets: the client must work against anything with ``request``."""

    def __init__(self, fail_first: int = 0, hang: bool = False) -> None:
        self.calls: list[tuple[str, str, str, Any]] = []
        self.fail_first = fail_first
        self.hang = hang
        self.closed = False

    async def request(self, method, url, path, payload, timeout_s):
        self.calls.append((method, url, path, payload))
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionResetError("engine restarting")
        if path == "/generate":
            if self.hang:
                await asyncio.sleep(3600)  # never answers: the client's own deadline must fire
            n = min(2, payload["sampling_params"]["max_new_tokens"])
            return generate_reply(rid=payload["rid"], tokens=list(range(100, 100 + n)), version=1)
        if path == "/v1/loads":
            return {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}
        if path == "/abort_request":
            return {"success": True}
        raise TransportHTTPError(404, {"error": f"unknown path {path}"})

    async def close(self):
        self.closed = True


async def test_custom_transport():
    engine = InMemoryEngine(fail_first=1)
    client = EngineClient(["mem://e0"], transport=engine, **FAST)
    result = await client.generate(
        "mem://e0", [1, 2, 3, 4], max_new_tokens=1, rid="m1", sampling_params={}, sampling_seed=0
    )
    assert result.output_ids.tolist() == [100] and result.weight_version == 1
    assert [load.url for load in await client.loads()] == ["mem://e0"]
    with pytest.raises(EngineError, match="404"):
        await client.weight_version("mem://e0")
    await client.close()
    assert not engine.closed  # a transport passed in belongs to the caller
    assert client.stats["mem://e0"].connection_errors == 1


async def test_custom_transport_timeout_enforced_by_client():
    engine = InMemoryEngine(hang=True)
    client = EngineClient(["mem://e0"], transport=engine, timeout_s=0.05, max_retries=1,
                          retry_backoff_s=0.001)
    with pytest.raises(EngineUnavailable, match="no reply"):
        await client.generate(
            "mem://e0", [1, 2, 3, 4], max_new_tokens=4, rid="m2", sampling_params={},
            sampling_seed=0,
        )
    assert [c[2] for c in engine.calls] == ["/generate", "/abort_request", "/generate"]
    assert engine.calls[1][3] == {"rid": "m2"}


async def test_http_transport_error_body_and_close(server):
    server.script["/x"] = [(409, {"error": "conflict"})]
    transport = HttpTransport()
    try:
        with pytest.raises(TransportHTTPError) as info:
            await transport.request("POST", server.url, "/x", {"a": 1}, 5.0)
        assert info.value.status == 409 and info.value.body == {"error": "conflict"}
    finally:
        await transport.close()
    assert json.loads(json.dumps(server.requests[0][1])) == {"a": 1}


# ------------------------------------------------------------- replies as real SGLang sends them


def _parse(reply, **kw):
    return parse_generate_reply(reply, engine_url="http://e", rid=reply["meta_info"].get("id", "r0"),
                                max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


def test_float_noise_above_zero_is_a_logprob():
    result = _parse(generate_reply(tokens=[5, 6], logprobs=[3e-7, -0.5]))
    assert result.logprobs.tolist() == [3e-7, -0.5]


def test_weight_versions_spans_give_per_token_versions():
    """Weights changed during the call: the first two tokens came from version 3, the last one
    from 4; the reply's own weight_version is the newest."""
    reply = generate_reply(tokens=[5, 6, 7], version="4")
    reply["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 2},
                                             {"version": "4", "start": 2, "end": 3}]
    result = _parse(reply)
    assert result.weight_version == 4
    assert result.version_runs.plain() == [[3, 2], [4, 1]]
    # without spans (older SGLang) every token gets the reply's version
    assert _parse(generate_reply(tokens=[5, 6, 7], version="4")).version_runs.plain() == [[4, 3]]
    # an aborted reply with no tokens carries one empty span
    empty = generate_reply(tokens=[], finish="abort", version="4")
    empty["meta_info"]["weight_versions"] = [{"version": "4", "start": 0, "end": 0}]
    assert _parse(empty).version_runs.plain() == []


def test_request_aborted_while_queued_has_no_prompt_tokens():
    reply = generate_reply(tokens=[], finish="abort")
    del reply["meta_info"]["prompt_tokens"]
    result = _parse(reply)
    assert (result.finish_reason, result.output_ids.tolist(), result.prompt_tokens) == ("abort", [], None)
    # a reply with tokens still needs it
    reply = generate_reply(tokens=[5], finish="abort")
    del reply["meta_info"]["prompt_tokens"]
    with pytest.raises(EngineReplyError, match="prompt_tokens"):
        _parse(reply)


def test_output_token_outside_vocabulary_is_refused():
    with pytest.raises(EngineReplyError, match=r"token id 40 at position 1 is not an integer in \[0, 40\)"):
        _parse(generate_reply(tokens=[5, 40, 7]), vocab_size=40)
    assert _parse(generate_reply(tokens=[5, 39, 7]), vocab_size=40).output_ids.tolist() == [5, 39, 7]


@pytest.mark.parametrize("bad", [[1, 2, 50], [-1, 2, 3]])
async def test_input_ids_outside_vocabulary_are_never_sent(server, bad):
    server.script["/generate"] = [generate_reply()]
    client = EngineClient([server.url], vocab_size=50, **FAST)
    try:
        with pytest.raises(RequestRejected, match="input_ids") as info:
            await client.generate(server.url, bad, max_new_tokens=4, rid="r0", sampling_params={},
                                  sampling_seed=0)
    finally:
        await client.close()
    assert info.value.status is None
    assert server.requests == []


async def test_http_4xx_is_a_rejected_request(server):
    server.script["/generate"] = [(400, {"error": "bad input"})]
    client = EngineClient([server.url], **FAST)
    try:
        with pytest.raises(RequestRejected) as info:
            await call_generate(client, server.url)
    finally:
        await client.close()
    assert info.value.status == 400


async def test_abort_accepts_empty_body(server):
    server.script["/abort_request"] = [(200, "")]
    client = EngineClient([server.url], **FAST)
    try:
        await client.abort(server.url, rid="a1")
        await client.abort(server.url, abort_all=True)
    finally:
        await client.close()
    assert client.stats[server.url].reply_errors == 0 and len(server.requests) == 2


async def test_best_effort_abort_gives_up_fast(server):
    async def hang(body):
        await asyncio.sleep(5)
        return {}

    server.script["/abort_request"] = [hang]
    client = EngineClient([server.url], **FAST)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(EngineUnavailable, match="/abort_request"):
            await client.abort(server.url, rid="a1", timeout_s=0.1, max_retries=0)
    finally:
        await client.close()
    assert loop.time() - start < 1.0 and len(server.requests) == 1


async def test_probe(server):
    server.script["/generate"] = [generate_reply(rid="whatever")]
    client = EngineClient([server.url], **FAST)
    try:
        await client.probe(server.url, timeout_s=1.0)
        ((_, sent),) = server.requests
        assert sent["sampling_params"]["max_new_tokens"] == 1 and sent["rid"].startswith("april-probe-")

        async def hang(body):
            await asyncio.sleep(5)
            return generate_reply()

        server.script["/generate"] = [hang]
        with pytest.raises(EngineUnavailable, match="no reply within 0.1 s"):
            await client.probe(server.url, timeout_s=0.1)
        server.script["/generate"] = [(503, "down")]
        with pytest.raises(EngineUnavailable, match="HTTP 503"):
            await client.probe(server.url, timeout_s=1.0)
    finally:
        await client.close()


async def test_from_router_at_a_bare_engine_uses_it_alone(server, caplog):
    # a bare SGLang engine: no /workers (the scripted server answers 404), a weight version
    server.script["/model_info"] = [{"weight_version": "2"}]
    client = await EngineClient.from_router(server.url, **FAST)
    try:
        assert client.engine_urls == [server.url]
    finally:
        await client.close()
    assert "a router URL is expected" in caplog.text


async def test_from_router_at_something_else_says_a_router_is_expected(server):
    with pytest.raises(EngineError, match="a router URL is expected"):
        await EngineClient.from_router(server.url, **FAST)


async def test_retractions_from_replies_when_loads_lack_them(server):
    """SGLang 0.5.23 reports retractions per request only (meta_info.num_retractions)."""
    reply = generate_reply()
    reply["meta_info"]["num_retractions"] = 2
    server.script["/generate"] = [reply]
    server.script["/v1/loads"] = [{"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}]}]
    client = EngineClient([server.url], **FAST)
    try:
        assert (await client.loads())[0].retractions == 0
        await call_generate(client, server.url)
        await call_generate(client, server.url)
        assert (await client.loads())[0].retractions == 4
        # an engine that does report them (the emulator) is taken at its word
        server.script["/v1/loads"] = [{"loads": [{"num_running_reqs": 1, "num_retractions": 9}]}]
        assert (await client.loads())[0].retractions == 9
    finally:
        await client.close()


async def test_a_call_meeting_a_connection_the_server_closed_goes_again_at_once():
    """A server that answers a connection's first request with keep-alive, then closes it when the
    next request arrives on it, without answering (what uvicorn's idle timeout does to a call
    racing it): the call is sent again at once on a fresh connection, not failed."""
    from april_slime.core.transport import HttpTransport

    served: list[int] = []  # the index, on its connection, of every request answered

    async def handle(reader, writer):
        count = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if count:  # a reused connection: dropped without a word
                writer.close()
                return
            served.append(count)
            count += 1
            body = b'{"ok": true}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    transport = HttpTransport()
    try:
        for _ in range(3):  # each call after the first meets the closing connection first
            assert await transport.request("POST", url, "/generate", {"a": 1}, 5.0) == {"ok": True}
        assert served == [0, 0, 0]
    finally:
        await transport.close()
        srv.close()
        await srv.wait_closed()
