"""The agent's HTTP endpoints: /metrics (Prometheus text format), /healthz, /api/v1/snapshot (JSON).

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
from aiprobe.supervisor import SUPERVISOR
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .webconfig import WebConfig

log = logging.getLogger("aiprobe.http")

BACKLOG = 1024
WORKERS = 4
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
PUBLIC_PATHS = ("/healthz",)  # open without basic auth: kubelet probes carry no credentials
SNAPSHOT_PATH = "/api/v1/snapshot"


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


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class _Connection:
    """One client: its socket, buffered streams and handler, kept across keep-alive requests."""

    def __init__(self, sock: socket.socket, peer: tuple, tls: ssl.SSLContext | None) -> None:
        self.sock = sock
        self.peer = peer
        self.tls = tls
        self.handler: BaseHTTPRequestHandler | None = None
        self.last_active = time.monotonic()

    def close(self) -> None:
        for stream in (getattr(self.handler, "wfile", None), getattr(self.handler, "rfile", None)):
            with contextlib.suppress(OSError):
                stream and stream.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def has_buffered_request(self) -> bool:
        """Bytes already read (or decrypted) but not yet handled: a pipelined request."""
        rfile = self.handler.rfile
        self.sock.setblocking(False)
        try:
            return bool(rfile.peek(1))
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        except (OSError, ValueError):
            return True  # EOF or error: the next read finds out and closes
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(REQUEST_TIMEOUT)


class AgentHTTPServer:
    """Serves from its own threads once started; `snapshot` returns the latest document, `healthy`
    the health state. Binding happens in __init__ so a bad address fails at once (OSError)."""

    def __init__(self, address: tuple[str, int], registry: Any, snapshot: Callable[[], dict],
                 healthy: Callable[[], bool], *, web: WebConfig | None = None, snapshot_remote: bool = False,
                 max_connections: int | None = None) -> None:
        self._web = web or WebConfig()
        self._snapshot_remote = snapshot_remote
        self._max_connections = max_connections or default_max_connections()
        self._routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: (200, "text/plain", b"ok\n") if healthy() else (503, "text/plain", b"unhealthy\n"),
            SNAPSHOT_PATH: lambda: (200, "application/json", json.dumps(snapshot(), default=str).encode()),
        }
        self._listener = listen_socket(address)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._returned: queue.SimpleQueue[_Connection] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._idle: dict[_Connection, None] = {}  # insertion order: the longest idle first
        self._busy = 0
        self._stop = threading.Event()
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="aiprobe-http-worker")
        self._thread: threading.Thread | None = None
        self._handler_class = _handler_class(self)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

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
            sock.close()
        self._selector.close()

    # --- the poller thread ---

    def _poll(self) -> None:
        while not self._stop.is_set():
            for key, _events in self._selector.select(timeout=1.0):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    self._dispatch(key.data)
            self._take_back_returned()
            self._close_expired()

    def _accept(self) -> None:
        while True:
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
            if len(self._idle) + self._busy >= self._max_connections and self._idle:
                self._drop(next(iter(self._idle)))
            sock.setblocking(True)
            sock.settimeout(REQUEST_TIMEOUT)
            self._watch(_Connection(sock, peer, self._web.tls))

    def _watch(self, conn: _Connection) -> None:
        conn.last_active = time.monotonic()
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

    def _dispatch(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)
        self._selector.unregister(conn.sock)
        self._busy += 1
        try:
            self._workers.submit(self._serve, conn)
        except RuntimeError:  # shutting down
            self._busy -= 1
            conn.close()

    def _take_back_returned(self) -> None:
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            self._busy -= 1
            if conn is not None:
                self._watch(conn)

    def _close_expired(self) -> None:
        deadline = time.monotonic() - IDLE_TIMEOUT
        for conn in list(self._idle):
            if conn.last_active > deadline:
                break
            self._drop(conn)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # --- a worker: one or more requests of one connection ---

    def _serve(self, conn: _Connection) -> None:
        keep = False
        try:
            keep = self._serve_requests(conn)
        except (OSError, ssl.SSLError, ValueError) as exc:  # a client gone, timed out or speaking nonsense
            log.debug("client %s: %s", conn.peer[0], exc)
        except Exception:  # a bug must cost one connection, not the worker
            log.exception("client %s: request failed", conn.peer[0])
        if not keep:
            conn.close()
        self._returned.put(conn if keep else None)
        self._wake()

    def _serve_requests(self, conn: _Connection) -> bool:
        if conn.handler is None:
            if conn.tls is not None:
                conn.sock = conn.tls.wrap_socket(conn.sock, server_side=True)  # handshake, under the timeout
            conn.handler = self._handler_class(conn, self)
        while True:
            conn.handler.handle_one_request()
            conn.handler.wfile.flush()
            if conn.handler.close_connection or self._stop.is_set():
                return False
            if not conn.has_buffered_request():
                return True

    # --- routing, called by the handler ---

    def respond(self, path: str, peer: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        route = self._routes.get(path)
        if route is None:
            return 404, {"Content-Type": "text/plain"}, b"not found\n"
        auth = self._web.auth
        if auth is not None and path not in PUBLIC_PATHS and not auth.allows(authorization):
            return 401, {"Content-Type": "text/plain", "WWW-Authenticate": 'Basic realm="aiprobe"'}, b"unauthorized\n"
        if path == SNAPSHOT_PATH and not (self._snapshot_remote or auth is not None or _is_loopback(peer)):
            return 403, {"Content-Type": "text/plain"}, (
                b"the snapshot API answers local clients only (snapshot_api = \"network\" or basic auth to serve it)\n")
        status, content_type, body = route()
        return status, {"Content-Type": content_type}, body


def _handler_class(server: AgentHTTPServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """One connection's request handler, driven one request at a time by a worker."""

        protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its scrape connection
        server_version = f"aiprobe/{__version__}"
        sys_version = ""

        # No socketserver loop: a worker calls handle_one_request() as requests arrive.
        def __init__(self, conn: _Connection, owner: AgentHTTPServer) -> None:
            self.connection = self.request = conn.sock
            self.client_address = conn.peer
            self.server = owner
            self.rfile = conn.sock.makefile("rb")
            self.wfile = conn.sock.makefile("wb")
            self.close_connection = True

        def do_GET(self) -> None:
            status, headers, body = server.respond(self.path.split("?", 1)[0], self.client_address[0],
                                                   self.headers.get("Authorization"))
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
