"""The engines' HTTP/1.1 client (``core/http_client.py``): framing, keep-alive, failures, and the
objects a request in flight holds. Replies are fed to a connection byte by byte and at every
split, and exchanged with raw asyncio servers on loopback that send exactly the bytes a test
scripts."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest

from april_slime.core.engine import EngineClient
from april_slime.core.http_client import ConnectionPool, ReplyDropped, _Connection, _SocketTransport
from april_slime.core.transport import KEEPALIVE_S, HttpTransport

JSON_OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok": [1]}'
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nServer: x\r\n\r\n"
           b"4;name=v\r\n{\"ok\r\n7\r\n\": [1]}\r\n0\r\nTrailer: t\r\n\r\n")
UNTIL_CLOSE = b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"ok": [1]}'
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n" + JSON_OK


class _Wire:
    """What a connection writes, and whether it closed (a stand-in for its socket)."""

    def __init__(self) -> None:
        self.written = b""
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


async def _feed(pieces: list[bytes], *, then_close: bool = False):
    """A connection sent one request and given ``pieces`` of its reply: the future's outcome."""
    lost: list[_Connection] = []
    connection = _Connection(lost.append, ("http", "e", 80))
    wire = _Wire()
    connection.connection_made(wire)
    loop = asyncio.get_running_loop()
    waiter = connection.send(b"GET / HTTP/1.1\r\n\r\n", loop.time() + 60, 60)
    for piece in pieces:
        if waiter.done():
            break
        connection.data_received(piece)
    if then_close and not waiter.done():
        connection.connection_lost(None)
    connection.done(failed=not waiter.done() or waiter.exception() is not None)
    if not waiter.done():
        return "pending", wire
    if waiter.exception() is not None:
        return waiter.exception(), wire
    status, body, keep_alive = waiter.result()
    return (status, bytes(body), keep_alive), wire


@pytest.mark.parametrize(("reply", "closes", "expected"), [
    (JSON_OK, False, (200, b'{"ok": [1]}', True)),
    (CHUNKED, False, (200, b'{"ok": [1]}', True)),
    (UNTIL_CLOSE, True, (200, b'{"ok": [1]}', False)),
    (INTERIM, False, (200, b'{"ok": [1]}', True)),
    (b"HTTP/1.1 204 No Content\r\n\r\n", False, (204, b"", True)),
    (b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 4\r\n\r\nbusy", False, (503, b"busy", False)),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}", False, (200, b"{}", True)),
], ids=["length", "chunked", "until-close", "interim-100", "no-content", "connection-close", "http10-keep-alive"])
async def test_a_reply_reads_the_same_however_its_bytes_arrive(reply, closes, expected):
    splits = [[reply], [reply[i:i + 1] for i in range(len(reply))]]
    splits += [[reply[:i], reply[i:]] for i in range(1, len(reply))]
    for pieces in splits:
        outcome, _ = await _feed(pieces, then_close=closes)
        assert outcome == expected, pieces


@pytest.mark.parametrize(("reply", "named"), [
    (b"HTTP/2 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "CRLF"),
    (JSON_OK + b"HTTP/1.1 200 OK\r\n", "beyond the reply"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 * 1024), "over 65536 bytes"),
])
async def test_a_malformed_reply_fails_its_call_by_name_and_closes_the_connection(reply, named):
    for pieces in ([reply], [reply[i:i + 7] for i in range(0, len(reply), 7)]):
        outcome, wire = await _feed(pieces)
        assert isinstance(outcome, ConnectionError) and not isinstance(outcome, ReplyDropped), outcome
        assert "malformed HTTP reply" in str(outcome) and named in str(outcome)
        assert wire.closing


async def test_a_connection_lost_mid_reply_says_it_was_answered():
    outcome, _ = await _feed([JSON_OK[:30]], then_close=True)
    assert isinstance(outcome, ReplyDropped) and outcome.answered and "mid-reply" in str(outcome)
    outcome, _ = await _feed([], then_close=True)
    assert isinstance(outcome, ReplyDropped) and not outcome.answered and "before replying" in str(outcome)


