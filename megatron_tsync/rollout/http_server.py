"""The HTTP/1.1 transport of the OpenAI-compatible endpoint (``rollout/openai_server.py``): asyncio + ``h11`` (the
HTTP state machine httpx and uvicorn use), one event-loop thread for every connection and a fixed pool of worker
threads for the application, so idle or slow clients cost a file descriptor and a coroutine, never a thread.

What it guarantees (each a field of :class:`HttpLimits`):

- ``backlog``: the listen queue (clamped by the kernel's ``somaxconn``), so bursts of connects queue, not reset;
- ``max_connections``: open connections (slots); one beyond it still gets an answer (``503`` with ``Retry-After``,
  then the connection is closed; it has 1 s to send its head), never a silent drop. The process' open-file limit is
  raised to fit it when allowed;
- ``max_connections_per_peer``: slots one client address holds at once (an IPv6 client: its /64); one more from it is
  answered ``429`` + ``Retry-After`` at once and closed, without waiting for its request or taking a slot, so one
  client re-opening connections cannot keep the others at ``503``. Default: half of ``max_connections``;
- ``max_inflight``: requests handed to the application at once (the worker threads); more get ``503`` +
  ``Retry-After``;
- ``header_timeout_s``: a request head (request line + headers) must be complete this long after the connection
  opened or answered its previous request; half-sent heads get ``408`` and idle keep-alive connections are closed, so
  slow or idle clients free their slot. ``body_timeout_s``: the same for the body, after the head;
- ``max_body_bytes``: a larger ``Content-Length`` (or chunked body) is answered ``413`` before the body is read;
- ``max_header_bytes``: a larger request head is ``431``; a head that is not HTTP/1.1 is ``400`` (``h11`` decides);
- ``write_timeout_s``: an answer the client does not take (a client that pipelines requests and never reads) must be
  written within this long, else the connection is aborted and its slot freed.

``check_head(method, path, headers)`` (the application's, e.g. the API key) runs on each request head before its
body is read (before ``100 Continue``): a refusal is answered and the connection closed without reading the body, so
an unauthenticated client cannot hold a slot with a slow body.

Every error answer is an OpenAI-style JSON body (``{"error": {"message", "type", "param", "code"}}``). A connection
that is closed with request bytes still unread is drained first (a "lingering close", at most 2 s), so the client
reads the answer instead of a TCP reset; a closing connection no longer holds a slot, and at most
``max_connections + 1024`` linger at once (beyond that they are closed at once). The application sees the client's
address key (:func:`peer_key`) as the ``:peer`` header (a name no HTTP/1.1 client can send).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import ipaddress
import json
import resource
import socket
import threading
from collections.abc import Callable

import h11

__all__ = ["HttpLimits", "HttpServer", "PEER_HEADER", "error_body", "peer_key"]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            408: "Request Timeout", 409: "Conflict", 410: "Gone", 413: "Content Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "invalid_request_error", 409: "conflict_error", 410: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error", 503: "server_busy"}
PEER_HEADER = ":peer"
"""The header under which the application gets the client's address key (see :func:`peer_key`)."""
_LINGER_S = 2.0
_EXTRA_CLOSING = 1024
"""Connections that may be closing (answered, lingering) at once beyond ``max_connections``."""

App = Callable[[str, str, dict, bytes], tuple]
"""``app(method, path, headers, body) -> (status, json_body, extra_headers)``; runs on a worker thread."""
CheckHead = Callable[[str, str, dict], "tuple | None"]
"""``check_head(method, path, headers) -> None | (status, json_body, extra_headers)``: a refusal of the request from
its head alone, answered without reading the body; runs on the event-loop thread, so it must be cheap."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """The transport's limits (see the module docstring)."""

    backlog: int = 4096
    max_connections: int = 2048
    max_inflight: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    retry_after_s: int = 1
    max_connections_per_peer: int | None = None
    """None: half of ``max_connections`` (at least 1)."""
    write_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("backlog", "max_connections", "max_inflight", "max_body_bytes", "max_header_bytes",
                     "retry_after_s", "max_connections_per_peer"):
            value = getattr(self, name)
            if (value is not None or name != "max_connections_per_peer") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"HttpLimits.{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0 seconds, got {getattr(self, name)!r}")


    @property
    def peer_cap(self) -> int:
        """Slots one client address may hold (``max_connections_per_peer``, at most ``max_connections``)."""
        cap = self.max_connections_per_peer or max(1, self.max_connections // 2)
        return min(cap, self.max_connections)


class _Refuse(Exception):
    """Answer this error and close the connection."""

    def __init__(self, status: int, message: str, headers: dict | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})
        self.body = body or error_body(status, message)


