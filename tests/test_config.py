"""Agent configuration: defaults, the shipped example, and one-line errors with exit status 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from aiprobe.config import ConfigError, from_dict, load
from aiprobe.registry import catalog

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_example_is_the_defaults() -> None:
    assert load(ROOT / "deploy" / "aiprobe.toml", catalog()) == load(None, catalog())


def test_values_and_overrides() -> None:
    config = load(None, catalog(), listen="127.0.0.1:9999", probes=["flows"], interfaces=None)
    assert config.listen_address == ("127.0.0.1", 9999)
    assert config.probes == ("flows",)
    rules = from_dict({"rules": {"gpu_saturated": {"threshold": 0.9, "for_seconds": 5}}}, catalog()).rules
    assert rules["gpu_saturated"].threshold == 0.9 and rules["gpu_saturated"].for_seconds == 5.0
    assert rules["gpu_saturated"].clear_threshold == 0.85  # untouched keys keep their defaults


@pytest.mark.parametrize(("data", "names"), [
    ({"listen_adress": "x"}, "listen_adress"),
    ({"listen": "9645"}, "listen"),
    ({"interval_seconds": "1"}, "interval_seconds"),
    ({"interval_seconds": 0.01}, "interval_seconds"),
    ({"probes": ["flows", "gpu"]}, "probes"),
    ({"top_flows": 0}, "top_flows"),
    ({"alertmanager_url": "alertmanager:9093"}, "alertmanager_url"),
    ({"rules": {"gpu_melting": {}}}, "rules.gpu_melting"),
    ({"rules": {"gpu_saturated": {"treshold": 1}}}, "rules.gpu_saturated.treshold"),
    ({"rules": {"gpu_saturated": {"severity": "page"}}}, "rules.gpu_saturated.severity"),
    ({"rules": {"gpu_saturated": {"enabled": "yes"}}}, "rules.gpu_saturated.enabled"),
    ({"histogram_buckets": [0.1]}, "histogram_buckets"),
    ({"histogram_buckets": {"aiprobe_tcp_send_bytes_total": [0.1]}}, "histogram_buckets.aiprobe_tcp_send_bytes_total"),
    ({"histogram_buckets": {"http_server_request_body_size_bytes": [1]}},
     "histogram_buckets.http_server_request_body_size_bytes"),
    ({"histogram_buckets": {"http_server_request_duration_seconds": []}},
     "histogram_buckets.http_server_request_duration_seconds"),
    ({"histogram_buckets": {"http_server_request_duration_seconds": [0.5, 0.1]}},
     "histogram_buckets.http_server_request_duration_seconds"),
    ({"histogram_buckets": {"http_server_request_duration_seconds": [0.0]}},
     "histogram_buckets.http_server_request_duration_seconds"),
    ({"histogram_buckets": {"http_server_request_duration_seconds": ["1s"]}},
     "histogram_buckets.http_server_request_duration_seconds"),
])
def test_bad_keys_and_values_name_the_key(data: dict, names: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(data, catalog())
    assert str(exc.value).startswith(names + ":")


@pytest.mark.parametrize("content", [
    'listen = "0.0.0.0:9645"\nlisten_port = 1\n',
    "[rules.network_send_stall]\nthreshold = -1\n",
    "this is not toml",
])
def test_agent_with_bad_config_prints_one_line_and_exits_2(tmp_path: Path, aiprobe_cli: list[str],
                                                           content: str) -> None:
    path = tmp_path / "aiprobe.toml"
    path.write_text(content)
    result = subprocess.run([*aiprobe_cli, "agent", "--config", str(path)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiprobe: config:"), lines
    assert "Traceback" not in result.stderr


def test_agent_with_missing_config_file(aiprobe_cli: list[str], tmp_path: Path) -> None:
    result = subprocess.run([*aiprobe_cli, "agent", "--config", str(tmp_path / "none.toml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "none.toml" in result.stderr and len(result.stderr.strip().splitlines()) == 1
