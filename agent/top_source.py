"""Where `aiprobe top` gets snapshots: a running agent's `/api/v1/snapshot`, or, when no agent runs on
this host, the agent's own probes loaded in-process. Never both: two copies of the probes would
double the kernel-side cost, so an agent that runs but does not answer is an error, not a fallback."""

from __future__ import annotations

import itertools
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Protocol

import psutil

from .config import DEFAULT_PORT, ConfigError, load
from .system import UserError, require_privileges

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
SNAPSHOT_PATH = "/api/v1/snapshot"


class SnapshotError(Exception):
    """The agent did not deliver a snapshot (gone, timed out, not JSON)."""


class SnapshotSource(Protocol):
    label: str

    def snapshot(self) -> dict: ...

    def close(self) -> None: ...


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port/` or the full snapshot URL -> `http://host:port`; ValueError if none."""
    url = url.strip()
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")  # ValueError on a malformed host
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    parts.port  # noqa: B018 -- raises ValueError on a port that is not a number in range
    return f"{parts.scheme}://{parts.netloc}"


class AgentClient:
    """Snapshots from a running agent over HTTP."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self.label = f"agent {self.url}"

    def snapshot(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + SNAPSHOT_PATH, timeout=self.timeout) as response:
                return json.load(response)
        except (OSError, ValueError) as exc:  # URLError, refused, timeout; JSONDecodeError
            raise SnapshotError(str(getattr(exc, "reason", exc))) from None

    def close(self) -> None:
        pass


class InProcessAgent:
    """The agent's probes, loaded by this process for as long as top runs."""

    label = "in-process probes"

    def __init__(self, interfaces: list[str] | None, interval: float) -> None:
        from .daemon import Agent  # loads BPF: only when no agent answers

        try:
            config = load(None, interfaces=interfaces, interval_seconds=interval)
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

    def snapshot(self) -> dict:
        return self.agent.refresh()

    def close(self) -> None:
        self.agent.close()


def answers(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(normalize_url(url) + "/healthz", timeout=timeout):
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


def open_source(connect: str, interfaces: list[str] | None, interval: float) -> SnapshotSource:
    """The agent at `connect`, else any other agent running here, else the probes in-process."""
    if answers(connect):
        return AgentClient(connect)
    for pid, urls in running_agents().items():
        for url in urls:
            if answers(url):
                return AgentClient(url)
        raise UserError(
            f"an aiprobe agent runs (pid {pid}) but does not answer at {', '.join(urls) or 'any address yet'}; "
            "try again, or --connect its address"
        )
    return InProcessAgent(interfaces, interval)
