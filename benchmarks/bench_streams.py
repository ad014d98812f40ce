"""streams overhead, two ways, each within one run with cases alternating round by round:

1. The streaming server's throughput: the real SSE server (tests/fixtures/sse_server.py, Starlette
   on uvicorn) streams events as fast as it can to one reader; events/s with sendlat and the stream
   logic attached against nothing attached (the ratio is the figure).
2. The cost per streamed write: one accepted connection in a writer process making 64-byte sends of
   a response (every send is a chunk and a gap), its CPU time per send with nothing attached, with
   empty programs on the same two send hooks, with sendlat alone (stream logic off) and with
   sendlat and the stream logic on. Each case's added CPU per send, and the stream logic's own
   (streams on - sendlat alone) against the empty programs'.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import Result, alternate, attached, spread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from aiprobe.loader import Strategy  # noqa: E402
from aiprobe.probes.sendlat.probe import SPEC, SendLatencyProbe  # noqa: E402
from aiprobe.probes.sendlat.streams import StreamsProbe  # noqa: E402
from helpers import free_port  # noqa: E402

from benchmarks.bench_sendlat import FLOOR, REFERENCES  # noqa: E402
from benchmarks.bench_sendlat import Case as SendlatCase  # noqa: E402

SSE_SERVER = ROOT / "tests" / "fixtures" / "sse_server.py"
EVENTS = int(os.environ.get("STREAMS_BENCH_EVENTS", "3000"))
ROUNDS = int(os.environ.get("STREAMS_BENCH_ROUNDS", "8"))
BATCH = int(os.environ.get("STREAMS_BENCH_BATCH", "20000"))
WRITE_ROUNDS = int(os.environ.get("STREAMS_BENCH_WRITE_ROUNDS", "40"))
DEFAULT = next(s for s in SPEC.strategies if s.name == "tracepoint")

# A writer: accepts one connection, reads its request, then per line on stdin makes that many 64-byte
# sends on it and prints the thread's CPU time they took.
WRITER = """
import socket, sys, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.recv(100)
chunk = b"x" * 64
for line in sys.stdin:
    n = int(line)
    start = time.thread_time_ns()
    for _ in range(n):
        conn.send(chunk)
    print(time.thread_time_ns() - start, flush=True)
"""


@dataclass
class Case(SendlatCase):
    streams: StreamsProbe | None = None

    def close(self) -> None:
        if self.streams is not None:
            self.streams.close()
        if self.probe is not None:
            self.probe.close()


def _probe(strategy: Strategy, streams: bool) -> Case:
    host = SendLatencyProbe(strategies=[strategy], per_flow=False)
    host.start()
    case = Case(strategy.name, host)
    if streams:
        case.streams = StreamsProbe(host)
        case.streams.start()
    case.detach()
    return case


# --- 1. the SSE server's events/s ---

def _events_per_second(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.perf_counter()
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: bench\r\n\r\n")
        while not (data := sock.recv(1 << 16)).endswith(b"0\r\n\r\n") and data:
            pass
        return EVENTS / (time.perf_counter() - start)


def server_throughput(streaming: Case) -> list[Result]:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SSE_SERVER), str(port), "--events", str(EVENTS),
                               "--cadence-ms", "0", "--prefill-ms", "0"], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()
        # Each response's account (tests/fixtures/sse_server.py) is not needed here: drained unread.
        threading.Thread(target=server.stdout.read, daemon=True).start()
        _events_per_second(port)  # warm-up
        runs = alternate([Case("detached"), streaming], ROUNDS, lambda: _events_per_second(port))
    finally:
        server.terminate()
        server.wait(timeout=10)
    ratio = statistics.median(a / d for a, d in zip(runs[streaming.name], runs["detached"], strict=True))
    return [
        Result("streams", "SSE server, nothing attached: events/s", statistics.median(runs["detached"]), "events/s",
               spread(runs["detached"])),
        Result("streams", "SSE server, sendlat + streams attached: events/s", statistics.median(runs[streaming.name]),
               "events/s", spread(runs[streaming.name])),
        Result("streams", "SSE server events/s with / without the probe", ratio, "ratio",
               "median of per-round ratios; 1.0 = no slowdown"),
    ]


# --- 2. CPU per streamed write ---

class Writer:
    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        port = int(self._process.stdout.readline())
        self._reader = socket.create_connection(("127.0.0.1", port))
        self._reader.sendall(b"GET / HTTP/1.1\r\n\r\n")  # the request: what follows is its response
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while self._reader.recv(1 << 16):
            pass

    def cpu_ns_per_send(self) -> float:
        self._process.stdin.write(f"{BATCH}\n")
        self._process.stdin.flush()
        return int(self._process.stdout.readline()) / BATCH

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)
        self._reader.close()


def write_cost(cases: list[Case], streaming: Case) -> list[Result]:
    with attached(streaming):  # the connection is accepted while the stream logic watches
        writer = Writer()
        writer.cpu_ns_per_send()
    try:
        runs = alternate(cases, WRITE_ROUNDS, writer.cpu_ns_per_send)
    finally:
        writer.close()
    detached = runs.pop("detached")
    added = {name: [v - d for v, d in zip(values, detached, strict=True)] for name, values in runs.items()}
    own = [s - a for s, a in zip(added[streaming.name], added["sendlat alone"], strict=True)]
    floor = statistics.median(added[FLOOR])
    results = [Result("streams", "writer, nothing attached: CPU per send", statistics.median(detached), "ns",
                      spread(detached))]
    results += [Result("streams", f"writer, {name}: added CPU per send", statistics.median(values), "ns",
                       spread(values)) for name, values in added.items()]
    results += [
        Result("streams", "stream logic's own added CPU per send (streams on - sendlat alone)",
               statistics.median(own), "ns", spread(own)),
        Result("streams", "stream logic's own / empty programs' added CPU", statistics.median(own) / floor, "ratio",
               "per send of a streamed response (a chunk and a gap each)"),
    ]
    return results


def run() -> list[Result]:
    empty = _probe(REFERENCES[FLOOR], streams=False)
    empty.name = FLOOR
    alone = _probe(DEFAULT, streams=False)
    alone.name = "sendlat alone"
    streaming = _probe(DEFAULT, streams=True)
    streaming.name = "sendlat + streams"
    try:
        results = server_throughput(streaming)
        results += write_cost([Case("detached"), empty, alone, streaming], streaming)
    finally:
        for case in (empty, alone, streaming):
            case.close()
    return results
