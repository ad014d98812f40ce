"""NVML's events: critical Xid errors, and single- and double-bit ECC errors where a GPU gives them.
A thread waits on one NVML event set (1 s at a time, so that it stops within a second of the probe's
close) and counts each event by GPU, MIG instance and Xid; the last few are kept with what the Xid
means and what NVIDIA recommends doing about it. A GPU whose registration NVML refuses (some GPUs,
vGPUs and drivers) gives no events: a refusal line says so in the probe's status."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Protocol

import pynvml

from ...supervisor import SUPERVISOR
from .records import GpuEvent, GpuEventCount

log = logging.getLogger("aiprobe.nvml")

WAIT_MILLISECONDS = 1000
RECENT_EVENTS = 8
NO_INSTANCE = 0xFFFFFFFF  # an event's GPU or compute instance outside MIG

XID = "xid"
# Where and what: GpuEventCount's fields but the count.
EventKey = tuple[int, str, int | None, str, int | None, str, int | None]
EVENT_KINDS = {pynvml.nvmlEventTypeXidCriticalError: XID,
               pynvml.nvmlEventTypeSingleBitEccError: "single_bit_ecc",
               pynvml.nvmlEventTypeDoubleBitEccError: "double_bit_ecc"}
RESTART_APP = "restart the application (most likely its own error)"
RESET_GPU = "drain the GPU's work and reset the GPU"
# NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors): what a Xid means and what to do.
XIDS: dict[int, tuple[str, str]] = {
    13: ("graphics engine exception", RESTART_APP),
    31: ("GPU memory page fault", RESTART_APP),
    43: ("GPU stopped processing", RESTART_APP),
    45: ("preemptive cleanup after a previous error", "look at the Xid before it; none by itself"),
    48: ("double-bit ECC error", RESET_GPU),
    61: ("internal micro-controller breakpoint", RESET_GPU),
    62: ("internal micro-controller halt", RESET_GPU),
    63: ("ECC page retirement or row remapping recorded", "reset the GPU when convenient, to apply it"),
    64: ("ECC page retirement or row remapping failed", RESET_GPU + "; if it recurs, replace the GPU"),
    74: ("NVLink error", RESET_GPU + "; if it recurs, check the NVLink connections"),
    79: ("GPU has fallen off the bus", "drain the node and reboot it; check its power, PCIe and cooling"),
    92: ("high single-bit ECC error rate", "reset the GPU when convenient"),
    94: ("contained ECC error", "restart the affected applications; reset the GPU when convenient"),
    95: ("uncontained ECC error", RESET_GPU),
    119: ("GSP RPC timeout", RESET_GPU + "; if it recurs, drain the node and reboot it"),
    120: ("GSP error", RESET_GPU),
}
ECC_EVENTS = {"single_bit_ecc": ("single-bit ECC error (corrected)", "none; watch the GPU's ECC counts"),
              "double_bit_ecc": ("double-bit ECC error (uncorrected)", RESET_GPU)}
UNKNOWN = ("see NVIDIA's Xid catalog", "")


def meaning(kind: str, xid: int | None) -> tuple[str, str]:
    """What an event means and NVIDIA's recommended action."""
    return XIDS.get(xid, UNKNOWN) if kind == XID and xid is not None else ECC_EVENTS.get(kind, UNKNOWN)


class _Gpu(Protocol):
    """A GPU of the probe's, as far as its events need it (probe._Gpu)."""

    index: int
    uuid: str
    name: str
    handle: Any
    instances: dict[str, Any]  # its MIG instances (_Gpu) by UUID


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _instance_id(value: int) -> int | None:
    return None if value == NO_INSTANCE else value


def _profile(gpu: _Gpu, gpu_instance: int | None) -> str:
    return next((instance.name.rpartition(" MIG ")[2] for instance in gpu.instances.values()
                 if instance.instance_ids[0] == gpu_instance), "") if gpu_instance is not None else ""


class EventWatch:
    """The event set of the probe's GPUs and the thread waiting on it."""

    def __init__(self) -> None:
        self.refusals: list[str] = []  # a line per GPU without events, saying why
        self._set: Any = None
        self._gpus: dict[int, _Gpu] = {}  # by handle address
        self._counts: Counter[EventKey] = Counter()
        self._recent: deque[GpuEvent] = deque(maxlen=RECENT_EVENTS)
        self._last_xid: dict[str, int] = {}  # GPU uuid -> its last Xid
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures: set[str] = set()  # wait errors logged already

    def start(self, gpus: list[_Gpu]) -> None:
        try:
            self._set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self.refusals.append(f"no NVML event set ({exc}), so no Xid errors")
            return
        for gpu in gpus:
            self._register(gpu)
        if self._gpus:
            self._stop.clear()
            self._thread = SUPERVISOR.start_thread("nvml_events", self._wait_loop, self._stop)

    def _register(self, gpu: _Gpu) -> None:
        try:
            watched = pynvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & sum(EVENT_KINDS)
            if not watched & pynvml.nvmlEventTypeXidCriticalError:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pynvml.nvmlDeviceRegisterEvents(gpu.handle, watched, self._set)
        except pynvml.NVMLError as exc:
            self.refusals.append(f"GPU {gpu.index} ({gpu.name}): NVML refused its events ({exc}), so no Xid errors")
            return
        self._gpus[_address(gpu.handle)] = gpu

    def _wait_loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(self._set, WAIT_MILLISECONDS)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                    self._failed(str(exc))
                continue
            self._record(data)

    def _failed(self, error: str) -> None:
        """A failed wait (a lost GPU may fail it): logged once, tried again a second later."""
        if error not in self._failures:
            self._failures.add(error)
            log.warning("nvml: waiting for events failed: %s", error)
        self._stop.wait(WAIT_MILLISECONDS / 1000)

    def _record(self, data: Any) -> None:
        gpu = self._gpus.get(_address(data.device))
        kind = EVENT_KINDS.get(data.eventType)
        if gpu is None or kind is None:
            return
        xid = int(data.eventData) if kind == XID else None
        gpu_instance, compute_instance = _instance_id(data.gpuInstanceId), _instance_id(data.computeInstanceId)
        where = (gpu.index, gpu.uuid, gpu_instance, _profile(gpu, gpu_instance), compute_instance)
        event = GpuEvent(time.time(), *where, kind, xid, *meaning(kind, xid))
        with self._lock:
            self._counts[(*where, kind, xid)] += 1
            self._recent.append(event)
            if xid is not None:
                self._last_xid[gpu.uuid] = xid

    def counts(self) -> list[GpuEventCount]:
        with self._lock:
            return [GpuEventCount(*key, count) for key, count in self._counts.items()]

    def recent(self) -> list[GpuEvent]:
        with self._lock:
            return list(self._recent)

    def last_xid(self, uuid: str) -> int | None:
        with self._lock:
            return self._last_xid.get(uuid)

    def close(self) -> None:
        """Stops the thread (within a wait's second), then frees the set: before nvmlShutdown."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self._set is not None:
            pynvml.nvmlEventSetFree(self._set)
            self._set = None
        self._gpus = {}
