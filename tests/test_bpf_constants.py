"""The C constants user space needs come from the objects' BTF (read from the files: nothing is loaded):
the label values stay the ones exported, each enum sizes the array it indexes, and a module that
declares them imports without built objects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiprobe.histogram import hist_slots, kernel_buckets
from aiprobe.loader import object_btf
from aiprobe.probes.flows.probe import DIRECTIONS
from aiprobe.probes.sendlat.probe import SEND_ERRORS
from aiprobe.probes.sendlat.records import CAUSES, PROTOCOLS


def test_label_values_are_the_ones_exported() -> None:
    assert tuple(SEND_ERRORS) == ("EAGAIN", "EPIPE", "ECONNRESET", "EINTR", "ETIMEDOUT", "ENOTCONN", "other")
    assert tuple(PROTOCOLS) == ("tcp", "http", "sse", "http2", "grpc", "tls")
    assert tuple(CAUSES) == ("server", "network", "cpu", "gpu")
    assert tuple(DIRECTIONS) == ("ingress", "egress")


def test_each_enum_sizes_the_array_it_indexes() -> None:
    sendlat = object_btf("sendlat")
    assert len(SEND_ERRORS) == sendlat.array_length("sendlat_proc_stats", "errors")
    assert len(CAUSES) == sendlat.array_length("stream_stats", "stalls")
    assert sendlat.enum_names("stream_protocol")[-1] == "STREAM_PROTOCOL_MAX"
    assert len(PROTOCOLS) == len(sendlat.enum_names("stream_protocol")) - 1


def test_every_object_has_the_histogram_the_decoder_reads() -> None:
    assert {object_btf(name).array_length("hist", "slots") for name in ("sendlat", "cuda")} == {hist_slots()}
    # The last bounded slot ends where the open one starts: 2^16 ms (bpf/hist.h, HIST_MAX_NS).
    assert kernel_buckets([0] * hist_slots())[-2][0] == 65.536


def test_modules_import_without_built_objects_and_say_so_when_used(tmp_path: Path) -> None:
    env = {**os.environ, "AIPROBE_BPF_DIR": str(tmp_path)}
    imports = ("import aiprobe.cli, aiprobe.daemon, aiprobe.histogram, aiprobe.registry\n"
               "aiprobe.registry.specs()")
    subprocess.run([sys.executable, "-c", imports], env=env, check=True)
    use = "from aiprobe.probes.sendlat.records import CAUSES\nlen(CAUSES)"
    used = subprocess.run([sys.executable, "-c", use], env=env, capture_output=True, text=True)
    assert used.returncode != 0
    assert f"BPF object {tmp_path}/sendlat.bpf.o is missing; build it with `make bpf`" in used.stderr


@pytest.mark.parametrize(("struct", "member"), [("hist", "count"), ("hist", "nothing")])
def test_array_length_refuses_what_is_not_an_array(struct: str, member: str) -> None:
    with pytest.raises((TypeError, KeyError)):
        object_btf("sendlat").array_length(struct, member)
