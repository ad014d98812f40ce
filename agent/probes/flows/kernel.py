"""The kernel's flow table as user space reads and changes it (bpf/flows.bpf.c): `flows` maps each
flow's key to its slot in `flow_counts`, the array of counters; a flow user space deletes gives its
slot back, zeroed (a socket or a hint that cached the slot then finds another key there), through `free_slots`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ...loader import BpfObject, Map


def size_flow_table(obj: BpfObject, entries: int) -> None:
    """Before load: room for `entries` flows in each of the table's maps."""
    for name in ("flows", "flow_counts", "free_slots"):
        obj.maps[name].max_entries = entries
    obj.set_rodata(max_flow_slots=entries)


class KernelFlows:
    """The flow table of a loaded flows object."""

    def __init__(self, obj: BpfObject) -> None:
        self.slots: Map = obj.maps["flows"]
        self.counts: Map = obj.maps["flow_counts"]
        self._free: Map = obj.maps["free_slots"]

    @property
    def key_type(self) -> Any:
        return self.slots.key_type

    @property
    def value_type(self) -> Any:
        return self.counts.value_type

    def read(self, value_dtype: np.dtype[Any]) -> tuple[bytes, npt.NDArray[Any]]:
        """Every flow: its raw keys, one after another, and their counters (as `value_dtype`, in that order)."""
        keys, indexes = [], []
        for count, raw_keys, raw_slots in self.slots.raw_items():
            keys.append(bytes(memoryview(raw_keys).cast("B")[:count * self.slots.key_size]))
            indexes.append(np.frombuffer(raw_slots, np.uint32, count).copy())
        if not keys:
            return b"", np.zeros(0, value_dtype)
        index = np.concatenate(indexes)
        # Slots in use are few beyond the most flows the table held at once: one batch reads them all.
        rows = self.counts.array_range(0, int(index.max()) + 1)
        return b"".join(keys), rows.view(value_dtype).reshape(-1)[index]

    def lookup(self, key: Any) -> Any:
        """The flow's counters (a ctypes struct), None where the table lacks it."""
        index = self.slots.lookup(key)
        return None if index is None else self.counts.lookup(index)

    def pop(self, key: Any) -> Any:
        """Delete the flow, returning its counters as they were then (None where the table lacked it),
        and give its slot back, zeroed."""
        index = self.slots.pop(key)
        if index is None:
            return None
        final = self.counts.lookup(index)
        self.counts.update(index, self.value_type())
        self._free.push(index)
        return final

    def items(self) -> list[tuple[Any, Any]]:
        """Every (key, counters), as ctypes structs."""
        return [(key, self.counts.lookup(index)) for key, index in self.slots.items()]
