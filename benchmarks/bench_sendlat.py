"""sendlat overhead: a loopback TCP send loop (C, 64-byte send() calls) with the probe attached vs
detached, alternating within one run. The probe runs unfiltered, as the agent runs it, so the
figure includes its programs on every syscall of the host (sys_enter) and on the receiver's side."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import Result

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the C peer and its build live with the test fixtures

from aiprobe.sendlat import SendLatencyProbe  # noqa: E402
from conftest import FIXTURE_BUILD, CBuild  # noqa: E402
from fixtures.sendlat_peer import build, send, sink  # noqa: E402

SENDS = 1_000_000
SIZE = 64
ROUNDS = 3


def _throughput(peer: str) -> float:
    """Sends per second of one sender process, by its own clock."""
    with sink(peer, "127.0.0.1") as to:
        sent = send(peer, to, SENDS, SIZE)
    return sent.calls / sent.elapsed_seconds


def _attached_throughput(peer: str) -> tuple[float, str]:
    with SendLatencyProbe() as probe:
        return _throughput(peer), probe.strategy or ""


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    peer = build(CBuild(FIXTURE_BUILD))
    _throughput(peer)  # warm-up: page cache, CPU frequency
    ratios, detached, attached, strategy = [], [], [], ""
    for round_ in range(ROUNDS):
        # Alternate the order so a drift in machine load does not favour one side.
        if round_ % 2:
            (with_probe, strategy), without = _attached_throughput(peer), _throughput(peer)
        else:
            without, (with_probe, strategy) = _throughput(peer), _attached_throughput(peer)
        detached.append(without)
        attached.append(with_probe)
        ratios.append(with_probe / without)
    ratio = statistics.median(ratios)
    detail = (f"{strategy}; {SENDS} x {SIZE} B sends, median of {ROUNDS}; "
              f"detached {statistics.median(detached):,.0f}/s, attached {statistics.median(attached):,.0f}/s")
    added_ns = (1 / statistics.median(attached) - 1 / statistics.median(detached)) * 1e9
    return [
        Result("sendlat", "loopback send throughput attached/detached", ratio, "ratio", detail),
        Result("sendlat", "overhead", (1 - ratio) * 100, "%", "target <= 3%"),
        Result("sendlat", "added time per send", added_ns, "ns"),
    ]
