"""The real `aiprobe top` in a real terminal (tmux) and in batch mode, while real TCP traffic crosses a
veth pair: the flow shows up, `q` leaves a clean terminal and no BPF link or program behind, and with
an agent running top reads the agent instead of loading a second copy of the probes.

In-process runs go through `unshare --pid --fork --mount-proc`: top looks for a running `aiprobe agent`
in /proc before loading probes, and other sessions' agents on this shared machine must not be found."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import VethPair, free_port, link_ids, prog_ids, programs_on, wait_until
from servers import Agent

SINK = """
import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((ADDRESS, PORT))
server.listen()
conn, _ = server.accept()
while conn.recv(1 << 16):
    pass
"""

SENDER = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("sending", flush=True)
while True:
    conn.sendall(b"x" * 16384)
    time.sleep(0.02)
"""


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


@pytest.fixture
def traffic(veth: VethPair) -> Iterator[tuple[str, int]]:
    """TCP from the root namespace to a sink in the veth's namespace: (peer address, port), ~800 KiB/s,
    flowing once this yields (the sink's interpreter starts in its namespace first: seconds, beside a CI
    run's guests, where a `top --batch` of two refreshes was over before the sender connected)."""
    port = 20000 + secrets.randbelow(20000)
    sink = veth.ns_python(f"ADDRESS, PORT = {veth.peer_ip4!r}, {port}\n" + SINK)
    sender = subprocess.Popen([sys.executable, "-c", SENDER, veth.peer_ip4, str(port)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "sending"
        yield veth.peer_ip4, port
    finally:
        _stop(sender)
        _stop(sink)


def isolated(cmd: list[str]) -> list[str]:
    """`cmd` in its own PID namespace, where no other session's `aiprobe agent` is visible."""
    return ["unshare", "--pid", "--fork", "--mount-proc", *cmd]


def top_command(aiprobe_cli: list[str], *args: str) -> list[str]:
    # --connect to a port nobody listens on: an agent on the default port must not be picked up either
    return [*aiprobe_cli, "top", "--connect", f"127.0.0.1:{free_port()}", "--interval", "0.5", *args]


def has_flow(snapshot: dict, address: str, port: int) -> bool:
    return any(
        address in (flow["local_address"], flow["remote_address"]) and port in (flow["local_port"], flow["remote_port"])
        and flow["bytes"] > 0
        for flow in snapshot["flows"]
    )


def held_bpf_ids(pid: int) -> dict[str, set[int]]:
    """The BPF program and link ids `pid` holds open ({'prog_id': …, 'link_id': …}), from /proc fdinfo."""
    held: dict[str, set[int]] = {"prog_id": set(), "link_id": set()}
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return held  # exited
    for fd in fds:
        try:
            target = os.readlink(fd)
            info = (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text()
        except OSError:
            continue  # closed meanwhile
        kind = {"anon_inode:bpf-prog": "prog_id", "anon_inode:bpf_link": "link_id"}.get(target)
        for line in info.splitlines() if kind else []:
            if line.startswith(kind + ":"):
                held[kind].add(int(line.split()[1]))
    return held


def flows_programs_on(dev: str) -> set[str]:
    return programs_on(dev) & {"flows_ingress", "flows_egress", "flows_xdp"}


class Tmux:
    """A private tmux server (own socket) with one 80x24 pane running a bare shell."""

    def __init__(self) -> None:
        self.socket = f"aiprobe-top-{secrets.token_hex(4)}"
        self.tmux("new-session", "-d", "-x", "80", "-y", "24", "-s", "top",
                  "env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin TERM=xterm-256color PS1='$ ' bash --norc --noprofile")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def flag(self, name: str) -> str:
        return self.tmux("display-message", "-p", "-t", "top", f"#{{{name}}}").strip()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> str:
        """The screen once it shows `pattern` (a regular expression)."""
        found = wait_until(lambda: re.search(pattern, self.screen()), timeout=timeout, interval=0.2)
        assert found, (pattern, self.screen())
        return self.screen()

    def shell_pid(self) -> int:
        return int(self.flag("pane_pid"))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    terminal = Tmux()
    try:
        yield terminal
    finally:
        terminal.close()


def top_process(shell_pid: int) -> psutil.Process:
    """The `aiprobe top` python process under the pane's shell (below unshare when isolated)."""
    found: list[psutil.Process] = []

    def find() -> bool:
        found[:] = [p for p in psutil.Process(shell_pid).children(recursive=True)
                    if p.name() != "unshare" and "top" in p.cmdline()
                    and any(arg.endswith("aiprobe") for arg in p.cmdline())]
        return bool(found)

    assert wait_until(find, timeout=10)
    return found[0]


def run_top_in(tmux: Tmux, cmd: list[str]) -> psutil.Process:
    tmux.send(shlex.join(cmd) + "; echo top-exit=$?", "Enter")  # the command line reads "=$?", not "=<digits>"
    return top_process(tmux.shell_pid())


def show_flow(tmux: Tmux, peer: str) -> str:
    """Flows view, filtered to the peer address: the flow row is on screen."""
    tmux.wait_for("probes:")
    tmux.send("f")
    tmux.wait_for("LOCAL")
    tmux.send("/", peer, "Enter")
    tmux.wait_for(re.escape(f"filter “{peer}”"))
    return tmux.wait_for(re.escape(f"{peer}:"), timeout=20)


def quit_top(tmux: Tmux) -> str:
    tmux.send("q")
    screen = tmux.wait_for(r"top-exit=\d", timeout=20)
    assert "top-exit=0" in screen, screen
    return screen


def assert_terminal_clean(tmux: Tmux, screen: str) -> None:
    assert "probes:" not in screen  # the UI lived on the alternate screen, now gone
    assert tmux.flag("alternate_on") == "0"
    assert tmux.flag("cursor_flag") == "1"  # cursor visible again
    assert tmux.flag("mouse_any_flag") == "0" and tmux.flag("mouse_all_flag") == "0"
    tmux.send("echo still-$((40+2))", "Enter")  # the shell reads and echoes normally again
    tmux.wait_for("still-42", timeout=5)


@pytest.mark.bpf
@pytest.mark.timeout(120)
def test_top_in_tmux_shows_flow_and_q_leaves_clean_terminal_and_no_bpf(
    veth: VethPair, traffic: tuple[str, int], tmux: Tmux, aiprobe_cli: list[str]
) -> None:
    peer, _port = traffic
    top = run_top_in(tmux, isolated(top_command(aiprobe_cli, "--interfaces", veth.host)))
    tmux.wait_for("probes:")
    assert "in-process probes" in tmux.screen()
    held: dict[str, set[int]] = {}
    assert wait_until(lambda: held.update(held_bpf_ids(top.pid)) or held["link_id"], timeout=10)
    assert flows_programs_on(veth.host), "top attached no flows program to the test veth"

    screen = show_flow(tmux, peer)
    assert "flows:DOWN" not in screen
    assert_terminal_clean(tmux, quit_top(tmux))
    assert not held["link_id"] & link_ids(), "links top created survive it"
    assert not held["prog_id"] & prog_ids(), "programs top loaded survive it"
    assert flows_programs_on(veth.host) == set()


@pytest.mark.bpf
@pytest.mark.timeout(120)
def test_batch_json_emits_two_snapshots_with_the_flow(
    veth: VethPair, traffic: tuple[str, int], aiprobe_cli: list[str]
) -> None:
    peer, port = traffic
    result = subprocess.run(
        isolated(top_command(aiprobe_cli, "--interfaces", veth.host, "--batch", "--iterations", "2", "--json")),
        capture_output=True, text=True, timeout=90,
    )
    assert result.returncode == 0, result.stderr
    snapshots = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(snapshots) == 2
    for snapshot in snapshots:
        assert snapshot["probes"]["flows"]["up"], snapshot["probes"]["flows"]
        assert has_flow(snapshot, peer, port), snapshot["flows"]
    assert flows_programs_on(veth.host) == set()


@pytest.mark.bpf
@pytest.mark.timeout(150)
def test_top_reads_a_running_agent_without_loading_probes(
    veth: VethPair, traffic: tuple[str, int], tmux: Tmux, aiprobe_cli: list[str], tmp_path: Path
) -> None:
    peer, port = traffic
    with Agent(tmp_path, config=f'interfaces = ["{veth.host}"]\n') as agent:
        assert wait_until(lambda: has_flow(agent.snapshot(), peer, port), timeout=20)
        agent_progs = held_bpf_ids(agent.process.pid)["prog_id"]
        on_veth = flows_programs_on(veth.host)
        assert agent_progs and on_veth

        top = run_top_in(tmux, [*aiprobe_cli, "top", "--connect", agent.url, "--interval", "0.5"])
        show_flow(tmux, peer)
        assert f"agent {agent.url}" in tmux.screen()
        assert held_bpf_ids(top.pid) == {"prog_id": set(), "link_id": set()}, "top loaded BPF itself"
        assert held_bpf_ids(agent.process.pid)["prog_id"] == agent_progs
        assert flows_programs_on(veth.host) == on_veth
        quit_top(tmux)

        # told nothing (no agent on the address tried), top finds a running agent rather than load probes;
        # which agent is found is not asserted: other sessions' agents may run on this machine too
        # Output goes to files: four snapshots outgrow a pipe nobody reads while the loop below watches.
        out_path, err_path = tmp_path / "batch.out", tmp_path / "batch.err"
        with out_path.open("w") as out_file, err_path.open("w") as err_file:
            batch = subprocess.Popen(
                [*aiprobe_cli, "top", "--connect", f"127.0.0.1:{free_port()}", "--batch", "--iterations", "4",
                 "--json", "--interval", "0.5"],
                stdout=out_file, stderr=err_file, text=True,
            )
            held_by_batch: list[dict[str, set[int]]] = []
            while batch.poll() is None:
                held_by_batch.append(held_bpf_ids(batch.pid))
                time.sleep(0.1)
        assert batch.returncode == 0, err_path.read_text()
        assert len(out_path.read_text().splitlines()) == 4
        assert all(held == {"prog_id": set(), "link_id": set()} for held in held_by_batch)


@pytest.mark.bpf
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_top_killed_by_signal_restores_terminal_and_detaches(
    veth: VethPair, tmux: Tmux, aiprobe_cli: list[str], signum: int
) -> None:
    top = run_top_in(tmux, isolated(top_command(aiprobe_cli, "--interfaces", veth.host)))
    tmux.wait_for("probes:")
    held: dict[str, set[int]] = {}
    assert wait_until(lambda: held.update(held_bpf_ids(top.pid)) or held["link_id"], timeout=10)
    top.send_signal(signum)
    screen = tmux.wait_for(r"top-exit=\d", timeout=20)
    assert "top-exit=0" in screen, screen
    assert_terminal_clean(tmux, screen)
    assert not held["link_id"] & link_ids() and not held["prog_id"] & prog_ids()
    assert flows_programs_on(veth.host) == set()
