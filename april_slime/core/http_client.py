"""A keep-alive HTTP/1.1 client for the engines' JSON calls, on asyncio's event loop.

Why not a general client (aiohttp): a generate call is in flight for as long as its engine
generates, so everything the client holds for it meanwhile outlives the young collections and is
walked by every full collection. aiohttp holds about 70 tracked objects per request in flight; at
thousands of requests in flight those, not the plugin's data, are what the full collections walk.
Here a request in flight holds its reply's future and the coroutine awaiting it; the rest lives in
its connection, which is pooled and outlives the call.

A plain-TCP connection is a non-blocking socket watched by the loop (``_SocketTransport``) rather
than ``loop.create_connection``'s transport: every step of a job opens its N' connections anew (the
engines drop idle ones during the training phase), thousands at once, and a call waiting for
asyncio's connect held about 45 tracked objects, against about 20 here; each was promoted to the
oldest generation by the time it connected, and so set off full collections. HTTPS origins keep
asyncio's own transport.

What it speaks: one request at a time per connection (no pipelining), bodies framed by
``Content-Length``, chunked replies, replies read until close, ``Connection: close`` and HTTP/1.0
replies honoured, ``1xx`` interim replies skipped. What it refuses by name: a malformed status
line, header or chunk, a reply head over 64 KiB, bytes the server sends beyond its reply.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import os
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
_NO_CONTEXT = contextvars.Context()  # where a deadline's callback runs (it reads no context variable)


_READ_BYTES = 256 * 1024  # what asyncio's socket transport reads at a time


class ReplyDropped(ConnectionError):
    """The connection closed before the reply was complete; ``answered`` when some of it arrived
    (the server read the request), else the request may never have been read."""

    def __init__(self, message: str, *, answered: bool):
        super().__init__(message)
        self.answered = answered


class _Malformed(Exception):
    pass


class _Reply:
    """The incremental parse of one reply: head, then body by its framing."""

    __slots__ = ("status", "keep_alive", "length", "chunked", "body", "chunk_left", "trailer")

    def __init__(self) -> None:
        self.status = 0
        self.keep_alive = True
        self.length: int | None = None  # Content-Length; None: chunked or read until close
        self.chunked = False
        self.body = bytearray()
        self.chunk_left = -1  # bytes left of the current chunk (+2 for its CRLF); -1: a size line is due
        self.trailer = False  # the last chunk was read; trailer lines until an empty one


def _parse_head(head: bytes, reply: _Reply) -> None:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise _Malformed(f"status line {lines[0][:80]!r}")
    reply.status = int(parts[1])
    http10 = parts[0] == b"HTTP/1.0"
    connection = b""
    encoding = b""
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise _Malformed(f"header line {line[:80]!r}")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (reply.length is not None and reply.length != int(value)):
                raise _Malformed(f"Content-Length {value[:40]!r}")
            reply.length = int(value)
        elif name == b"transfer-encoding":
            encoding = value.lower()
        elif name == b"connection":
            connection = value.lower()
    tokens = {t.strip() for t in connection.split(b",")}
    reply.keep_alive = b"keep-alive" in tokens if http10 else b"close" not in tokens
    if encoding:
        if encoding.rsplit(b",", 1)[-1].strip() != b"chunked":
            raise _Malformed(f"Transfer-Encoding {encoding[:40]!r}")
        reply.chunked, reply.length = True, None
    if reply.status in (204, 304):
        reply.length, reply.chunked = 0, False
    if reply.length is None and not reply.chunked:
        reply.keep_alive = False  # the body runs until the server closes


class _SocketTransport:
    """The part of an asyncio transport a ``_Connection`` uses, on a connected non-blocking socket:
    the socket is read whenever the selector says so and written directly, the rest of a write
    kept until the socket takes it. As with asyncio's transports, ``connection_lost`` is called
    from the loop, never from inside a ``write`` or ``close``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: _Connection) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._unsent: memoryview | None = None  # what the socket has not taken yet
        self._closing = False
        protocol.connection_made(self)
        loop.add_reader(self._fd, self._read_ready)

    def write(self, data: bytes) -> None:
        if self._closing:
            return
        if self._unsent is not None:  # a reply came before its request was all sent: this follows the rest
            self._unsent = memoryview(bytes(self._unsent) + data)
            return
        sent = self._send(data)
        if sent is not None and sent < len(data):
            self._unsent = memoryview(data)[sent:]  # a view: no copy of a large request per partial send
            self._loop.add_writer(self._fd, self._write_ready)

    def _write_ready(self) -> None:
        sent = self._send(self._unsent)
        if sent is None:
            return
        self._unsent = self._unsent[sent:]
        if not self._unsent:
            self._unsent = None
            self._loop.remove_writer(self._fd)

    def _send(self, data: bytes | memoryview) -> int | None:
        """What the socket took of ``data`` now (0 when its buffer is full); None when the
        connection was lost instead."""
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self._lose(exc)
            return None

    def _read_ready(self) -> None:
        try:
            data = self._sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        if data:
            self._protocol.data_received(data)
        else:  # the server closed its side: a reply read until close ends here, any other is cut
            self._lose(None)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._lose(None)

    def _lose(self, exc: BaseException | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if self._unsent is not None:
            self._loop.remove_writer(self._fd)
            self._unsent = None
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, exc)