def peer_key(peername) -> str:
    """The key a client's connections are counted under: its IPv4 address, an IPv6 client's /64 (one host usually
    has a whole /64), an IPv4-mapped IPv6 address as IPv4."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername or "")
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _raise_nofile(want: int) -> int:
    """Raise the soft open-file limit towards ``want`` (up to the hard limit); the soft limit now in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class HttpServer:
    """Serves ``app`` on ``host:port`` (port 0: a free one). The socket is bound and listening on construction;
    :meth:`start` runs the event loop on a daemon thread, :meth:`close` stops it. ``check_head``: see the module
    docstring."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0, limits: HttpLimits | None = None,
                 check_head: CheckHead | None = None):
        self.app, self.check_head, self.limits = app, check_head, limits or HttpLimits()
        fd_room = _raise_nofile(2 * self.limits.max_connections + _EXTRA_CLOSING + 256)  # slots + closing ones
        if fd_room != resource.RLIM_INFINITY and (fd_room - 128) // 2 < self.limits.max_connections:
            self.limits = dataclasses.replace(self.limits, max_connections=max(1, (fd_room - 128) // 2))
        self.max_closing = self.limits.max_connections + _EXTRA_CLOSING
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(self.limits.backlog)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.stats = {"connections": 0, "requests": 0, "busy_503": 0, "timeouts_408": 0, "too_large_413": 0,
                      "bad_400": 0, "peer_429": 0, "head_refused": 0, "write_timeouts": 0}
        self.open_connections = 0
        """Connections holding a slot (being served); closing ones are counted in ``closing``."""
        self.closing = 0
        self.peers: dict[str, int] = {}
        """Slots held per client address key (:func:`peer_key`)."""
        self.inflight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.max_inflight, thread_name_prefix="chat-http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HttpServer":
        self._thread = threading.Thread(target=self._run, name="chat-http-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._spawn, sock=self.sock, backlog=self.limits.backlog, limit=1 << 16))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            self._loop.close()

    def close(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = None
        else:
            self.sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one connection
    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._connection(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        peer = peer_key(writer.get_extra_info("peername"))
        if self.open_connections >= self.limits.max_connections:
            await self._unslotted(writer, self._over_cap(reader, writer))
            return
        if self.peers.get(peer, 0) >= self.limits.peer_cap:  # answered at once: no slot, no wait for the request
            self.stats["peer_429"] += 1
            await self._unslotted(writer, self._refuse(writer, reader, _Refuse(
                429, f"too many connections from your address ({self.limits.peer_cap} open, "
                     f"max_connections_per_peer); close one or retry", self._retry())))
            return
        self.open_connections += 1
        self.peers[peer] = self.peers.get(peer, 0) + 1
        refusal = None
        try:
            refusal = await self._serve(conn_peer=peer, reader=reader, writer=writer)
        except (ConnectionError, OSError, h11.LocalProtocolError):
            pass
        finally:
            self._release(peer)
            if refusal is None:
                writer.close()
        if refusal is not None:  # the lingering close holds no slot
            await self._unslotted(writer, self._refuse(writer, reader, refusal))

    def _release(self, peer: str) -> None:
        self.open_connections -= 1
        left = self.peers[peer] - 1
        if left:
            self.peers[peer] = left
        else:
            del self.peers[peer]

    async def _unslotted(self, writer: asyncio.StreamWriter, answer) -> None:
        """Run ``answer`` (a refusal and its lingering close) outside the slots; at most ``max_closing`` at once,
        beyond that the connection is closed at once."""
        if self.closing >= self.max_closing:
            answer.close()
            writer.transport.abort()
            return
        self.closing += 1
        try:
            await answer
        except (ConnectionError, OSError):
            pass
        finally:
            self.closing -= 1
            writer.close()

    async def _serve(self, conn_peer: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> _Refuse | None:
        """Serve requests until the connection ends; the refusal to answer (and close with) if one ends it."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        while True:
            try:
                request = await self._read_head(conn, reader)
                if request is None:  # closed or idle keep-alive timed out before a new request began
                    return None
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
                headers[PEER_HEADER] = conn_peer
                self._check_head(request, headers)
                body = await self._read_body(conn, reader, writer, request)
            except _Refuse as e:
                return e
            await self._answer(conn, writer, request, headers, body)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return None
            conn.start_next_cycle()

    async def _over_cap(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """503 to a connection beyond ``max_connections``, after its request head (1 s at most)."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        refusal = _Refuse(503, f"too many open connections (max_connections {self.limits.max_connections}); retry",
                          self._retry())
        try:
            await self._read_head(conn, reader, min(1.0, self.limits.header_timeout_s))
        except _Refuse:
            pass
        await self._refuse(writer, reader, refusal)

    def _check_head(self, request: h11.Request, headers: dict) -> None:
        if self.check_head is None:
            return
        out = self.check_head(request.method.decode("latin-1"), request.target.decode("latin-1"), headers)
        if out is not None:
            self.stats["head_refused"] += 1
            status, body, extra = out
            raise _Refuse(status, body.get("error", {}).get("message", ""), extra, body)

    def _retry(self) -> dict:
        return {"Retry-After": str(self.limits.retry_after_s)}

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        """Wait until the answer is written; one the client does not take within ``write_timeout_s`` aborts the
        connection (a client that pipelines requests and never reads frees its slot)."""
        if not writer.transport.get_write_buffer_size():  # all handed to the kernel: nothing to wait for
            return
        try:
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
        except TimeoutError:
            self.stats["write_timeouts"] += 1
            writer.transport.abort()
            raise ConnectionAbortedError(f"the answer was not taken within {self.limits.write_timeout_s} s") from None

    async def _receive(self, conn: h11.Connection, reader: asyncio.StreamReader, deadline: float):
        """The next h11 event, reading from the socket until ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint if e.error_status_hint in _REASONS else 400
                raise _Refuse(status, f"malformed HTTP request: {e}") from None
            if event is not h11.NEED_DATA:
                return event
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(reader.read(1 << 16), left)
            except TimeoutError:
                return None
            conn.receive_data(data)  # b"" is the peer's end of stream

    async def _read_head(self, conn: h11.Connection, reader: asyncio.StreamReader,
                         timeout_s: float | None = None) -> h11.Request | None:
        timeout_s = self.limits.header_timeout_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        event = await self._receive(conn, reader, deadline)
        if event is None:
            if conn.trailing_data[0] or conn.their_state is not h11.IDLE:
                self.stats["timeouts_408"] += 1
                raise _Refuse(408, f"the request head was not complete within {timeout_s} s")
            return None
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise _Refuse(400, f"expected a request, got {type(event).__name__}")
        size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if size > self.limits.max_header_bytes:  # h11 bounds only a head still incomplete
            raise _Refuse(431, f"the request head is {size} bytes; this server takes at most "
                               f"{self.limits.max_header_bytes}")
        return event

    async def _read_body(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         request: h11.Request) -> bytes:
        cap = self.limits.max_body_bytes
        length = dict(request.headers).get(b"content-length")
        if length is not None and int(length) > cap:  # h11 validated the number
            self.stats["too_large_413"] += 1
            raise _Refuse(413, f"the request body is {int(length)} bytes; this server takes at most {cap}")
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            event = await self._receive(conn, reader, deadline)
            if event is None:
                self.stats["timeouts_408"] += 1
                raise _Refuse(408, f"the request body was not complete within {self.limits.body_timeout_s} s")
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > cap:
                    self.stats["too_large_413"] += 1
                    raise _Refuse(413, f"the request body exceeds {cap} bytes")
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:  # ConnectionClosed mid-body
                raise ConnectionResetError("the client closed the connection mid-body")

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request,
                      headers: dict, body: bytes) -> None:
        self.stats["requests"] += 1
        if self.inflight >= self.limits.max_inflight:
            self.stats["busy_503"] += 1
            status, out, extra = 503, error_body(503, f"the server is busy ({self.limits.max_inflight} requests in "
                                                      f"flight); retry", code="server_busy"), self._retry()
        else:
            self.inflight += 1
            try:
                status, out, extra = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self.app, request.method.decode("latin-1"), request.target.decode("latin-1"),
                    headers, body)
            except Exception as e:  # the application is meant to answer every request itself
                status, out, extra = 500, error_body(500, f"internal error: {type(e).__name__}: {e}"), {}
            finally:
                self.inflight -= 1
        data = json.dumps(out).encode()
        hdrs = [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra.items()]
        writer.write(conn.send(h11.Response(status_code=status, headers=hdrs, reason=_REASONS.get(status, ""))))
        if request.method != b"HEAD":  # h11 frames a HEAD answer without a body
            writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await self._drain(writer)

    async def _refuse(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, e: _Refuse) -> None:
        """Answer ``e`` with ``Connection: close``, then drain what the client still sends (bounded) and close."""
        if e.status == 400:
            self.stats["bad_400"] += 1
        if e.status == 503:
            self.stats["busy_503"] += 1
        data = json.dumps(e.body).encode()
        head = [f"HTTP/1.1 {e.status} {_REASONS.get(e.status, '')}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in e.headers.items())]
        writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + data)
        try:
            await self._drain(writer)
            writer.write_eof()
            loop = asyncio.get_running_loop()
            deadline, drained = loop.time() + _LINGER_S, 0
            while drained < (256 << 20) and (left := deadline - loop.time()) > 0:
                chunk = await asyncio.wait_for(reader.read(1 << 20), left)
                if not chunk:
                    break
                drained += len(chunk)
        except (TimeoutError, ConnectionError, OSError):
            pass
