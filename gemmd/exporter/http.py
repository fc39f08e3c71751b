"""The HTTP side of the exporter: /metrics (gzip when asked), health endpoints, the runbook
the alerts link (/runbook), a landing page; optional TLS and basic auth from a Prometheus
exporter-toolkit web configuration file.

Anyone who can reach the port can talk to this server, so it is built to keep answering
Prometheus whatever other clients do:

- One asyncio event loop (a daemon thread) owns every socket. A connection costs a file
  descriptor and a small object while it waits for its request, never a thread; it gets
  ``read_timeout`` seconds in all for the TLS handshake and the request head, and
  ``write_timeout`` for the response. Every response closes its connection.
- At most ``max_connections`` connections are open (default: half the free file
  descriptors, at most 512). Beyond that the connection that has waited longest without
  sending a complete request is closed: a scrape, whose request arrives at once, is never
  the one dropped. Responses are made by a small thread pool; scrapes that arrive together
  share one render of the metrics (the exposition's cache), so Prometheus HA pairs,
  dashboards and a hundred scrapes at once are all served. At most ``max_inflight``
  (256) requests are being answered (made or written) at a time, any more get 503 at
  once: what bounds them is the memory of bodies written to slow readers.
- Requests are parsed by h11 (a kept, sans-IO HTTP/1.1 parser: Host required once in
  HTTP/1.1, strict Content-Length and line endings, ...); the request line is checked as
  soon as it arrives. Malformed requests get 400 (431, 413, 414, 501, 505 where those say
  more) and are closed; out of file descriptors, the accept loop pauses a second and says
  so once in the log instead of spinning.
- Basic auth: credentials verified once are answered from a cache (no bcrypt, no slot);
  the others wait for one bcrypt thread, where wrong passwords are limited per client
  address (429) and in the CPU they get, and logged once a minute (``_AuthGate``).
- ``/-/healthy`` and ``/-/ready`` are answered on the event loop without rendering metrics
  and without authentication (so that Kubernetes and Docker probes, which cannot easily send
  credentials, work; they disclose nothing but "up" and "ready"). ``/runbook`` (and
  ``/runbook.md``) neither: an operator opens it from an alert's runbook_url in a browser,
  and it is gemmd's own documentation, the same on every host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import h11

from gemmd.config import WebConfig
from gemmd.exporter.access import _TLS, BasicAuth, _AuthGate
from gemmd.exporter.app import (
    _STATUS,
    _TOKEN_START,
    HEALTH_PATHS,
    RUNBOOK_PATHS,
    _BadRequest,
    _canned,
    _check_request_line,
    _run_wsgi,
    _target,
    app,
)
from gemmd.exporter.exposition import Exposition

logger = logging.getLogger("gemmd.exporter.http")
READ_TIMEOUT_S = 10.0  # TLS handshake + request head, in all
WRITE_TIMEOUT_S = 30.0  # the response (MBs uncompressed for 8 GPUs) to a slow reader
BACKLOG = 128
ACCEPT_RETRY_S = 1.0  # out of file descriptors: accept() again after this
WORKERS = 4
# Requests being answered at once (made by the workers or being written); more get 503.
# Scrapes that arrive together share one render of the state (Exposition's lock), so what
# one more costs is its live gauges and, while a slow reader takes it, its body's memory
# (1.7 MB uncompressed, 120 KB gzip for 8 GPUs x 100 probes): 256 serves Prometheus HA
# pairs, dashboards and storms of a hundred scrapes at once within ~450 MB at worst.
MAX_INFLIGHT = 256
MAX_HEAD = 16 << 10  # request line + headers
MAX_HEADERS = 100
MAX_BODY = 64 << 10  # a body is read (and ignored) so that closing does not reset the answer


class _Connection(asyncio.Protocol):
    """One client connection: (TLS handshake,) one request parsed by h11, one response,
    close. gemmd keeps the connection management: timeouts, limits, the answers to bad
    requests."""

    def __init__(self, server: _Server, sock: socket.socket):
        self.srv = server
        self.loop = server.loop
        self.sock = sock  # until the transport exists, aborting means shutting this down
        self.transport: Any = None
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.started = False  # a byte other than the empty lines before a request came
        self.first = bytearray()  # the request line until its LF has arrived
        self.line_checked = False
        self.received = 0  # bytes of the head so far (empty lines before it included)
        # (method, path, query, version, headers) once the request head is read
        self.head: tuple[str, str, str, str, dict[str, str]] | None = None
        self.body = 0  # bytes of body read (and ignored)
        self.done = False  # the whole request is in: what follows is ignored
        self.timer: asyncio.TimerHandle | None = None
        self.job: asyncio.Future | None = None
        self.counted = False  # holds an in-flight slot
        self.closed = False
        self.tls = False

    # -- life cycle
    async def attach(self, ctx: ssl.SSLContext | None) -> None:
        """Give the accepted socket to asyncio (with the TLS handshake, if any); the read
        timer started at accept() covers the handshake."""
        try:
            await self.loop.connect_accepted_socket(
                lambda: self, self.sock, ssl=ctx,
                ssl_handshake_timeout=self.srv.read_timeout if ctx else None)
        except (OSError, ssl.SSLError, EOFError, asyncio.TimeoutError, ConnectionError,
                RuntimeError, ValueError) as e:
            logger.debug("http: %s from %s failed: %s", "TLS handshake" if ctx else "setup",
                         self.peer(), e)
            self.sock.close()  # the transport's socket: closing twice is harmless
            self.connection_lost(None)

    def connection_made(self, transport) -> None:
        self.transport = transport
        tls = self.srv.tls
        self.tls = tls is not None
        if self.closed:  # timed out or evicted while the handshake finished
            transport.abort()
        elif tls is not None and not tls.sans_allowed(transport.get_extra_info("peercert")):
            logger.info("http: client certificate of %s has none of client_allowed_sans",
                        self.peer())
            transport.abort()

    def connection_lost(self, exc) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.srv.closed(self)
        if self.counted and (self.job is None or self.job.done()):
            self.srv.release(self)

    def eof_received(self) -> bool:
        # A half-close after a complete request still gets its answer, one in the middle
        # of a request a 400 (not over TLS: a TLS transport cannot write after EOF).
        if self.tls:
            return False
        if not self.done and self.received:
            self.done = True
            self.srv.waiting.pop(self, None)
            self.reply(_canned(_STATUS[400], self.srv.extra))
        return self.done  # False: closed at once (nothing was asked)

    def timed_out(self) -> None:
        if self.closed:
            return
        if not self.done and self.received and self.transport is not None:
            self.reply(_canned("408 Request Timeout", self.srv.extra))
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            return
        try:  # mid-handshake: the handshake fails at once and asyncio closes the socket
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def peer(self) -> str:
        try:
            p = self.sock.getpeername()
        except OSError:
            return "?"
        return f"{p[0]}:{p[1]}"

    def address(self) -> str:
        """The client's address, the unit of rate limits."""
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if peer else "?"

    # -- reading the request
    def data_received(self, data: bytes) -> None:
        if self.done:
            return  # after the request: ignored (the connection closes after the answer)
        try:
            self.parse(data)
        except (_BadRequest, h11.RemoteProtocolError) as e:
            status = e.status if isinstance(e, _BadRequest) else \
                _STATUS.get(e.error_status_hint, _STATUS[400])
            logger.debug("http: %s from %s: %s", status, self.peer(), e)
            self.done = True
            self.srv.waiting.pop(self, None)
            self.reply(_canned(status, self.srv.extra))

    def parse(self, data: bytes) -> None:
        if not self.started:  # empty lines before the request line are allowed (RFC 9112 2.2)
            self.received += len(data)
            data = data.lstrip(b"\r\n")
            if not data:
                if self.received > MAX_HEAD:
                    raise _BadRequest(_STATUS[400], "only empty lines")
                return
            self.started = True
            if not _TOKEN_START.match(data):  # TLS to the plain port, a binary protocol
                raise _BadRequest(_STATUS[400], "not an HTTP request")
        else:
            self.received += len(data)
        if not self.line_checked:
            self.first += data[:MAX_HEAD + 1 - len(self.first)]
            eol = self.first.find(b"\n")
            if eol < 0:
                if len(self.first) > MAX_HEAD:
                    raise _BadRequest(_STATUS[414])
            else:
                if eol > MAX_HEAD:
                    raise _BadRequest(_STATUS[414])
                _check_request_line(bytes(self.first[:eol]))  # garbage is answered at once
                self.line_checked = True
                self.first.clear()
        self.parser.receive_data(data)
        while not self.done:
            event = self.parser.next_event()
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.Request):
                self.request(event)
            elif isinstance(event, h11.Data):
                self.body += len(event.data)
                if self.body > MAX_BODY:
                    raise _BadRequest(_STATUS[413])
            elif isinstance(event, h11.EndOfMessage):
                self.done = True
                self.srv.dispatch(self)
            else:  # ConnectionClosed, PAUSED: nothing more to read
                return

    def request(self, req: h11.Request) -> None:
        # h11 bounds only a head that arrives in pieces; one that came whole is bounded here
        if self.received - len(self.parser.trailing_data[0]) > MAX_HEAD:
            raise _BadRequest(_STATUS[431])
        if not req.http_version.startswith(b"1."):  # h11 takes any d.d
            raise _BadRequest(_STATUS[505])
        if len(req.headers) > MAX_HEADERS:
            raise _BadRequest(_STATUS[431])
        headers: dict[str, str] = {}
        for name, value in req.headers:
            key, v = name.decode("ascii"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {v}" if key in headers else v
        if "transfer-encoding" in headers:
            raise _BadRequest(_STATUS[501], "Transfer-Encoding is not supported")
        length = headers.get("content-length", "0")  # h11: digits, one value
        if len(length) > 18 or int(length) > MAX_BODY:
            raise _BadRequest(_STATUS[413])
        path, query = _target(req.target)
        self.head = (req.method.decode("ascii"), path, query,
                     "HTTP/" + req.http_version.decode("ascii"), headers)

    # -- answering
    def environ(self) -> dict:
        assert self.head is not None  # dispatch() comes after the head was read
        method, path, query, version, headers = self.head
        peer = self.transport.get_extra_info("peername") or ("", 0)
        env = {"REQUEST_METHOD": method, "SCRIPT_NAME": "", "PATH_INFO": path,
               "QUERY_STRING": query, "SERVER_PROTOCOL": version,
               "SERVER_NAME": self.srv.server_address[0],
               "SERVER_PORT": str(self.srv.server_port), "REMOTE_ADDR": str(peer[0]),
               "REMOTE_PORT": str(peer[1]), "HTTPS": "on" if self.tls else "off",
               "CONTENT_LENGTH": headers.get("content-length", ""),
               "CONTENT_TYPE": headers.get("content-type", "")}
        for k, v in headers.items():
            if k not in ("content-length", "content-type"):
                env["HTTP_" + k.upper().replace("-", "_")] = v
        return env

    def rendered(self, job: asyncio.Future) -> None:
        if self.closed or job.cancelled():
            if self.counted:
                self.srv.release(self)
            return
        try:
            data = job.result()
        except Exception as e:  # noqa: BLE001 - the gateway answers 500 itself; this is a bug
            logger.error("http: rendering failed: %s", e)
            data = _canned("500 Internal Server Error", self.srv.extra)
        self.reply(data)

    def reply(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self.timer is not None:
            self.timer.cancel()
        self.transport.write(data)
        self.transport.close()  # after the buffer is written
        self.timer = self.loop.call_later(self.srv.write_timeout, self.abort)


class _Server:
    """The listening socket and its event loop thread; ``shutdown()``, ``server_close()``,
    ``server_port`` and ``server_address`` as socketserver's servers have them."""

    def __init__(self, wsgi: Callable, sock: socket.socket, *, tls: _TLS | None,
                 extra: list[tuple[str, str]], read_timeout: float, write_timeout: float,
                 max_connections: int, max_inflight: int, workers: int,
                 auth: BasicAuth | None = None):
        self.wsgi, self.socket, self.tls, self.extra = wsgi, sock, tls, extra
        self.scheme = "https" if tls is not None else "http"  # what is served, for the log
        self.server_address = sock.getsockname()
        self.server_port = self.server_address[1]
        self.read_timeout, self.write_timeout = read_timeout, write_timeout
        self.max_connections, self.max_inflight = max_connections, max_inflight
        self.conns: dict[_Connection, None] = {}
        self.waiting: dict[_Connection, None] = {}  # no complete request yet, oldest first
        self.inflight = 0  # requests handed to the worker threads, until written
        self.tasks: set[asyncio.Future] = set()  # handshakes and renders under way
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "gemmd-http")
        self._noted: dict[str, float] = {}
        self._accept_failing = False
        self._stopped = False
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self.gate = _AuthGate(auth, self.loop) if auth is not None else None
        self.loop.add_reader(sock.fileno(), self._accept)
        self._thread = threading.Thread(target=self.loop.run_forever, name="gemmd-http",
                                        daemon=True)
        self._thread.start()

    # -- accepting (event loop thread)
    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors (or memory): stop accepting for a second instead
                    # of spinning on a listening socket that stays readable.
                    self.loop.remove_reader(self.socket.fileno())
                    self.loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                    if not self._accept_failing:
                        self._accept_failing = True
                        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                        self.note("emfile", "http: cannot accept connections: %s (open-file "
                                  "limit %d, %d connections open); retrying every second", e,
                                  soft, len(self.conns))
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client is gone (or a firewall said no); next one
                self.note("accept", "http: accept() failed: %s", e)
                return
            if self._accept_failing:
                self._accept_failing = False
                self.note("emfile-over", "http: accepting connections again")
            sock.setblocking(False)
            conn = _Connection(self, sock)
            if self.opened(conn):
                ctx = self.tls.context() if self.tls is not None else None
                self.track(self.loop.create_task(conn.attach(ctx)))

    def _resume_accepting(self) -> None:
        if not self._stopped and self.socket.fileno() >= 0:
            self.loop.add_reader(self.socket.fileno(), self._accept)

    # -- bookkeeping (event loop thread)
    def opened(self, conn: _Connection) -> bool:
        """Register a new connection; False if it was turned away at once."""
        self.conns[conn] = None
        self.waiting[conn] = None
        conn.timer = self.loop.call_later(self.read_timeout, conn.timed_out)
        if len(self.conns) > self.max_connections:
            oldest = next(iter(self.waiting))  # conn itself at worst
            self.note("full", "http: %d connections open (the limit): closing the ones "
                      "waiting longest for a request", len(self.conns))
            if oldest is conn:  # every other one is being answered
                if self.tls is None:
                    try:
                        conn.sock.send(_canned("503 Service Unavailable",
                                               [("Retry-After", "1"), *self.extra]))
                    except OSError:
                        pass
                conn.sock.close()
                conn.connection_lost(None)
                return False
            oldest.abort()
            oldest.connection_lost(None)  # free the slot now, not on the next turn
        return True

    def closed(self, conn: _Connection) -> None:
        self.conns.pop(conn, None)
        self.waiting.pop(conn, None)

    def release(self, conn: _Connection) -> None:
        if conn.counted:
            conn.counted = False
            self.inflight -= 1

    # -- answering (event loop thread)
    def dispatch(self, conn: _Connection) -> None:
        """A whole request is in: answer it. Health endpoints, other methods and refused
        credentials are answered here; the rest by the worker threads (``render``).
        Credentials the cache cannot answer wait for the auth gate's bcrypt thread, never
        for a worker or an in-flight slot."""
        self.waiting.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
        # Reading goes on (what follows the request is discarded): a paused TLS transport
        # would never see the client's close_notify and linger until write_timeout.
        env = conn.environ()
        path = env["PATH_INFO"]
        if path in HEALTH_PATHS or env["REQUEST_METHOD"] not in ("GET", "HEAD"):
            conn.reply(_run_wsgi(self.wsgi, env))  # cheap: answered here, never queued
            return
        if self.gate is not None and path not in RUNBOOK_PATHS:
            header = env.get("HTTP_AUTHORIZATION")
            verdict = self.gate.auth.cached(header)
            if verdict is None:
                self._verify(conn, env, header)
                return
            if not verdict:
                if header:
                    self.gate.refused(conn.address())
                env["gemmd.auth"] = "refused"
                conn.reply(_run_wsgi(self.wsgi, env))
                return
            env["gemmd.auth"] = "ok"
        self.render(conn, env)

    def _verify(self, conn: _Connection, env: dict, header: str | None) -> None:
        assert self.gate is not None
        addr = conn.address()

        def done(ok: bool | None) -> None:
            if conn.closed:
                return
            if ok is None:
                self.note("auth-busy", "http: too many basic-auth checks waiting: answering "
                          "503")
                conn.reply(_canned("503 Service Unavailable",
                                   [("Retry-After", "1"), *self.extra]))
                return
            env["gemmd.auth"] = "ok" if ok else "refused"
            if ok:
                self.render(conn, env)
            else:
                conn.reply(_run_wsgi(self.wsgi, env))

        refusal = self.gate.submit(addr, header, done)
        if refusal is not None:
            retry = self.gate.retry_after(addr) if refusal.startswith("429") else 1
            conn.reply(_canned(refusal, [("Retry-After", str(retry)), *self.extra]))

    def render(self, conn: _Connection, env: dict) -> None:
        """Hand the request to a worker thread; 503 at once while ``max_inflight``
        responses are being made or written."""
        if self.inflight >= self.max_inflight:
            self.note("busy", "http: %d requests in flight (the limit): answering 503",
                      self.inflight)
            conn.reply(_canned("503 Service Unavailable", [("Retry-After", "1"), *self.extra]))
            return
        self.inflight += 1
        conn.counted = True
        conn.job = self.loop.run_in_executor(self.pool, _run_wsgi, self.wsgi, env)
        conn.job.add_done_callback(conn.rendered)
        self.track(conn.job)

    def track(self, task: asyncio.Future) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def note(self, what: str, msg: str, *args: Any) -> None:
        """A warning at most once a minute per kind: an attack must not flood the log."""
        now = time.monotonic()
        if now - self._noted.get(what, -1e9) >= 60:
            self._noted[what] = now
            logger.warning(msg, *args)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        self.note("loop", "http: %s: %s", context.get("message"), context.get("exception"))

    # -- stopping (any thread)
    async def _stop(self) -> None:
        self.loop.remove_reader(self.socket.fileno())
        if self.gate is not None:
            self.gate.stop()
        for conn in list(self.conns):
            conn.abort()
            conn.connection_lost(None)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.sleep(0)  # let the cancellations and connection_lost calls run
        await asyncio.sleep(0)

    def shutdown(self) -> None:
        """Stop serving: stop accepting, close every connection, end the loop thread."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        """Close the listening socket (after ``shutdown()``, which it calls if needed)."""
        self.shutdown()
        self.socket.close()
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


MAX_CONNECTIONS = 512  # open client connections at most (the systemd unit's LimitNOFILE
# leaves twice that free)


def _max_connections() -> int:
    """Half the file descriptors still free (at most MAX_CONNECTIONS, at least 16): idle
    clients are turned away before accept() runs out of descriptors for the daemon and for
    scrapes."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    return max(16, min(MAX_CONNECTIONS, (soft - in_use) // 2))


def serve(exposition: Exposition, address: str, port: int, *,
          web_config: WebConfig | None = None, ready: Callable[[], bool] | None = None,
          read_timeout: float = READ_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S,
          max_connections: int | None = None, max_inflight: int = MAX_INFLIGHT,
          workers: int = WORKERS) -> _Server:
    """Serve /metrics on a background thread (IPv6 addresses work too), over TLS and with
    basic auth if ``web_config`` says so. ``ready()`` decides /-/ready's answer. Raises
    OSError if the address cannot be bound, ssl.SSLError/OSError if the TLS files cannot
    be loaded. The result has ``shutdown()``, ``server_close()`` and ``server_port``."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        tls = _TLS(web_config.tls) if web_config is not None and web_config.tls else None
        auth = BasicAuth(web_config.users) if web_config is not None and web_config.users \
            else None
        return _Server(app(exposition, ready=ready, web_config=web_config, auth=auth), sock,
                       tls=tls, extra=list(web_config.headers) if web_config is not None
                       else [], read_timeout=read_timeout, write_timeout=write_timeout,
                       max_connections=max_connections or _max_connections(),
                       max_inflight=max_inflight, workers=workers, auth=auth)
    except BaseException:
        sock.close()
        raise
