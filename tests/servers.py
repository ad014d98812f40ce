"""Real servers for integration tests: the aiprobe agent, Prometheus and Alertmanager (Debian packages),
each on a free loopback port with its state in a temporary directory, stopped on exit."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers import PATIENCE, free_port, wait_until

AIPROBE = str(Path(sys.executable).parent / "aiprobe")


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None,
             context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    if context is None and url.startswith("https:"):
        context = ssl._create_unverified_context()  # readiness only; tests that verify pass their own
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


class Server:
    """A subprocess with a URL; `stop()` sends SIGTERM and returns the exit status, killing it after
    `stop_timeout` seconds."""

    stop_timeout = 10.0

    def __init__(self, cmd: list[str], url: str, ready_path: str, log: Path, env: dict | None = None,
                 ready_timeout: float = 2 * PATIENCE) -> None:
        self.url = url
        self.log = log
        self._log_file = log.open("ab")
        self.process = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        if not wait_until(lambda: self.process.poll() is not None or http_get(url + ready_path)[0] == 200,
                          timeout=ready_timeout, interval=0.1) or self.process.poll() is not None:
            self.stop()
            raise RuntimeError(f"{cmd[0]} did not become ready: {log.read_text()[-2000:]}")

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
        return self.process.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Agent(Server):
    # Detaching waits for the kernel (RCU grace periods, uprobe events a perf event still holds):
    # seconds on a loaded host, more in an emulated guest. Killed sooner, it would leave what it holds.
    stop_timeout = 60.0

    def __init__(self, workdir: Path, config: str = "", env: dict | None = None, *, https: bool = False,
                 args: tuple[str, ...] = (), listen_host: str = "127.0.0.1", alert_log: str | None = None,
                 prefix: Sequence[str] = (), ready_timeout: float = 2 * PATIENCE) -> None:
        """`listen_host`: where it listens (e.g. `[::]`); the test reaches it on 127.0.0.1 anyway.
        `prefix` runs the agent through a wrapper (setpriv: reduced capabilities). It is ready once
        every probe has loaded: `ready_timeout` (seconds) as long as that may take."""
        port = free_port()
        self.config_path = workdir / f"aiprobe-{port}.toml"
        self.alert_log = Path(alert_log or workdir / f"alerts-{port}.jsonl")
        # Refreshes every interval, as the tests' waits assume, unless the test paces them itself: a
        # guest's emulated CPU would otherwise pace them to MAX_PACED_SECONDS (test_agent tests pacing).
        pacing = "" if "refresh_budget" in config else "refresh_budget = 0\n"
        self.config_path.write_text(f'listen = "{listen_host}:{port}"\nalert_log = "{self.alert_log}"\n{pacing}'
                                    + config)
        self.target = f"127.0.0.1:{port}"
        super().__init__([*prefix, AIPROBE, "agent", "--config", str(self.config_path), *args],
                         f"{'https' if https else 'http'}://{self.target}", "/healthz",
                         workdir / f"agent-{port}.log", env=env, ready_timeout=ready_timeout)

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def metrics(self) -> str:
        return http_get(self.url + "/metrics")[1].decode()

    def snapshot(self) -> dict:
        return json.loads(http_get(self.url + "/api/v1/snapshot")[1])


class Prometheus(Server):
    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path] = (),
                 target_labels: dict[str, str] | None = None, relabel_configs: list[dict] = (),
                 scrape_options: dict[str, Any] | None = None, flags: Sequence[str] = ()) -> None:
        """`target_labels` and `relabel_configs` stand in for what service discovery and its
        relabeling (e.g. a ServiceMonitor's) give a target; `scrape_options` adds scrape config keys
        (scheme, tls_config, basic_auth); `flags`, command-line flags (--enable-feature=...)."""
        port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "aiprobe",
                                "static_configs": [{"targets": targets, "labels": target_labels or {}}],
                                "relabel_configs": list(relabel_configs), **(scrape_options or {})}],
        }))
        super().__init__(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", *flags],
            f"http://127.0.0.1:{port}", "/-/ready", workdir / "prometheus.log")

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if status != 200:
            raise AssertionError(f"query {promql!r} failed ({status}): {body[:300]!r}")
        return json.loads(body)["data"]["result"]

    def wait_for_series(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = []

        def has_series() -> bool:
            nonlocal result
            result = self.query(promql)
            return bool(result)

        wait_until(has_series, timeout=timeout, interval=0.5)
        return result


class Alertmanager(Server):
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        config = workdir / "alertmanager.yml"
        config.write_text(json.dumps({
            "route": {"receiver": "null", "group_wait": "1s", "group_interval": "1s"},
            "receivers": [{"name": "null"}],
        }))
        super().__init__(
            ["prometheus-alertmanager", f"--config.file={config}", f"--storage.path={workdir / 'am'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            f"http://127.0.0.1:{self.port}", "/-/ready", workdir / "alertmanager.log")

    def alerts(self) -> list[dict[str, Any]]:
        status, body = http_get(self.url + "/api/v2/alerts")
        return json.loads(body) if status == 200 else []
