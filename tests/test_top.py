"""`aiprobe top` driven headlessly with Textual's own Pilot at 80x24, fed docs/snapshot.md documents;
plus units, the batch text report and the command line's errors."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
from collections.abc import Awaitable, Callable

import pytest
from aiprobe import formatting
from aiprobe.commands.top import HelpScreen, TopApp, run_batch
from aiprobe.top_source import SnapshotError, _is_agent, normalize_url
from aiprobe.top_views import text_report, views
from textual.pilot import Pilot
from textual.widgets import DataTable

NOW = 1764489600.0


def process(pid: int, comm: str, send_rate: float, ctxsw: float | None, container: str = "host") -> dict:
    return {
        "pid": pid, "comm": comm, "container": container, "pod_uid": None,
        "send_count": 10, "send_bytes": 1000, "send_bytes_per_second": send_rate,
        "send_p50_seconds": 0.00002, "send_p99_seconds": 0.0003,
        "cuda_context_switches_per_second": ctxsw, "cuda_kernel_launches_per_second": 900.0,
        "cuda_syncs_per_second": 10.0, "runqueue_delay_p99_seconds": 0.0004,
        "gpu_utilization_ratio": 0.83, "gpu_memory_used_bytes": 1 << 30, "gpus": [0],
    }


def flow(remote: str, rate: float, direction: str = "ingress") -> dict:
    return {
        "interface": "eth0", "direction": direction, "protocol": "tcp",
        "local_address": "10.0.0.5", "local_port": 8000, "remote_address": remote, "remote_port": 51234,
        "bytes": 123456, "packets": 100, "bytes_per_second": rate, "packets_per_second": 2.0,
        "cgroup_id": 0, "container": "host", "first_seen": NOW - 100, "last_seen": NOW - 0.5,
        "tcp_syn": 1, "tcp_fin": 0, "tcp_rst": 0,
    }


SNAPSHOT = {
    "host": {"hostname": "gpu-node-1", "kernel": "6.8.0", "version": "0.1.0", "time": NOW, "interval_seconds": 1.0},
    "probes": {
        "flows": {"up": True, "strategy": "xdp+tcx", "span": "", "reason": ""},
        "sendlat": {"up": True, "strategy": "tracepoint", "span": "", "reason": ""},
        "cuda": {"up": True, "strategy": "uprobe", "span": "", "reason": ""},
        "sched": {"up": True, "strategy": "tp_btf", "span": "", "reason": ""},
        "nvml": {"up": True, "strategy": "nvml", "span": "", "reason": ""},
    },
    "processes": [
        process(4242, "vllm", 120_000.0, 12.0, "3f2a9c1d0e4b"),
        process(77, "tritonserver", 5_000_000.0, None),
        process(9, "python3", 10.0, 2000.0),
    ],
    "flows": [flow("10.0.0.9", 2048.0), flow("10.0.0.7", 9_000_000.0, "egress"), flow("2001:db8::9", 1.0)],
    "interfaces": [],
    "gpus": [{
        "index": 0, "uuid": "GPU-1", "name": "NVIDIA H100", "utilization_gpu_ratio": 0.83,
        "utilization_memory_ratio": 0.4, "memory_total_bytes": 80 << 30, "memory_used_bytes": 20 << 30,
        "memory_free_bytes": 60 << 30, "power_watts": 312.5, "temperature_celsius": 61,
        "sm_clock_hz": 1980000000, "memory_clock_hz": 2619000000, "clock_event_reasons": ["sw_power_cap"],
        "pcie_tx_bytes_per_second": 0, "pcie_rx_bytes_per_second": 0, "compute_mode": "default",
    }],
    "tcp": {"listen_overflows": 0, "listen_drops": 0, "retransmitted_segments": 0, "sent_segments": 0,
            "retransmit_ratio": 0.0},
    "streams": [{
        "pid": 4242, "comm": "vllm", "container": "3f2a9c1d0e4b", "port": 8000, "protocol": "sse",
        "streams_per_second": 2.5, "ttfb_p50_seconds": 0.15, "ttfb_p99_seconds": 0.4, "gap_p50_seconds": 0.02,
        "gap_p99_seconds": 0.3, "stalls": {"server": 1, "network": 2, "cpu": 0, "gpu": 0},
    }],
    "alerts": [{
        "rule": "network_send_stall", "severity": "warning", "target": "vllm@3f2a9c1d0e4b", "state": "firing",
        "since": NOW - 192, "value": 0.31, "summary": "sends stall",
        "evidence": {"send_p99_seconds": 0.31, "threshold_seconds": 0.05, "sends": 40},
    }],
}


class Feed:
    """The snapshots the app fetches: tests swap `current` or make the next fetch fail."""

    def __init__(self, snapshot: dict) -> None:
        self.current = snapshot
        self.error: str | None = None

    def __call__(self) -> dict:
        if self.error:
            raise SnapshotError(self.error)
        return self.current


def drive(test: Callable[[TopApp, Pilot, Feed], Awaitable[None]], snapshot: dict = SNAPSHOT) -> None:
    """Run `test` against the app at 80x24; a long interval keeps updates under the test's control."""
    feed = Feed(snapshot)

    async def main() -> None:
        app = TopApp(feed, "agent http://127.0.0.1:9645", interval=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.poll()
            await pilot.pause()
            await test(app, pilot, feed)

    asyncio.run(main())


async def shown(pilot: Pilot) -> str:
    """The whole screen as text, once pending renders are done."""
    await pilot.pause()
    return "\n".join(screen_lines(pilot.app))


def screen_lines(app: TopApp) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def column(app: TopApp, index: int) -> list[str]:
    table = app.query_one("#table", DataTable)
    return [str(table.get_row_at(row)[index]) for row in range(table.row_count)]


def comms(app: TopApp) -> list[str]:
    return column(app, 0)


# --- units -------------------------------------------------------------------------------------


def test_values_keep_their_units() -> None:
    assert formatting.field("send_bytes_per_second", 120_000.0) == "117 KiB/s"
    assert formatting.field("bytes_per_second", 9_000_000.0) == "8.58 MiB/s"
    assert formatting.field("send_p99_seconds", 0.0003) == "300 µs"
    assert formatting.field("send_p99_seconds", 0.31) == "310 ms"
    assert formatting.field("gpu_utilization_ratio", 0.83) == "83%"
    assert formatting.field("gpu_memory_used_bytes", 1 << 30) == "1 GiB"
    assert formatting.field("cuda_kernel_launches_per_second", 1500.0) == "1.50k/s"
    assert formatting.field("sm_clock_hz", 1980000000) == "1980 MHz"
    assert formatting.field("power_watts", 312.5) == "312 W"
    assert formatting.field("temperature_celsius", 61) == "61 °C"
    assert formatting.field("packets", 123456) == "123k"
    assert formatting.field("anything_seconds", None) == formatting.MISSING
    assert formatting.age(192) == "3m12s"
    assert formatting.without_unit("threshold_seconds") == "threshold"


# --- the screen --------------------------------------------------------------------------------


def test_renders_header_table_and_status_at_80x24() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        lines = screen_lines(app)
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        text = "\n".join(lines)
        assert "gpu-node-1" in lines[0] and "kernel 6.8.0" in lines[0] and "1 GPU" in lines[0]
        assert "alerts: 1 firing" in lines[0]
        assert lines[1].rstrip() == "probes: flows:xdp+tcx sendlat:tracepoint cuda:uprobe sched:tp_btf nvml:nvml"
        assert "Processes" in lines[2] and "sort SEND ▼" in lines[2]
        assert "tritonserver" in text and "4.77 MiB/s" in text and "300 µs" in text and "20 µs" in text
        assert "agent http://127.0.0.1:9645" in lines[23] and "? help" in lines[23]

    drive(check)


def test_view_keys_switch_views() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        table = app.query_one("#table", DataTable)
        expected = {"f": ("DIR", 3), "t": ("PORT", 1), "g": ("GPU", 1), "a": ("SINCE", 1), "p": ("COMM", 3)}
        for key, (first_column, rows) in expected.items():
            await pilot.press(key)
            assert str(table.ordered_columns[0].label).rstrip("▲▼") == first_column, key
            assert table.row_count == rows, key
        await pilot.press("f")
        text = await shown(pilot)
        assert "10.0.0.7:51234" in text and "[2001:db8::9]:51234" in text and "8.58 MiB/s" in text
        await pilot.press("t")
        await pilot.pause()
        assert [column(app, i) for i in (0, 1, 5, 9, 10)] == [["8000"], ["sse"], ["150 ms"], ["3"],
                                                               ["network 2 server 1"]]
        await pilot.press("g")
        text = await shown(pilot)
        assert "NVIDIA H100" in text and "83%" in text and "20 GiB" in text
        await pilot.press("a")
        text = await shown(pilot)
        assert "network_send_stall" in text and "3m12s" in text and "firing" in text
        assert "send_p99=310 ms threshold=50 ms sends=40" in column(app, 4)

    drive(check)


def test_sort_keys_order_by_raw_values_and_keep_missing_last() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        assert comms(app) == ["tritonserver", "vllm", "python3"]  # send bytes/s, biggest first
        await pilot.press("s")
        assert comms(app) == ["python3", "vllm", "tritonserver"]
        await pilot.press("greater_than_sign")  # THR CTX: tritonserver has none, so it stays last
        assert comms(app) == ["python3", "vllm", "tritonserver"]
        assert "sort THR CTX ▼" in screen_lines(app)[2]
        await pilot.press("s")
        assert comms(app) == ["vllm", "python3", "tritonserver"]
        for _ in range(6):
            await pilot.press("less_than_sign")
        assert "sort COMM ▲" in screen_lines(app)[2]
        assert comms(app) == ["python3", "tritonserver", "vllm"]
        await pilot.press("f")  # each view keeps its own sort
        assert column(app, 2)[0] == "10.0.0.5:8000" and "sort RATE ▼" in screen_lines(app)[2]
        assert column(app, 4) == ["8.58 MiB/s", "2 KiB/s", "1 B/s"]

    drive(check)


def test_filter_matches_any_shown_cell_and_escape_clears_it() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        await pilot.press("slash", *"3f2a")
        assert comms(app) == ["vllm"]  # matched on the container column
        await pilot.press("enter")
        assert "filter “3f2a”" in screen_lines(app)[2]
        await pilot.press("slash", "backspace", "backspace", "backspace", "backspace", *"quit")
        assert app.is_running and comms(app) == []  # q typed into the filter does not quit
        assert any("no processes to show (filter)" in line for line in screen_lines(app))
        await pilot.press("escape")
        assert comms(app) == ["tritonserver", "vllm", "python3"]
        assert "filter" not in screen_lines(app)[2]

    drive(check)


def test_space_pauses_updates() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        changed = copy.deepcopy(SNAPSHOT)
        changed["processes"] = [process(1, "newcomer", 1.0, 1.0)]
        await pilot.press("space")
        assert "PAUSED" in screen_lines(app)[2]
        feed.current = changed
        await app.poll()
        assert "newcomer" not in comms(app)
        await pilot.press("space")
        await app.poll()
        assert comms(app) == ["newcomer"]

    drive(check)


def test_refresh_keeps_the_scroll_position() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        await pilot.press("g", *["right"] * 30)  # GPU columns beyond 80 cells: scroll to THROTTLE
        table = app.query_one("#table", DataTable)
        scrolled = table.scroll_x
        assert scrolled > 0
        await app.poll()
        assert "sw_power_cap"[:10] in await shown(pilot)
        assert table.scroll_x == scrolled

    drive(check)


def test_cursor_follows_its_process_when_a_refresh_re_sorts() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        table = app.query_one("#table", DataTable)
        assert comms(app) == ["tritonserver", "vllm", "python3"]
        await pilot.press("down", "down")
        assert comms(app)[table.cursor_row] == "python3"
        busier = copy.deepcopy(SNAPSHOT)
        busier["processes"][2]["send_bytes_per_second"] = 9e9  # python3 now sorts first
        feed.current = busier
        await app.poll()
        await pilot.pause()
        assert comms(app) == ["python3", "tritonserver", "vllm"]
        assert comms(app)[table.cursor_row] == "python3"

    drive(check)


def test_failed_fetch_keeps_last_snapshot_and_says_why() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        feed.error = "Connection refused"
        await app.poll()
        assert "Connection refused" in screen_lines(app)[23]
        assert comms(app) == ["tritonserver", "vllm", "python3"]

    drive(check)


def test_probe_down_shows_reason_in_its_view_and_rest_works() -> None:
    snapshot = copy.deepcopy(SNAPSHOT)
    reason = "XDP attach failed: EPERM " + "and a long libbpf explanation " * 5
    snapshot["probes"]["flows"] = {"up": False, "strategy": None, "span": "", "reason": reason}
    snapshot["flows"] = []

    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        assert "flows:DOWN" in screen_lines(app)[1]
        assert not any("XDP attach failed" in line for line in screen_lines(app))  # not the processes view's
        await pilot.press("f")
        lines = screen_lines(app)
        assert lines[3].startswith("flows probe down: XDP attach failed: EPERM") and lines[3].endswith("…")
        assert "DIR" in lines[4]  # the reason takes one line, cut to the screen width
        await pilot.press("p")
        assert comms(app) == ["tritonserver", "vllm", "python3"]

    drive(check, snapshot)


def test_help_lists_keys_and_q_quits() -> None:
    async def check(app: TopApp, pilot: Pilot, feed: Feed) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = await shown(pilot)
        assert "reverse sort order" in text and "filter rows" in text and "pause" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    drive(check)


# --- batch mode and the command line --------------------------------------------------------------


def test_text_report_has_every_view() -> None:
    report = text_report(SNAPSHOT)
    for view in views().values():
        assert view.title.upper() in report
    assert "tritonserver" in report and "[2001:db8::9]:51234" in report and "network_send_stall" in report


class ListSource:
    label = "test"

    def __init__(self) -> None:
        self.served = 0

    def snapshot(self) -> dict:
        self.served += 1
        return {**SNAPSHOT, "host": {**SNAPSHOT["host"], "time": NOW + self.served}}

    def close(self) -> None:
        pass


def test_batch_json_prints_one_document_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    run_batch(ListSource(), interval=0.05, iterations=2, as_json=True)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["host"]["time"] for line in lines] == [NOW + 1, NOW + 2]


