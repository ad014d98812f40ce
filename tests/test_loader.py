"""The libbpf loader against the real kernel: load, configure, attach, read maps, poll ring buffers,
fall back between strategies, and leave nothing behind after close."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess

import pytest
from aiprobe.features import libc_path
from aiprobe.libbpf import BpfError
from aiprobe.loader import BpfObject, ProbeUnavailable, Strategy, load_first
from aiprobe.probes.sendlat.probe import place_state
from helpers import fd_id, link_ids, prog_ids, wait_until

pytestmark = pytest.mark.bpf


def _count(obj: BpfObject) -> int:
    return obj.maps["hits"].lookup(0).value


def test_sched_switch_counter_attaches_counts_and_leaves_nothing() -> None:
    with BpfObject("features", programs=["probe_tp_btf"]) as obj:
        obj.load()
        link = obj.programs["probe_tp_btf"].attach()
        prog_id = fd_id(obj.programs["probe_tp_btf"].fd, "prog_id")
        link_id = fd_id(link.fd, "link_id")
        assert prog_id in prog_ids()
        assert link_id in link_ids()
        assert wait_until(lambda: _count(obj) > 0), "sched_switch never counted"
    # Programs are freed after an RCU grace period, so "gone" is checked with a short wait.
    assert wait_until(lambda: prog_id not in prog_ids() and link_id not in link_ids())


def test_rodata_configures_programs_before_load() -> None:
    with BpfObject("features", programs=["probe_tp_btf"]) as obj:
        obj.set_rodata(hit_increment=7)
        obj.load()
        obj.programs["probe_tp_btf"].attach()
        assert wait_until(lambda: _count(obj) > 0)
        assert _count(obj) % 7 == 0
        with pytest.raises(RuntimeError):
            obj.set_rodata(hit_increment=1)
    with BpfObject("features") as obj, pytest.raises(KeyError):
        obj.set_rodata(no_such_variable=1)


def test_map_operations_and_batch_lookup() -> None:
    with BpfObject("features", programs=["probe_raw_tp"]) as obj:
        obj.load()
        hits = obj.maps["hits"]
        hits.update(0, 41)
        assert hits.lookup(0).value == 41
        assert [(k.value, v.value) for k, v in hits.items()] == [(0, 41)]
        assert [k.value for k in hits.keys()] == [0]
        with pytest.raises(BpfError) as err:
            hits.update(5, 1)  # beyond max_entries of the array
        assert err.value.errno == 7  # E2BIG


def test_batch_lookup_of_big_values_takes_several_batches_and_misses_nothing() -> None:
    """sendlat's `unwritable` holds 3.5 KiB histograms: a batch's buffer is bounded, so 700 entries
    take several batches."""
    with BpfObject("sendlat", programs=[]) as obj:  # its maps alone: no hook every kernel has
        place_state(obj)  # thread and socket storage where the kernel has them for tracing programs
        obj.load()
        waits = obj.maps["unwritable"]
        for index in range(700):
            value = waits.value_type()
            value.count, value.slots[index % 433] = index, 1
            waits.update(index, value)
        entries = {key.value: value for key, value in waits.items()}
        assert sorted(entries) == list(range(700))
        assert all(value.count == index and value.slots[index % 433] == 1 for index, value in entries.items())


def test_array_ranges_read_what_lookups_read() -> None:
    """sendlat's `procs` read by ranges (one batch lookup each, or where the kernel refuses batches one
    lookup per index) holds, row for row, what a lookup of each index returns: at the start, inside, at
    the end of the array."""
    with BpfObject("sendlat", programs=[]) as obj:
        place_state(obj)
        obj.load()
        procs = obj.maps["procs"]
        for index in (0, 1, 700, procs.max_entries - 1):
            value = procs.value_type()
            value.bytes, value.latency.slots[index % 433] = index + 1, 7
            procs.update(index, value)
        for first, count in ((0, 3), (699, 2), (procs.max_entries - 2, 2)):
            expected = [bytes(procs.lookup(index)) for index in range(first, first + count)]
            assert [row.tobytes() for row in procs.array_range(first, count)] == expected
            procs._batch_ok = False  # as on a kernel without batch lookups
            assert [row.tobytes() for row in procs.array_range(first, count)] == expected
            procs._batch_ok = True


def test_uprobe_events_arrive_through_ring_buffer() -> None:
    events: list[dict] = []
    with BpfObject("features", programs=["probe_uprobe"]) as obj:
        obj.load()
        obj.programs["probe_uprobe"].attach_uprobe(libc_path(), "getpid", pid=os.getpid())
        event_type = obj.btf.struct_ctype("feature_event")
        ring = obj.ring_buffer("events", lambda raw: events.append(event_type.from_buffer_copy(raw)))
        libc = ctypes.CDLL(None)
        for _ in range(3):
            libc.getpid()
        consumed: list[int] = []
        assert wait_until(lambda: consumed.append(ring.poll(50)) or len(events) >= 3)
        assert sum(consumed) == len(events), "poll() returns the records it handed to the callback"
    assert {e.pid for e in events} == {os.getpid()}
    assert [e.hits for e in events][:3] == [1, 2, 3]


def test_verifier_log_is_available_on_demand() -> None:
    with BpfObject("features", programs=["probe_raw_tp"], verifier_log=2) as obj:
        obj.load()
        assert "processed" in obj.programs["probe_raw_tp"].verifier_log


def test_fallback_chain_keeps_first_working_strategy_and_reasons() -> None:
    strategies = [
        Strategy("kprobe", ("probe_kprobe",)),
        Strategy("no-such-tracepoint", ("probe_tracepoint",)),
        Strategy("tp_btf", ("probe_tp_btf",)),
        Strategy("raw_tp", ("probe_raw_tp",)),
    ]

    def attach(obj: BpfObject, strategy: Strategy) -> None:
        if strategy.name == "no-such-tracepoint":
            raise BpfError(2, "attach no-such-tracepoint")
        obj.programs[strategy.programs[0]].attach()

    kprobe_works = subprocess.run(["test", "-e", "/sys/bus/event_source/devices/kprobe"]).returncode == 0
    loaded = load_first("test", "features", strategies, attach=attach)
    try:
        if kprobe_works:
            assert loaded.strategy.name == "kprobe"
        else:
            assert loaded.strategy.name == "tp_btf"
            assert set(loaded.skipped) == {"kprobe", "no-such-tracepoint"}
            assert "No such file" in loaded.skipped["kprobe"]
    finally:
        loaded.obj.close()

    with pytest.raises(ProbeUnavailable) as exc:
        load_first("test", "features", [Strategy("no-such-tracepoint", ("probe_tracepoint",))], attach=attach)
    assert "no-such-tracepoint" in str(exc.value)


def test_xdp_and_tcx_links_count_traffic_and_detach(veth, tc_kind: str) -> None:
    if tc_kind != "tcx":
        pytest.skip("this kernel has no TCX (6.6+)")
    before_links = link_ids()
    with BpfObject("features", programs=["probe_xdp", "probe_tc"]) as obj:
        obj.load()
        obj.programs["probe_xdp"].attach_xdp(veth.host_ifindex)
        obj.programs["probe_tc"].attach_tcx(veth.host_ifindex, "egress")
        assert len(link_ids() - before_links) == 2
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(3):
                sock.sendto(b"x", (veth.peer_ip4, 9))
        # Egress (tc): ARP request and 3 datagrams; ingress (XDP): ARP reply, ICMP unreachables.
        assert wait_until(lambda: _count(obj) >= 5)
    assert link_ids() - before_links == set()
    net = subprocess.run(["bpftool", "net", "show", "dev", veth.host], capture_output=True, text=True).stdout
    assert "probe_" not in net


def test_test_run_executes_program_on_a_frame() -> None:
    with BpfObject("features", programs=["probe_xdp"]) as obj:
        obj.load()
        frame = bytes(12) + struct.pack("!H", 0x0800) + bytes(46)
        result = obj.programs["probe_xdp"].test_run(frame, repeat=10)
        assert result.retval == 2  # XDP_PASS
        assert _count(obj) == 10


def test_libbpf_errors_quote_their_own_threads_log() -> None:
    """libbpf's log is per thread: threads failing at once each quote the log of their own call."""
    from concurrent.futures import ThreadPoolExecutor

    from aiprobe import libbpf

    def fail(index: int) -> str:
        messages = []
        for _ in range(20):
            try:
                libbpf.new_ptr("bpf_object__open_file", f"/nonexistent/aiprobe-thread-{index}.o".encode(), None)
            except BpfError as exc:
                messages.append(exc.libbpf_log)
        return "\n".join(messages)

    with ThreadPoolExecutor(4) as pool:
        logs = list(pool.map(fail, range(4)))
    for index, text in enumerate(logs):
        others = [f"aiprobe-thread-{other}.o" for other in range(4) if other != index]
        assert f"aiprobe-thread-{index}.o" in text and not any(name in text for name in others), text[:500]


def test_the_kernels_own_enotsupp_is_named() -> None:
    """524 is the kernel's ENOTSUPP (a trampoline on a function with more arguments than the arch takes),
    which strerror calls "Unknown error 524"."""
    assert "ENOTSUPP" in str(BpfError(524, "bpf_program__attach"))
    assert str(BpfError(1, "bpf_object__load")) == "bpf_object__load: Operation not permitted"
