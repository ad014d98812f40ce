"""The agent's HTTP endpoints: /metrics (Prometheus text format), /healthz, /api/v1/snapshot (JSON)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class AgentHTTPServer:
    """Serves in a daemon thread; `snapshot` returns the latest document, `healthy` the health state."""

    def __init__(self, address: tuple[str, int], registry: Any, snapshot: Callable[[], dict[str, Any]],
                 healthy: Callable[[], bool]) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: (200, "text/plain", b"ok\n") if healthy() else (503, "text/plain", b"starting\n"),
            "/api/v1/snapshot": lambda: (200, "application/json",
                                         json.dumps(snapshot(), default=str).encode()),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                status, content_type, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not worth a log line each
                pass

        self._server = ThreadingHTTPServer(address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="aiprobe-http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
