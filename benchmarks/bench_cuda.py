"""CUDA uprobe overhead: the fake driver calls cuLaunchKernel in a tight loop, timed by its own clock,
with the probe attached vs detached, alternating within one run. Each probed call traps into the
kernel (uprobe breakpoint) and runs one hash lookup and one increment, so the added cost is per
call and independent of how many processes or libraries are probed."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import Result

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fake libcuda and its driver live with the test fixtures

from aiprobe.cuda import CudaProbe  # noqa: E402
from conftest import FIXTURE_BUILD, CBuild  # noqa: E402
from fixtures.cuda_fake import Driver, build  # noqa: E402

CALLS_DETACHED = 5_000_000
CALLS_ATTACHED = 200_000  # each probed call costs a trap: fewer calls for a similar run time
ROUNDS = 3


def _ns_per_call(libdir: Path, calls: int) -> float:
    return float(Driver(libdir, "bench", calls).go().split()[1])


def _attached_ns_per_call(libdir: Path) -> float:
    with CudaProbe() as probe:
        driver = Driver(libdir, "bench", CALLS_ATTACHED)
        while not any(lib.path == driver.library for lib in probe.libraries):
            probe.rescan()
        return float(driver.go().split()[1])


def run() -> list[Result]:
    FIXTURE_BUILD.mkdir(parents=True, exist_ok=True)
    libdir, _ = build(CBuild(FIXTURE_BUILD))
    _ns_per_call(libdir, CALLS_DETACHED)  # warm-up: page cache, CPU frequency
    detached, attached = [], []
    for round_ in range(ROUNDS):
        # Alternate the order so a drift in machine load does not favour one side.
        if round_ % 2:
            attached.append(_attached_ns_per_call(libdir))
            detached.append(_ns_per_call(libdir, CALLS_DETACHED))
        else:
            detached.append(_ns_per_call(libdir, CALLS_DETACHED))
            attached.append(_attached_ns_per_call(libdir))
    without, with_probe = statistics.median(detached), statistics.median(attached)
    added = with_probe - without
    detail = f"median of {ROUNDS}; {CALLS_DETACHED:,} calls detached, {CALLS_ATTACHED:,} attached"
    return [
        Result("cuda", "cuLaunchKernel detached", without, "ns/call", detail),
        Result("cuda", "cuLaunchKernel attached", with_probe, "ns/call", detail),
        Result("cuda", "added per probed call", added, "ns/call"),
        *(
            Result("cuda", f"cost at {rate // 1000}k launches/s", added * rate / 1e9 * 100, "% of one CPU")
            for rate in (10_000, 100_000)
        ),
    ]