def test_agent_discovery_recognises_agent_command_lines() -> None:
    assert _is_agent(["/work/main/.venv/bin/python", "/work/main/.venv/bin/aiprobe", "agent", "--listen", "x"])
    assert _is_agent(["python3", "-m", "aiprobe", "agent"])
    assert not _is_agent(["aiprobe", "top"]) and not _is_agent(["vim", "agent"])
    assert normalize_url("127.0.0.1:9645/") == "http://127.0.0.1:9645"
    assert normalize_url("http://h:1/api/v1/snapshot") == "http://h:1"
    for bad in ("http://[::1", "ftp://h:1", "h:99999", "http://"):
        with pytest.raises(ValueError):
            normalize_url(bad)


@pytest.mark.parametrize(("args", "message"), [
    (["--iterations", "2"], "--iterations and --json need --batch"),
    (["--batch", "--connect", "http://[::1"], "Invalid value for '--connect'"),
])
def test_bad_options_are_usage_errors(aiprobe_cli: list[str], args: list[str], message: str) -> None:
    result = subprocess.run([*aiprobe_cli, "top", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.bpf
def test_unprivileged_top_without_agent_is_one_line(aiprobe_cli: list[str]) -> None:
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
         *aiprobe_cli, "top", "--batch", "--iterations", "1", "--connect", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiprobe: "), lines
    # CAP_BPF normally; "agent runs" when another session's agent happens to run on this host
    assert "CAP_BPF" in lines[0] or "agent runs" in lines[0]