def _settle_once(future: asyncio.Future, error: type[BaseException] | None) -> None:
    """A pending connect's end: the socket became writable, or (``error``) its deadline passed."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error("no connection within the call's deadline"))


async def _connect_socket(loop: asyncio.AbstractEventLoop, addresses: list[tuple], deadline: float) -> socket.socket:
    """A connected non-blocking TCP socket to the first of ``addresses`` (``getaddrinfo`` rows)
    that accepts; ``TimeoutError`` at the loop time ``deadline``. A pending connect (the usual
    case, on loopback too) waits on the selector with one future and one timer."""
    errors: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
            code = sock.connect_ex(address)
            if code in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):  # TCP's usual answer, loopback's too
                writable = loop.create_future()
                loop.add_writer(sock.fileno(), _settle_once, writable, None)
                timer = loop.call_at(deadline, _settle_once, writable, TimeoutError, context=_NO_CONTEXT)
                try:
                    await writable
                finally:
                    timer.cancel()
                    loop.remove_writer(sock.fileno())
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, f"connect to {address[0]} port {address[1]}: {os.strerror(code)}")
            return sock
        except OSError as exc:
            sock.close()
            errors.append(exc)
        except BaseException:
            sock.close()
            raise
    if len(errors) == 1:
        raise errors[0]
    raise ConnectionError(f"no address accepted a connection: {'; '.join(map(str, errors))}")


class _Connection(asyncio.Protocol):
    """One connection to one engine, carrying one request at a time. It tells its pool when it
    closes (``on_lost``), so a pool never keeps a dead connection."""

    def __init__(self, on_lost: Callable[[_Connection], None], key: tuple) -> None:
        self.key = key
        self.transport: _SocketTransport | asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._on_lost = on_lost
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._time_out_callback = self._time_out  # bound once: a call's timer adds only itself
        self._timeout_s = 0.0
        self._reply: _Reply | None = None
        self._buffer = bytearray()
        self._answered = False

    # --------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            # bytes nobody asked for (a reply after its request was given up, or a second reply)
            self.close()
            return
        self._answered = True
        self._buffer += data
        try:
            self._advance()
        except _Malformed as exc:
            self.close()
            waiter.set_exception(ConnectionError(f"engine sent a malformed HTTP reply: {exc}"))

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost settles the reply

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._on_lost(self)
        waiter, reply = self._waiter, self._reply
        if waiter is None or waiter.done():
            return
        if reply is not None and reply.length is None and not reply.chunked:
            reply.body += self._buffer  # a reply read until close is complete now
            self._settle(reply)
            return
        why = f": {exc}" if exc else ""
        waiter.set_exception(ReplyDropped(
            "server closed the connection " + ("mid-reply" if self._answered else "before replying") + why,
            answered=self._answered))

    # --------------------------------------------------------------- the call
    def send(self, request: bytes, deadline: float, timeout_s: float) -> asyncio.Future:
        """Write ``request``; the future resolves to its reply (status, body, keep-alive) or fails
        with ``ReplyDropped``, ``ConnectionError`` or ``TimeoutError`` at the loop time
        ``deadline``, the end of the call's ``timeout_s`` (which its error names). ``done()`` must
        follow, however the wait ends."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._reply, self._answered = None, False
        # one timer and no closure per call: the deadline is the connection's own state, and the
        # callback needs no context variables (a context of its own would be copied per call)
        self._timeout_s = timeout_s  # the call's own, not what its connect left of it
        self._timer = loop.call_at(deadline, self._time_out_callback, context=_NO_CONTEXT)
        self.transport.write(request)
        return waiter

    def done(self, failed: bool) -> None:
        """The call's wait ended. A connection whose call failed or was given up (its reply may
        still come) is closed, never reused."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._waiter = None
        if failed:
            self.close()

    def _time_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError(f"no reply within {self._timeout_s:g} s"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # --------------------------------------------------------------- parsing
    def _advance(self) -> None:
        buffer = self._buffer
        while self._reply is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise _Malformed(f"reply head over {MAX_HEAD_BYTES} bytes")
                return
            if end > MAX_HEAD_BYTES:
                raise _Malformed(f"reply head over {MAX_HEAD_BYTES} bytes")
            reply = _Reply()
            _parse_head(bytes(buffer[:end]), reply)
            del buffer[:end + 4]
            if 100 <= reply.status < 200:
                continue  # an interim reply (100 Continue): the real one follows
            self._reply = reply
        reply = self._reply
        if reply.chunked:
            self._advance_chunks(reply)
        elif reply.length is not None and len(buffer) >= reply.length:
            if len(buffer) > reply.length:
                raise _Malformed(f"{len(buffer) - reply.length} bytes beyond the reply's Content-Length")
            reply.body, self._buffer = buffer, bytearray()  # handed over, not copied
            self._settle(reply)

    def _advance_chunks(self, reply: _Reply) -> None:
        buffer = self._buffer
        while True:
            if reply.chunk_left < 0 or reply.trailer:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise _Malformed("chunk size line over 64 KiB")
                    return
                line = bytes(buffer[:end])
                del buffer[:end + 2]
                if reply.trailer:
                    if not line:
                        if buffer:
                            raise _Malformed(f"{len(buffer)} bytes beyond the chunked reply")
                        self._settle(reply)
                        return
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or size.strip(b"0123456789abcdefABCDEF"):
                    raise _Malformed(f"chunk size {line[:40]!r}")
                left = int(size, 16)
                if left == 0:
                    reply.trailer = True
                    continue
                reply.chunk_left = left + 2
            take = min(reply.chunk_left - 2, len(buffer)) if reply.chunk_left > 2 else 0
            if take:
                reply.body += buffer[:take]
                del buffer[:take]
                reply.chunk_left -= take
            if reply.chunk_left > 2:
                return
            if len(buffer) < 2:
                return
            if buffer[:2] != b"\r\n":
                raise _Malformed("a chunk does not end with CRLF")
            del buffer[:2]
            reply.chunk_left = -1

    def _settle(self, reply: _Reply) -> None:
        self._waiter.set_result((reply.status, reply.body, reply.keep_alive and not self.closed))


class _Origin:
    """Where a base URL's requests go, parsed once per URL."""

    __slots__ = ("key", "host", "port", "ssl", "prefix", "host_header", "addresses")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {url!r}: only http:// and https:// URLs with a host are served")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.key = (parts.scheme, self.host, self.port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"Host: {host}:{self.port}\r\n".encode()
        self.addresses: list[tuple] | None = None  # getaddrinfo's rows, resolved at the first connect


