"""The agent's HTTP endpoints: /metrics (Prometheus text format, or protobuf with native histograms for
a scraper that prefers it), /healthz, /api/v1/snapshot (JSON).

Built for a hostile network (the agent runs on the host network of every node):
- one poller thread holds every open connection; a connection costs a thread only while a request
  on it is being read or answered, by one of a few workers. Idle and keep-alive connections cost a
  file descriptor, and at most `max_connections` of them are kept (the longest idle is closed first),
  so a flood of idle clients never keeps /healthz or a scrape waiting;
- each request must arrive and be answered within `request_timeout`; idle connections are closed
  after `idle_timeout`;
- a listen backlog of 1024, so a burst of scrapes does not overflow the agent's own listen queue;
- TLS and basic auth from a `--web.config.file` (exporters/webconfig.py);
- /api/v1/snapshot (process names, pids, containers, flows) answers loopback clients only, unless
  the config says `snapshot_api = "network"` or basic auth is on (docs/config.md).
"""

from __future__ import annotations

import contextlib
import errno
import io
import ipaddress
import json
import logging
import queue
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Any

from aiprobe import __version__
from aiprobe.names import endpoint
from aiprobe.supervisor import SUPERVISOR
from prometheus_client import CONTENT_TYPE_LATEST

from . import protobuf
from .webconfig import WebConfig

log = logging.getLogger("aiprobe.http")

BACKLOG = 1024
WORKERS = 4
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
MAX_HEAD_BYTES = 64 << 10
PUBLIC_PATHS = ("/healthz",)  # open without basic auth: kubelet probes carry no credentials
SNAPSHOT_PATH = "/api/v1/snapshot"
PROTOBUF_MEDIA = ("application/vnd.google.protobuf", "io.prometheus.client.MetricFamily", "delimited")


def default_max_connections() -> int:
    """A quarter of the file descriptors this process may open, at most 1024: the probes, the
    CUDA scan and netlink need the rest."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(1024, soft // 4))


def listen_socket(address: tuple[str, int]) -> socket.socket:
    """A listening TCP socket: IPv6 when the host is (`[::]:9645` takes IPv4 clients too)."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    dualstack = family == socket.AF_INET6 and ipaddress.ip_address(host).is_unspecified
    return socket.create_server((host, port), family=family, backlog=BACKLOG, dualstack_ipv6=dualstack)


def wants_protobuf(accept: str) -> bool:
    """Whether an Accept header prefers delimited MetricFamily protobuf to everything else it names
    (its highest q, the first of equals): Prometheus asks so with native histograms on, text after it."""
    ranges = []
    for position, media_range in enumerate(accept.split(",")):
        media, *parameters = (part.strip() for part in media_range.split(";"))
        values = {key.lower(): value for key, _, value in (parameter.partition("=") for parameter in parameters)}
        try:
            quality = float(values.pop("q", "1"))
        except ValueError:
            quality = 0.0
        ranges.append((quality, -position, (media.lower(), values.get("proto"), values.get("encoding"))))
    quality, _, preferred = max(ranges)
    return quality > 0 and preferred == PROTOBUF_MEDIA


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class _Connection:
    """One client, kept across keep-alive requests: its socket, the bytes of a request head still
    arriving, and its handler once a request came."""

    def __init__(self, sock: socket.socket, peer: tuple[Any, ...]) -> None:
        self.sock = sock
        self.peer = peer
        self.handshaken = not isinstance(sock, ssl.SSLSocket)
        self.buffer = bytearray()
        self.handler: BaseHTTPRequestHandler | None = None
        self.last_active = self.started = time.monotonic()  # started: of the TLS handshake or request head

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.handler is not None:
                self.handler.wfile.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def receive(self) -> bool:
        """Read what arrived, without blocking (the poller's side); False when the client is gone,
        or sent a head larger than MAX_HEAD_BYTES."""
        if not self.handshaken and isinstance(self.sock, ssl.SSLSocket):
            try:
                self.sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return True
            self.handshaken = True
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return True
            if not data:
                return False
            if not self.buffer:
                self.started = time.monotonic()
            self.buffer += data
            self.last_active = time.monotonic()
            if len(self.buffer) > MAX_HEAD_BYTES and not self.has_request():
                return False

    def has_request(self) -> bool:
        return b"\r\n\r\n" in self.buffer

    def next_request(self) -> io.BytesIO:
        """The first complete request head; what follows it stays for the next one."""
        end = self.buffer.index(b"\r\n\r\n") + 4
        head, self.buffer = bytes(self.buffer[:end]), self.buffer[end:]
        self.started = time.monotonic()
        return io.BytesIO(head)


