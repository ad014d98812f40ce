"""Where `aiprobe top` gets snapshots: a running agent's `/api/v1/snapshot`, or, when no agent runs on
this host, the agent's own probes loaded in-process. Never both: two copies of the probes would
double the kernel-side cost, so an agent that runs but does not answer is an error, not a fallback."""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from .config import DEFAULT_PORT, ConfigError, load
from .names import printable, printable_document
from .registry import catalog
from .system import UserError, require_privileges

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
SNAPSHOT_PATH = "/api/v1/snapshot"
MAX_SNAPSHOT_BYTES = 64 << 20


class SnapshotError(Exception):
    """The agent did not deliver a snapshot (gone, timed out, not JSON)."""


class SnapshotSource(Protocol):
    label: str

    def snapshot(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port/` or the full snapshot URL -> `http://host:port`; ValueError if none."""
    url = url.strip()
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")  # ValueError on a malformed host
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class Credentials:
    """How `top` reaches an agent behind a web config: the CA that signed its certificate, basic auth."""

    cafile: str | None = None
    user: str | None = None
    password: str = ""

    def context(self, url: str) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.cafile) if url.startswith("https:") else None

    def headers(self) -> dict[str, str]:
        if self.user is None:
            return {}
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return {"Authorization": f"Basic {token}"}


class AgentClient:
    """Snapshots from a running agent over HTTP(S). What answers must be an aiprobe agent: on this
    host, the process listening on the port (any user can bind 127.0.0.1:9645 first), and the
    document it serves."""

    def __init__(self, url: str, timeout: float = 5.0, credentials: Credentials = Credentials()) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self.label = f"agent {self.url}"
        self._credentials = credentials
        self._context = credentials.context(self.url)
        impostor = local_impostor(self.url)
        if impostor:
            raise UserError(f"{self.url} is served by {impostor}, not an aiprobe agent; refusing to read it")

    def _get(self, path: str) -> tuple[str, bytes]:
        request = urllib.request.Request(self.url + path, headers=self._credentials.headers())
        with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as response:
            return response.headers.get("Server", ""), response.read(MAX_SNAPSHOT_BYTES)

    def snapshot(self) -> dict[str, Any]:
        try:
            server, body = self._get(SNAPSHOT_PATH)
            document = json.loads(body)
        except urllib.error.HTTPError as exc:
            raise SnapshotError(f"HTTP {exc.code} {exc.reason}") from None
        except (OSError, ValueError) as exc:  # URLError, refused, timeout, TLS; JSONDecodeError
            raise SnapshotError(str(getattr(exc, "reason", exc))) from None
        if not _is_snapshot(document):  # not the header alone: agents of older versions name no server
            raise SnapshotError(f"not an aiprobe agent's snapshot (server {printable(server) or 'unnamed'})")
        clean: dict[str, Any] = printable_document(document)  # names come from other processes, maybe another host
        return clean

    def close(self) -> None:
        pass


def _is_snapshot(document: object) -> bool:
    return isinstance(document, dict) and isinstance(document.get("host"), dict) and "probes" in document


def local_impostor(url: str) -> str | None:
    """Who, other than an aiprobe agent, listens on `url`'s port here: "pid N (name)", or None when it
    is an agent, the host is not this one, or we may not see other users' sockets."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "::1", "localhost"):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        listeners = [c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid]
    except (psutil.Error, OSError):
        return None
    for pid in listeners:
        try:
            process = psutil.Process(pid)
            if _is_agent(process.cmdline()) and process.uids().real == 0:
                continue
            return f"pid {pid} ({printable(process.name())}, uid {process.uids().real})"
        except psutil.Error:
            continue
    return None


class InProcessAgent:
    """The agent's probes, loaded by this process for as long as top runs."""

    label = "in-process probes"

    def __init__(self, interfaces: list[str] | None, interval: float) -> None:
        from .daemon import Agent  # loads BPF: only when no agent answers

        try:
            config = load(None, catalog(), interfaces=interfaces, interval_seconds=interval)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        require_privileges()
        # The snapshot carries each probe's reason for being down; log lines would scribble over the screen.
        logging.getLogger("aiprobe").addHandler(logging.NullHandler())
        self.agent = Agent(config)
        try:
            self.agent.start()
        except BaseException:
            self.agent.close()
            raise

    def snapshot(self) -> dict[str, Any]:
        self.agent.refresh()
        return self.agent.snapshot()

    def close(self) -> None:
        self.agent.close()


def answers(url: str, credentials: Credentials = Credentials(), timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(normalize_url(url) + "/healthz", timeout=timeout,
                                    context=credentials.context(normalize_url(url))):
            return True
    except urllib.error.HTTPError:
        return True  # something that speaks HTTP answers: its snapshot endpoint will say more
    except OSError:
        return False


def _is_agent(cmdline: list[str]) -> bool:
    """`aiprobe agent …`, `python -m aiprobe agent …` or `.venv/bin/aiprobe agent …`."""
    return any(Path(arg).name == "aiprobe" and nxt == "agent" for arg, nxt in itertools.pairwise(cmdline))


def running_agents() -> dict[int, list[str]]:
    """pid -> the URLs it listens on, for every `aiprobe agent` on this host but us."""
    agents = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.info["pid"] == os.getpid() or not _is_agent(process.info["cmdline"] or []):
            continue
        try:
            sockets = process.net_connections(kind="tcp")
        except psutil.Error:
            sockets = []
        agents[process.info["pid"]] = [
            _local_url(sock.laddr.ip, sock.laddr.port) for sock in sockets if sock.status == psutil.CONN_LISTEN
        ]
    return agents


def _local_url(ip: str, port: int) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_source(connect: str, interfaces: list[str] | None, interval: float,
                credentials: Credentials = Credentials()) -> SnapshotSource:
    """The agent at `connect`, else any other agent running here, else the probes in-process."""
    if answers(connect, credentials):
        return AgentClient(connect, credentials=credentials)
    for pid, urls in running_agents().items():
        for url in urls:
            if answers(url, credentials):
                return AgentClient(url, credentials=credentials)
        raise UserError(
            f"an aiprobe agent runs (pid {pid}) but does not answer at {', '.join(urls) or 'any address yet'}; "
            "try again, or --connect its address"
        )
    return InProcessAgent(interfaces, interval)