class ConnectionPool:
    """Keep-alive connections by origin, reused most recently used first; an idle connection is
    dropped after ``keepalive_s`` (before the server drops it: see transport.KEEPALIVE_S)."""

    def __init__(self, keepalive_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.keepalive_s = keepalive_s
        self._clock = clock
        self._origins: dict[str, _Origin] = {}
        # per origin, idle connections in the order they became idle (a dict: O(1) removal)
        self._idle: dict[tuple, dict[_Connection, None]] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections made, for tests and diagnostics

    async def request(self, method: str, url: str, path: str, body: bytes | None,
                      timeout_s: float) -> tuple[int, bytearray]:
        """One request on a pooled connection: (status, body), or ``TimeoutError`` after
        ``timeout_s``. A pooled connection that the server closed before reading the request (its
        idle timeout racing the call) is replaced at once by a fresh one; any other failure is
        raised (``ConnectionError`` / ``OSError``)."""
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        head = f"{method} {origin.prefix}{path} HTTP/1.1\r\n".encode() + origin.host_header
        if body is None:
            request = head + b"Accept: */*\r\n\r\n"
        else:
            request = b"".join((head, b"Content-Type: application/json\r\nAccept: */*\r\nContent-Length: ",
                                str(len(body)).encode(), b"\r\n\r\n", body))
        while True:
            connection = self._take_idle(origin.key)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin, deadline)
            failed = True
            try:
                status, reply, keep_alive = await connection.send(request, deadline, timeout_s)
                failed = False
            except ReplyDropped as exc:
                if reused and not exc.answered:
                    continue  # never read: a stale pooled connection
                raise
            finally:
                connection.done(failed)
            if keep_alive and not connection.closed:
                connection.idle_since = self._clock()
                self._idle.setdefault(origin.key, {})[connection] = None
            else:
                connection.close()
            return status, reply

    def _take_idle(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_kept = self._clock() - self.keepalive_s
        while idle:  # the oldest first: drop those past their keep-alive
            oldest = next(iter(idle))
            if oldest.idle_since >= oldest_kept:
                break
            del idle[oldest]
            oldest.close()
        while idle:  # the most recently used, unless the server's close of it is under way
            connection = idle.popitem()[0]
            if not connection.transport.is_closing():
                return connection
        return None

    async def _connect(self, origin: _Origin, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        key = origin.key
        if origin.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_connection(lambda: _Connection(self._lost, key), origin.host,
                                                             origin.port, ssl=self._ssl)
        else:
            if origin.addresses is None:
                async with asyncio.timeout_at(deadline):
                    origin.addresses = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
            try:
                sock = await _connect_socket(loop, origin.addresses, deadline)
            except OSError:
                origin.addresses = None  # resolved again at the next connect: the engine may have moved
                raise
            connection = _Connection(self._lost, key)
            _SocketTransport(loop, sock, connection)
        self.opened += 1
        self._open.add(connection)
        return connection

    def _lost(self, connection: _Connection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle is not None:
            idle.pop(connection, None)

    def open_connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        """Close every connection; requests in flight on them fail with ``ReplyDropped``."""
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
