"""Strategies per kernel: the one each probe must pick on each kernel of `make test-kernels` (and
this host), and every strategy of each chain forced once, through the config's `[strategies]` and
the commands' `--strategy`, where the kernel has its hook. The exactness tests of each strategy are
in the probes' own suites (tests/test_sendlat.py, test_flows.py, test_cuda.py), which force every
strategy of their chain the same way; streams runs inside sendlat's programs, so each of its
strategies is forced through sendlat's and shown counting a Server-Sent Events response here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
from aiprobe.config import Config, ConfigError, from_dict
from aiprobe.loader import ProbeUnavailable
from aiprobe.probes.flows.settings import FlowsSettings
from aiprobe.probes.sendlat.probe import SendLatencyProbe
from aiprobe.probes.sendlat.streams import StreamsProbe
from aiprobe.registry import Face, Probe, catalog, face, faces, owner, plans, selected, strategies_named
from exported_histograms import STREAM_HISTOGRAMS, assert_histograms_consistent
from fixtures.sendlat_peer import build, sender_cmd, sink
from helpers import PATIENCE, VethPair

# What each probe must pick, by kernel series (major, minor). Debian 12's kernels are what
# `make test-kernels` boots; 6.18 is CI's own host (no kprobes, fentry refused). streams runs in
# sendlat's programs (its strategy is sendlat's); sched in cuda's. nvml's one strategy needs a
# library, not a kernel (tests/test_nvml.py, test_least_privilege.py).
ALWAYS = {"cuda": "uprobe", "sched": "tp_btf", "netstat": "procfs"}
EXPECTED = {
    # no TCX before 6.6
    # connections on 5.10: no bpf_get_func_ret (5.17) for its fexit programs
    (5, 10): {"sendlat": "fentry", "streams": "fentry", "requests": "fentry", "flows": "clsact",
              "connections": "kprobe", **ALWAYS},
    # connections on 6.1: Debian's seven-argument tcp_v4_syn_recv_sock takes no trampoline
    (6, 1): {"sendlat": "fentry", "streams": "fentry", "requests": "fentry", "flows": "clsact",
             "connections": "kprobe", **ALWAYS},
    (6, 12): {"sendlat": "fentry", "streams": "fentry", "requests": "fentry", "flows": "tcx",
              "connections": "fentry", **ALWAYS},
    (6, 18): {"sendlat": "tracepoint", "streams": "tracepoint", "requests": "tracepoint", "flows": "tcx",
              "connections": "tracepoint", **ALWAYS},
}
FORCEABLE = [(name, strategy.name) for name in ("flows", "sendlat", "sched") for strategy in face(name).strategies]
SSE_EVENTS = 20
# How a kernel says it lacks a hook: no such BTF type or tracepoint (ESRCH, ENOENT), or a program
# type it refuses (fentry here: EPERM at load).
LACKS_HOOK = re.compile(r"No such process|No such file or directory|Operation not permitted")


def kernel_series() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", os.uname().release).groups()
    return int(major), int(minor)


@contextlib.contextmanager
def running_probes(config: Config) -> Iterator[dict[str, Face]]:
    """The config's probes, started through the registry's factories as the agent starts them, and
    the parts they run (streams may be unavailable under sendlat's strategy: kprobe), by name."""
    running: list[Probe] = []
    faces: dict[str, Face] = {}
    try:
        for probe_spec in selected(config.probes):
            probe = probe_spec.factory(config)
            probe.start()
            running.append(probe)
            faces.update({probe_spec.name: probe, **probe.parts()})
        yield faces
    finally:
        for probe in reversed(running):
            probe.close()


def probes_config(veth: VethPair, probes: tuple[str, ...] = ("flows", "sendlat", "cuda"), **strategies: str) -> Config:
    return Config(probes=probes, strategies=strategies).with_settings(
        FlowsSettings(interfaces=(veth.host,), exclude=()))


# ---- validated against the chain ----


def test_config_strategies_are_checked_against_each_probes_chain() -> None:
    assert from_dict({"strategies": {"sendlat": "kprobe", "sched": "raw_tp"}}, catalog()).strategies == \
        {"sendlat": "kprobe", "sched": "raw_tp"}
    for table, message in [
        ({"sendlat": "kprobes"}, "strategies.sendlat: sendlat has no strategy 'kprobes' "
                                 "(its chain: fentry, kprobe, tracepoint, syscall)"),
        ({"gpu": "x"}, "strategies.gpu: not a probe with a choice of strategies (those: "
                       + ", ".join(f.name for f in faces() if len(f.strategies) > 1 and not owner(f).follows(f))
                       + ")"),
        ({"streams": "fentry"}, "strategies.streams: streams runs on sendlat's strategy; set strategies.sendlat"),
        ({"flows": 1}, "strategies.flows: expected a string, got 1"),
    ]:
        with pytest.raises(ConfigError) as exc:
            from_dict({"strategies": table}, catalog())
        assert str(exc.value) == message


@pytest.mark.parametrize("command", ["sendlat", "flows", "cuda"])
def test_strategy_option_offers_the_chain_and_refuses_other_names(aiprobe_cli: list[str], command: str) -> None:
    chain = [s.name for s in face("sched" if command == "cuda" else command).strategies]
    result = subprocess.run([*aiprobe_cli, command, "--strategy", "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"'bogus' is not one of {', '.join(map(repr, chain))}" in result.stderr


# ---- on this kernel ----


@pytest.mark.bpf
def test_each_probe_picks_the_strategy_expected_on_this_kernel(veth: VethPair, kernel_features: dict) -> None:
    expected = EXPECTED.get(kernel_series())
    if expected is None:
        pytest.skip(f"no expectation for kernel {os.uname().release}: add its series to EXPECTED")
    # What `aiprobe check` offers, then what the agent's probes and their parts run.
    planned = {plan.probe: plan.strategy for plan in plans(kernel_features, Config())}
    assert {name: planned[name] for name in expected} == expected
    with running_probes(probes_config(veth, ("flows", "sendlat", "cuda", "connections"))) as running:
        assert {name: running[name].status().strategy for name in expected} == \
            expected


def skip_unless_the_kernel_has(probe: str, strategy: str, kernel_features: dict) -> None:
    [chosen] = [s for s in face(probe).strategies if s.name == strategy]
    missing = [name for name in chosen.features if not kernel_features[name].available]
    if missing:
        pytest.skip(f"{probe} {strategy}: this kernel lacks {', '.join(missing)}")


@pytest.mark.bpf
@pytest.mark.parametrize(("probe", "strategy"), FORCEABLE, ids=[f"{p}-{s}" for p, s in FORCEABLE])
def test_config_forces_each_strategy_of_the_chain(veth: VethPair, kernel_features: dict, probe: str,
                                                  strategy: str) -> None:
    skip_unless_the_kernel_has(probe, strategy, kernel_features)
    # Its own probe alone: the others' loads (sendlat's takes 15 s on an emulated 5.10) would show nothing here.
    try:
        with running_probes(probes_config(veth, (owner(face(probe)).name,), **{probe: strategy})) as running:
            assert running[probe].status().strategy == strategy
    except ProbeUnavailable as exc:
        reason = "; ".join(exc.reasons.values())
        if not LACKS_HOOK.search(reason):
            raise
        pytest.skip(f"{probe} {strategy}: this kernel lacks the hook ({reason[:200]})")


@pytest.mark.bpf
@pytest.mark.parametrize("strategy", [s.name for s in face("sendlat").strategies])
def test_sendlat_command_with_each_strategy_counts_every_send(aiprobe_cli: list[str], cbuild, kernel_features: dict,
                                                              strategy: str) -> None:
    skip_unless_the_kernel_has("sendlat", strategy, kernel_features)
    peer = build(cbuild)
    with sink(peer, "127.0.0.1") as to:
        sender = subprocess.Popen(sender_cmd(peer, to, 7, 300, "write", wait=True),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        cli = subprocess.Popen([*aiprobe_cli, "sendlat", "--strategy", strategy, "--pid", str(sender.pid),
                                "--duration", "3", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = cli.stderr.readline()
        if not started.startswith("Tracing TCP sends"):
            sender.kill()
            error = started + cli.communicate(timeout=PATIENCE)[1]
            assert cli.returncode == 1 and LACKS_HOOK.search(error), error
            pytest.skip(f"sendlat {strategy}: this kernel lacks the hook ({error.strip()[:200]})")
        sender.communicate("go\n", timeout=PATIENCE)
        out, err = cli.communicate(timeout=PATIENCE)
    assert cli.returncode == 0, err
    document = json.loads(out)
    assert document["strategy"] == strategy
    [process] = document["processes"]
    assert (process["pid"], process["count"], process["bytes"]) == (sender.pid, 7, 2100)


def serve_events(listener: socket.socket, events: int) -> None:
    """One HTTP/1.1 Server-Sent Events response, as inference servers write it: the request read,
    the headers alone, one write per event, chunked encoding's last chunk."""
    connection, _ = listener.accept()
    with connection:
        connection.recv(4096)
        connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                           b"transfer-encoding: chunked\r\n\r\n")
        for i in range(events):
            event = f"id: {i}\ndata: token\n\n".encode()
            connection.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        connection.sendall(b"0\r\n\r\n")


def read_response(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as client:
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
        response = b""
        while not response.endswith(b"0\r\n\r\n") and (data := client.recv(65536)):
            response += data
        return response


@pytest.mark.bpf
@pytest.mark.parametrize("strategy", [s.name for s in face("streams").strategies])
def test_streams_under_each_strategy_counts_every_chunk_of_a_response(kernel_features: dict, strategy: str) -> None:
    skip_unless_the_kernel_has("streams", strategy, kernel_features)
    sendlat = SendLatencyProbe(per_flow=False, strategies=strategies_named(face("sendlat"), strategy))
    with sendlat, StreamsProbe(sendlat) as streams, socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        server = threading.Thread(target=serve_events, args=(listener, SSE_EVENTS))
        server.start()
        response = read_response(port)
        server.join(timeout=PATIENCE)
        endpoints = [e for e in streams.read().endpoints if e.pid == os.getpid() and e.port == port]
        assert streams.status().strategy == strategy
    assert response.count(b"id: ") == SSE_EVENTS
    [endpoint] = endpoints
    # syscall reads no protocol (no message at syscall entry): every write of the response is a chunk.
    protocol, chunks = ("tcp", SSE_EVENTS + 2) if strategy == "syscall" else ("sse", SSE_EVENTS)
    assert (endpoint.protocol, endpoint.streams, endpoint.completed, endpoint.chunks, endpoint.gaps) == \
        (protocol, 1, 1, chunks, chunks - 1)
    assert_histograms_consistent([endpoint], observed=STREAM_HISTOGRAMS)
