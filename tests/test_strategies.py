"""Strategies per kernel: the one each probe must pick on each kernel of `make test-kernels` (and
this host), and every strategy of each chain forced once, through the config's `[strategies]` and
the commands' `--strategy`, where the kernel has its hook. The exactness tests of each strategy are
in the probes' own suites (tests/test_sendlat.py, test_flows.py, test_cuda.py), which force every
strategy of their chain the same way."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator

import pytest
from aiprobe.config import Config, ConfigError, from_dict
from aiprobe.loader import ProbeUnavailable
from aiprobe.probes import Probe, selected, spec, specs
from conftest import VethPair
from fixtures.sendlat_peer import build, sender_cmd, sink

# What each probe must pick, by kernel series (major, minor). Debian 12's kernels are what
# `make test-kernels` boots; 6.18 is CI's own host (no kprobes, fentry refused).
EXPECTED = {
    (6, 1): {"sendlat": "fentry", "flows": "clsact", "sched": "tp_btf"},  # no TCX before 6.6
    (6, 12): {"sendlat": "fentry", "flows": "tcx", "sched": "tp_btf"},
    (6, 18): {"sendlat": "tracepoint", "flows": "tcx", "sched": "tp_btf"},
}
FORCEABLE = [(name, strategy.name) for name in ("flows", "sendlat", "sched") for strategy in spec(name).strategies]
# How a kernel says it lacks a hook: no such BTF type or tracepoint (ESRCH, ENOENT), or a program
# type it refuses (fentry here: EPERM at load).
LACKS_HOOK = re.compile(r"No such process|No such file or directory|Operation not permitted")


def kernel_series() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", os.uname().release).groups()
    return int(major), int(minor)


@contextlib.contextmanager
def running_probes(config: Config) -> Iterator[dict[str, Probe]]:
    """The config's probes, started through the registry's factories as the agent starts them."""
    running: dict[str, Probe] = {}
    try:
        for probe_spec in selected(config.probes):
            probe = probe_spec.factory(config, running)
            running[probe_spec.name] = probe
            probe.start()
        yield running
    finally:
        for probe in reversed(running.values()):
            probe.close()


def probes_config(veth: VethPair, **strategies: str) -> Config:
    return Config(interfaces=(veth.host,), exclude=(), probes=("flows", "sendlat", "cuda"), strategies=strategies)


# ---- validated against the chain ----


def test_config_strategies_are_checked_against_each_probes_chain() -> None:
    assert from_dict({"strategies": {"sendlat": "kprobe", "sched": "raw_tp"}}).strategies == \
        {"sendlat": "kprobe", "sched": "raw_tp"}
    for table, message in [
        ({"sendlat": "kprobes"}, "strategies.sendlat: sendlat has no strategy 'kprobes' "
                                 "(its chain: fentry, kprobe, tracepoint, syscall)"),
        ({"gpu": "x"}, "strategies.gpu: not a probe with a choice of strategies (those: "
                       + ", ".join(s.name for s in specs() if len(s.strategies) > 1) + ")"),
        ({"flows": 1}, "strategies.flows: expected a string, got 1"),
    ]:
        with pytest.raises(ConfigError) as exc:
            from_dict({"strategies": table})
        assert str(exc.value) == message


@pytest.mark.parametrize("command", ["sendlat", "flows", "cuda"])
def test_strategy_option_offers_the_chain_and_refuses_other_names(aiprobe_cli: list[str], command: str) -> None:
    chain = [s.name for s in spec("sched" if command == "cuda" else command).strategies]
    result = subprocess.run([*aiprobe_cli, command, "--strategy", "bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"'bogus' is not one of {', '.join(map(repr, chain))}" in result.stderr


# ---- on this kernel ----


@pytest.mark.bpf
def test_each_probe_picks_the_strategy_expected_on_this_kernel(veth: VethPair) -> None:
    expected = EXPECTED.get(kernel_series())
    if expected is None:
        pytest.skip(f"no expectation for kernel {os.uname().release}: add its series to EXPECTED")
    with running_probes(probes_config(veth)) as running:
        assert {name: running[name].status().strategy for name in expected} == expected


def skip_unless_the_kernel_has(probe: str, strategy: str, kernel_features: dict) -> None:
    [chosen] = [s for s in spec(probe).strategies if s.name == strategy]
    missing = [name for name in chosen.features if not kernel_features[name].available]
    if missing:
        pytest.skip(f"{probe} {strategy}: this kernel lacks {', '.join(missing)}")


@pytest.mark.bpf
@pytest.mark.parametrize(("probe", "strategy"), FORCEABLE, ids=[f"{p}-{s}" for p, s in FORCEABLE])
def test_config_forces_each_strategy_of_the_chain(veth: VethPair, kernel_features: dict, probe: str,
                                                  strategy: str) -> None:
    skip_unless_the_kernel_has(probe, strategy, kernel_features)
    try:
        with running_probes(probes_config(veth, **{probe: strategy})) as running:
            assert running[probe].status().strategy == strategy
    except ProbeUnavailable as exc:
        reason = "; ".join(exc.reasons.values())
        if not LACKS_HOOK.search(reason):
            raise
        pytest.skip(f"{probe} {strategy}: this kernel lacks the hook ({reason[:200]})")


@pytest.mark.bpf
@pytest.mark.parametrize("strategy", [s.name for s in spec("sendlat").strategies])
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
            error = started + cli.communicate(timeout=60)[1]
            assert cli.returncode == 1 and LACKS_HOOK.search(error), error
            pytest.skip(f"sendlat {strategy}: this kernel lacks the hook ({error.strip()[:200]})")
        sender.communicate("go\n", timeout=30)
        out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    document = json.loads(out)
    assert document["strategy"] == strategy
    [process] = document["processes"]
    assert (process["pid"], process["count"], process["bytes"]) == (sender.pid, 7, 2100)