async def test_bytes_that_come_after_the_call_was_given_up_close_the_connection():
    connection = _Connection(lambda c: None, ("http", "e", 80))
    wire = _Wire()
    connection.connection_made(wire)
    loop = asyncio.get_running_loop()
    waiter = connection.send(b"GET / HTTP/1.1\r\n\r\n", loop.time() + 60, 60)
    waiter.cancel()
    connection.done(failed=True)
    assert wire.closing
    connection.data_received(JSON_OK)  # the late reply
    assert wire.closing and waiter.cancelled()


# ------------------------------------------------------------------ against loopback servers
async def _until(condition, limit_s: float = 60.0) -> None:
    """Wait for ``condition`` (an event another coroutine brings about); fail after ``limit_s``."""
    async with asyncio.timeout(limit_s):
        while not condition():
            await asyncio.sleep(0.01)


class RawServer:
    """A loopback server answering each request with the next scripted action: bytes to send,
    ``("close", bytes)`` (send them, then close), ``"hang"`` (read the request, never answer), or
    ``"drop"`` (read it, close without a word)."""

    def __init__(self, actions: list) -> None:
        self.actions = list(actions)
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self.url = ""
        self._server: asyncio.AbstractServer | None = None
        self.arrived = asyncio.Event()

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                self.arrived.set()
                action = self.actions.pop(0) if len(self.actions) > 1 else self.actions[0]
                if action == "hang":
                    if await reader.read() == b"":
                        self.closed_by_client += 1
                    return
                if action == "drop":
                    return
                writer.write(action[1] if isinstance(action, tuple) else action)
                await writer.drain()
                if isinstance(action, tuple):
                    return
        except (asyncio.CancelledError, ConnectionError):
            pass  # the test is over, or the client hung up
        finally:
            writer.close()


