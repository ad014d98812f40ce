"""TCP send latency: duration of each tcp_sendmsg call (bpf/sendlat.bpf.c)."""

from .loader import Strategy
from .probes import ProbeSpec

SPEC = ProbeSpec(
    name="sendlat",
    description="tcp_sendmsg latency per process, container and flow",
    strategies=(
        Strategy("fentry", features=("fentry",), span="tcp_sendmsg entry to return (fentry/fexit)"),
        Strategy("kprobe", features=("kprobe",), span="tcp_sendmsg entry to return (kprobe/kretprobe)"),
        Strategy("tracepoint", features=("tp_btf", "tracepoint"),
                 span="send syscall entry to exit, for calls that reached a TCP socket"),
    ),
)