class AgentHTTPServer:
    """Serves from its own threads once started; `snapshot` returns the latest document, `healthy`
    the health state. Binding happens in __init__ so a bad address fails at once (OSError)."""

    def __init__(self, address: tuple[str, int], metrics: Callable[[bool], bytes],
                 snapshot: Callable[[], dict[str, Any]], healthy: Callable[[], bool], *, web: WebConfig | None = None,
                 snapshot_remote: bool = False, max_connections: int | None = None) -> None:
        """`metrics(in_protobuf)`: /metrics' body, as text or in protobuf."""
        self._web = web or WebConfig()
        self._snapshot_remote = snapshot_remote
        self._max_connections = max_connections or default_max_connections()
        self._routes: dict[str, Callable[[str], tuple[int, str, bytes]]] = {  # each given the Accept header
            "/metrics": lambda accept: (200, protobuf.CONTENT_TYPE, metrics(True)) if wants_protobuf(accept)
            else (200, CONTENT_TYPE_LATEST, metrics(False)),
            "/healthz": lambda _: (200, "text/plain", b"ok\n") if healthy() else (503, "text/plain", b"unhealthy\n"),
            SNAPSHOT_PATH: lambda _: (200, "application/json", json.dumps(snapshot(), default=str).encode()),
        }
        self._address = address
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._returned: queue.SimpleQueue[tuple[_Connection, bool]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._idle: dict[_Connection, None] = {}  # insertion order: the longest waiting first
        self._busy: dict[_Connection, float] = {}  # -> when its worker took it (touched by the poller only)
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="aiprobe-http-worker")
        self._thread: threading.Thread | None = None
        self._handler_class = _handler_class(self)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            self._bind()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # Any local user can take the port first: serve once it is free (the poller retries).
            log.warning("listen %s: %s; serving once it is free", endpoint(*address), exc.strerror)

    def _bind(self) -> None:
        self._listener = listen_socket(self._address)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1] if self._listener is not None else self._address[1]

    @property
    def tls(self) -> bool:
        return self._web.tls is not None

    def start(self) -> None:
        self._thread = SUPERVISOR.start_thread("http", self._poll, self._stop)

    def close(self) -> None:
        """Stop serving; safe whether or not `start()` ran (a server never started is not waited for)."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._selector.close()

    # --- the poller thread ---

    def _poll(self) -> None:
        if self._listener is None:
            self._bind()  # EADDRINUSE again: the supervisor retries with back-off
            log.info("listening on %s", endpoint(self._address[0], self.port))
        while not self._stop.is_set():
            for key, _events in self._selector.select(timeout=1.0):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    self._readable(key.data)
            self._take_back_returned()
            self._close_expired()

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._idle:
                    self._drop(next(iter(self._idle)))  # free a descriptor: the longest idle client goes
                    continue
                log.debug("accept failed: %s", exc)
                return
            if len(self._idle) + len(self._busy) >= self._max_connections and self._idle:
                self._drop(next(iter(self._idle)))
            sock.setblocking(False)
            if self._web.tls is not None:  # the handshake happens as bytes arrive, in receive()
                sock = self._web.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            self._watch(_Connection(sock, peer))

    def _watch(self, conn: _Connection) -> None:
        if conn.has_request():  # pipelined: the next request is here already
            self._dispatch(conn)
            return
        conn.sock.setblocking(False)
        try:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):  # closed meanwhile
            conn.close()
            return
        self._idle[conn] = None

    def _drop(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        conn.close()

    def _readable(self, conn: _Connection) -> None:
        """Bytes from a waiting client: a worker gets the connection only once a whole request head
        is here, so clients that send slowly or not at all never hold a worker."""
        try:
            alive = conn.receive()
        except (OSError, ssl.SSLError) as exc:
            log.debug("client %s: %s", conn.peer[0], exc)
            alive = False
        if not alive:
            self._drop(conn)
        elif conn.has_request():
            self._idle.pop(conn, None)
            self._selector.unregister(conn.sock)
            self._dispatch(conn)

    def _dispatch(self, conn: _Connection) -> None:
        self._busy[conn] = time.monotonic()
        try:
            self._workers.submit(self._serve, conn)
        except RuntimeError:  # shutting down
            self._busy.pop(conn, None)
            conn.close()

    def _take_back_returned(self) -> None:
        while True:
            try:
                conn, keep = self._returned.get_nowait()
            except queue.Empty:
                return
            self._busy.pop(conn, None)
            if keep:
                self._watch(conn)

    def _close_expired(self) -> None:
        """Idle clients after IDLE_TIMEOUT; a handshake, request head or answer not done within
        REQUEST_TIMEOUT (a busy worker's socket is shut down under it, which ends its wait)."""
        now = time.monotonic()
        for conn in list(self._idle):
            midway = conn.buffer or not conn.handshaken
            if now - (conn.started if midway else conn.last_active) > (REQUEST_TIMEOUT if midway else IDLE_TIMEOUT):
                self._drop(conn)
        for conn, since in list(self._busy.items()):
            if now - since > REQUEST_TIMEOUT:
                self._busy[conn] = float("inf")  # once
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # --- a worker: one or more requests of one connection ---

    def _serve(self, conn: _Connection) -> None:
        keep = False
        try:
            keep = self._serve_request(conn)
        except (OSError, ssl.SSLError, ValueError) as exc:  # a client gone, timed out or speaking nonsense
            log.debug("client %s: %s", conn.peer[0], exc)
        except Exception:  # a bug must cost one connection, not the worker
            log.exception("client %s: request failed", conn.peer[0])
        if not keep:
            conn.close()
        self._returned.put((conn, keep))
        self._wake()

    def _serve_request(self, conn: _Connection) -> bool:
        conn.sock.settimeout(REQUEST_TIMEOUT)
        if conn.handler is None:
            conn.handler = self._handler_class(conn)
        handler = conn.handler
        handler.rfile = conn.next_request()
        handler.handle_one_request()
        handler.wfile.flush()
        return not handler.close_connection and not self._stop.is_set()

    # --- routing, called by the handler ---

    def respond(self, path: str, peer: str, authorization: str | None,
                accept: str) -> tuple[int, dict[str, str], bytes]:
        route = self._routes.get(path)
        if route is None:
            return 404, {"Content-Type": "text/plain"}, b"not found\n"
        auth = self._web.auth
        if auth is not None and path not in PUBLIC_PATHS and not auth.allows(authorization):
            return 401, {"Content-Type": "text/plain", "WWW-Authenticate": 'Basic realm="aiprobe"'}, b"unauthorized\n"
        if path == SNAPSHOT_PATH and not (self._snapshot_remote or auth is not None or _is_loopback(peer)):
            return 403, {"Content-Type": "text/plain"}, (
                b"the snapshot API answers local clients only (snapshot_api = \"network\" or basic auth to serve it)\n")
        status, content_type, body = route(accept)
        return status, {"Content-Type": content_type}, body


def _handler_class(server: AgentHTTPServer) -> Callable[[_Connection], BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """One connection's request handler, driven one request at a time by a worker."""

        protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its scrape connection
        server_version = f"aiprobe/{__version__}"
        sys_version = ""

        # No socketserver loop: a worker calls handle_one_request() as requests arrive.
        def __init__(self, conn: _Connection) -> None:
            self.connection = self.request = conn.sock
            self.client_address = conn.peer
            self.rfile = io.BytesIO()  # each request's head, read by the poller
            self.wfile = conn.sock.makefile("wb")
            self.close_connection = True

        def do_GET(self) -> None:
            status, headers, body = server.respond(self.path.split("?", 1)[0], self.client_address[0],
                                                   self.headers.get("Authorization"), self.headers.get("Accept", ""))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            # Scrapes are not worth a line each; bad requests from the network are not worth one either.
            log.debug("client %s: " + format, self.client_address[0], *args)

    return Handler