async def test_a_connection_is_reused_within_its_keepalive_and_never_after():
    now = [0.0]
    pool = ConnectionPool(KEEPALIVE_S, clock=lambda: now[0])
    assert KEEPALIVE_S < 5.0  # SGLang's server drops an idle connection after 5 s
    async with RawServer([JSON_OK]) as server:
        for _ in range(3):
            assert await pool.request("POST", server.url, "/generate", b"{}", 10.0) == (200, bytearray(b'{"ok": [1]}'))
            now[0] += KEEPALIVE_S - 0.1
        assert (server.connections, pool.opened) == (1, 1)
        now[0] += 0.2  # idle past its keep-alive: closed by the client, a new one made
        await pool.request("GET", server.url, "/v1/loads", None, 10.0)
        assert (server.connections, pool.opened) == (2, 2)
        await _until(lambda: server.closed_by_client == 1)
        pool.close()
    assert server.requests[0].startswith(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 2\r\n\r\n{}" in server.requests[0]
    assert server.requests[3].startswith(b"GET /v1/loads HTTP/1.1\r\n") and b"Content-Length" not in server.requests[3]


async def test_a_reply_that_closes_its_connection_is_not_reused():
    pool = ConnectionPool(KEEPALIVE_S)
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    async with RawServer([close, close, JSON_OK]) as server:
        for _ in range(3):
            await pool.request("POST", server.url, "/x", b"{}", 10.0)
        assert server.connections == 3
        pool.close()


async def test_a_call_dropped_mid_reply_on_a_reused_connection_is_not_sent_again():
    # a reply that began was read by the engine: sending it again could run the request twice
    pool = ConnectionPool(KEEPALIVE_S)
    async with RawServer([JSON_OK, ("close", JSON_OK[:40])]) as server:
        await pool.request("POST", server.url, "/x", b"{}", 10.0)
        with pytest.raises(ReplyDropped, match="mid-reply"):
            await pool.request("POST", server.url, "/x", b"{}", 10.0)
        assert len(server.requests) == 2 and server.connections == 1
        pool.close()


async def test_a_call_that_times_out_closes_its_connection_and_the_next_opens_a_fresh_one():
    transport = HttpTransport()
    async with RawServer(["hang", JSON_OK]) as server:
        with pytest.raises(TimeoutError, match="no reply within 0.2 s"):
            async with asyncio.timeout(60):  # a transport that never timed out fails here, not hangs
                await transport.request("POST", server.url, "/generate", {"a": 1}, 0.2)
        assert await transport.request("POST", server.url, "/generate", {"a": 1}, 10.0) == {"ok": [1]}
        assert server.connections == 2
        await _until(lambda: server.closed_by_client == 1)  # the hung request's connection
        await transport.close()


async def test_a_cancelled_call_closes_its_connection():
    pool = ConnectionPool(KEEPALIVE_S)
    async with RawServer(["hang", JSON_OK]) as server:
        call = asyncio.create_task(pool.request("POST", server.url, "/x", b"{}", 60.0))
        await server.arrived.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await _until(lambda: server.closed_by_client == 1)
        assert pool.open_connections() == 0
        assert await pool.request("POST", server.url, "/x", b"{}", 10.0) == (200, bytearray(b'{"ok": [1]}'))
        pool.close()


async def test_an_engine_that_is_down_fails_the_call_once_as_a_connection_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = ConnectionPool(KEEPALIVE_S)
    with pytest.raises(OSError):
        await pool.request("POST", f"http://127.0.0.1:{port}", "/x", b"{}", 10.0)
    assert pool.opened == 0


@pytest.mark.parametrize("url", ["ftp://e:1", "e:1", "http://"])
async def test_a_url_it_cannot_serve_is_named(url):
    with pytest.raises(ValueError, match="only http:// and https://"):
        await ConnectionPool(KEEPALIVE_S).request("GET", url, "/x", None, 1.0)


class _FullBacklog:
    """A listening socket that never accepts, with room for one queued connection: once that one
    is taken, every further connect stays pending (the kernel drops its SYN)."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


async def _objects_per_pending_connect(pool: ConnectionPool, url: str, calls: int) -> float:
    first = asyncio.create_task(pool.request("GET", url, "/x", None, 60.0))  # takes the queue's one place
    await _until(lambda: pool.opened == 1)
    gc.collect()
    before = len(gc.get_objects())
    tasks = [asyncio.create_task(pool.request("GET", url, "/x", None, 60.0)) for _ in range(calls)]
    for _ in range(3):
        await asyncio.sleep(0)  # each call has sent its SYN and waits on the selector
    gc.collect()
    per_connect = (len(gc.get_objects()) - before) / calls
    assert pool.opened == 1  # the connects are pending, not done
    for task in (first, *tasks):
        task.cancel()
    await asyncio.gather(first, *tasks, return_exceptions=True)
    return per_connect


async def test_a_pending_connect_holds_a_handful_of_objects_and_leaves_nothing_when_cancelled():
    """Each step of a job opens its connections anew, thousands at once, and they wait for the
    engines to accept. asyncio's own connect path held about 45 tracked objects per connect
    meanwhile (each promoted to the oldest generation by the time it connected)."""
    pool = ConnectionPool(KEEPALIVE_S)
    selector = asyncio.get_running_loop()._selector
    registered = len(selector.get_map())
    with _FullBacklog() as url:
        per_connect = await _objects_per_pending_connect(pool, url, 64)
        assert per_connect <= 24, per_connect  # the call's task and coroutines, its socket, its waiter
        await asyncio.sleep(0)
        assert pool.open_connections() == 0
        assert len(selector.get_map()) == registered  # a cancelled connect took its socket off the loop


async def test_a_connect_the_engine_does_not_accept_fails_at_the_calls_deadline():
    pool = ConnectionPool(KEEPALIVE_S)
    with _FullBacklog() as url:
        first = asyncio.create_task(pool.request("GET", url, "/x", None, 60.0))
        await _until(lambda: pool.opened == 1)
        with pytest.raises(TimeoutError, match="no connection within the call's deadline"):
            async with asyncio.timeout(60):  # a connect that never timed out fails here, not hangs
                await pool.request("GET", url, "/x", None, 0.2)
        assert pool.opened == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_a_request_larger_than_the_sockets_buffers_is_sent_whole():
    body = b"[" + b"1," * (16 * 1024 * 1024) + b"1]"  # 32 MiB: more than the socket takes at once
    pool = ConnectionPool(KEEPALIVE_S)
    async with RawServer([JSON_OK]) as server:
        assert await pool.request("POST", server.url, "/generate", body, 60.0) == (200, bytearray(b'{"ok": [1]}'))
        assert server.requests[0].endswith(body)
        assert await pool.request("POST", server.url, "/generate", b"{}", 60.0) == (200, bytearray(b'{"ok": [1]}'))
        assert (server.connections, len(server.requests)) == (1, 2)  # the same connection, reused after
        pool.close()


async def test_a_request_the_socket_refuses_fails_its_call_with_the_reason_and_leaves_the_loop():
    loop = asyncio.get_running_loop()
    selector = loop._selector
    registered = len(selector.get_map())
    ours, engines = socket.socketpair()
    ours.setblocking(False)
    lost: list[_Connection] = []
    connection = _Connection(lost.append, ("http", "engine", 0))
    _SocketTransport(loop, ours, connection)
    engines.close()  # the engine went away before the request goes out: the send itself fails
    waiter = connection.send(b"GET / HTTP/1.1\r\n\r\n", loop.time() + 60, 60)
    with pytest.raises(ReplyDropped, match="before replying: .*Broken pipe") as caught:
        await waiter
    connection.done(failed=True)
    assert not caught.value.answered and lost == [connection] and connection.closed
    assert len(selector.get_map()) == registered  # neither a reader nor a writer is left behind


async def test_a_url_with_a_path_prefix_keeps_it():
    pool = ConnectionPool(KEEPALIVE_S)
    async with RawServer([JSON_OK]) as server:
        await pool.request("GET", server.url + "/engine/0/", "/v1/loads", None, 10.0)
        assert server.requests[0].startswith(b"GET /engine/0/v1/loads HTTP/1.1\r\n")
        pool.close()


async def _objects_per_call_in_flight(start_call, calls: int, transport: HttpTransport, server: RawServer) -> float:
    """Tracked objects added per call while ``calls`` calls (``start_call(i)``) wait on ``server``,
    with the connections already pooled (a running job reuses them)."""
    server.actions = [JSON_OK]
    await asyncio.gather(*(transport.request("POST", server.url, "/g", {"i": i}, 60.0) for i in range(calls)))
    assert transport.pool.open_connections() == calls
    server.actions = ["hang"]
    server.requests.clear()
    gc.collect()
    before = len(gc.get_objects())
    tasks = [asyncio.create_task(start_call(i)) for i in range(calls)]
    await _until(lambda: len(server.requests) == calls)
    gc.collect()
    per_call = (len(gc.get_objects()) - before) / calls
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert server.connections == calls  # every call in flight went out on a pooled connection
    return per_call


async def test_a_request_in_flight_holds_a_handful_of_tracked_objects():
    """What keeps full collections short with thousands of generate calls in flight: each call's
    objects live as long as the engine generates, and every full collection walks them. With the
    connections pooled, a request in flight holds its coroutines, its reply's future and its
    deadline's timer (aiohttp held about 70)."""
    calls = 64
    transport = HttpTransport()
    async with RawServer([JSON_OK]) as server:
        per_request = await _objects_per_call_in_flight(
            lambda i: transport.request("POST", server.url, "/g", {"i": i}, 60.0), calls, transport, server)
        await transport.close()
    assert per_request <= 5, per_request
    # through the engine client (its retry loop keeps no timer of its own over this transport)
    transport = HttpTransport()
    client = EngineClient(["http://e"], transport=transport)
    async with RawServer([JSON_OK]) as server:
        per_generate = await _objects_per_call_in_flight(
            lambda i: client.generate(server.url, [1, 2, 3], max_new_tokens=8, rid=f"r{i}", sampling_params={},
                                      sampling_seed=i), calls, transport, server)
        await transport.close()
    assert per_generate <= 10, per_generate  # the task, its context and weakref, the client's frames, the request's
