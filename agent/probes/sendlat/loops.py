"""Which build of sendlat's object this kernel runs: the one whose walks loop with bpf_loop (5.17), or,
where programs may not call it, the same programs built with bounded loops (bpf/loop.h), whose walks
stop sooner. A kernel without bpf_loop refuses the first whole, so the choice is the object's."""

from __future__ import annotations

from ... import libbpf
from ...features import helper_available
from ...loader import object_btf

OBJECT = "sendlat"
BOUNDED_OBJECT = f"{OBJECT}_bounded"
# enum walk_bound (bpf/streams_programs.h): what each walk reads at most.
_WALKS = {
    "WALK_H2_FRAMES": "HTTP/2 frames per read or write",
    "WALK_HPACK_FIELDS": "fields per header block",
    "WALK_WRITE_STREAMS": "streams timed per write",
}


def has_bpf_loop() -> bool:
    """Whether programs may call bpf_loop here (tried: the helper's load, by libbpf)."""
    return helper_available(libbpf.BPF_PROG_TYPE_RAW_TRACEPOINT, libbpf.BPF_FUNC_LOOP)


def object_name() -> str:
    """The build of sendlat's object this kernel runs."""
    return OBJECT if has_bpf_loop() else BOUNDED_OBJECT


def bounded_walks() -> list[str]:
    """Where the bounded build runs, what its walks read at most, against the bpf_loop build."""
    if has_bpf_loop():
        return []
    looped, bounded = (object_btf(name).enum_values("walk_bound") for name in (OBJECT, BOUNDED_OBJECT))
    walks = ", ".join(f"{bounded[key]} {what} (not {looped[key]})" for key, what in _WALKS.items())
    return [f"no bpf_loop (5.17): bounded loops read at most {walks}; beyond them a write's HTTP/2 statuses "
            "and stream ends are not seen, and the connection's later dynamic header fields are unknown"]
