"""Per-flow throughput: XDP on ingress, tc on egress (bpf/flows.bpf.c)."""

from .loader import Strategy
from .probes import ProbeSpec

SPEC = ProbeSpec(
    name="flows",
    description="per-flow bytes and packets: XDP ingress, tc egress",
    strategies=(
        Strategy("xdp+tcx", features=("xdp_link", "tcx"), span="L2 frames at XDP (ingress) and tc (egress)"),
        Strategy("xdp+clsact", features=("xdp_link", "tc_clsact"),
                 span="L2 frames at XDP (ingress) and tc clsact (egress)"),
    ),
)
