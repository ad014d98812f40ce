"""What the flows probe keeps of the kernel's flow table between reads, in numpy arrays: one slot
per flow, so a read costs Python work only for the flows that changed (a dictionary lookup each)
and array operations for the rest, however many flows the table holds.

A read hands `FlowTable.update()` each raw batch of the table (struct flow_key / flow_counters as
the kernel wrote them). Entries whose last_seen is older than the read's `since` are skipped
without a Python object; the changed ones update their slot's counters, the interface sums (by
their increase) and the read's record of changes, from which rates are taken: the counters as of
the baseline read are kept per slot, moved on as the baseline does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

# Fields of struct flow_key and struct flow_counters that user space reads.
KEY_FIELDS = ("ifindex", "direction", "family", "protocol", "local_port", "remote_port", "local_addr", "remote_addr")
VALUE_FIELDS = ("packets", "bytes", "first_seen_ns", "last_seen_ns", "cgroup_id", "tcp_syn", "tcp_fin", "tcp_rst")
# What interface totals sum over flows (InterfaceTotals' fields, struct flow_counters' names).
SUMMED = ("bytes", "packets", "tcp_syn", "tcp_fin", "tcp_rst")
_INITIAL_SLOTS = 1024

Slots = npt.NDArray[np.int64]
Where = tuple[int, int]  # (ifindex, direction)


def raw_keys(keys: memoryview, size: int, entries: npt.NDArray[np.intp]) -> list[bytes]:
    """These entries of a raw batch of keys, each as bytes (made in C, not one slice at a time)."""
    picked: list[bytes] = np.frombuffer(keys, f"V{size}", len(keys) // size)[entries].tolist()
    return picked


@dataclass
class _Read:
    """One read: when, and the slots it found changed with their bytes and packets then."""

    number: int
    at_ns: int  # CLOCK_MONOTONIC
    slots: Slots = field(default_factory=lambda: np.empty(0, np.int64))
    bytes: npt.NDArray[np.uint64] = field(default_factory=lambda: np.empty(0, np.uint64))
    packets: npt.NDArray[np.uint64] = field(default_factory=lambda: np.empty(0, np.uint64))


class FlowTable:
    """The flows of the kernel's table as the reads saw them, their sums per interface and
    direction (`live`, and `retired` for flows deleted), and recent reads (for rates)."""

    def __init__(self, key_dtype: np.dtype[Any], value_dtype: np.dtype[Any], at_ns: int) -> None:
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self.slots: dict[bytes, int] = {}  # raw key -> slot
        self.keys: list[bytes] = []  # slot -> raw key
        self.values = np.zeros(_INITIAL_SLOTS, value_dtype)  # slot -> counters as last read
        self.group = np.zeros(_INITIAL_SLOTS, np.int64)  # slot -> its (ifindex, direction) in `groups`
        self.base = np.zeros((_INITIAL_SLOTS, 2), np.uint64)  # slot -> (bytes, packets) at the baseline read
        self.alive = np.zeros(_INITIAL_SLOTS, bool)
        self._free: list[int] = []
        # Slots freed at a read, reusable once that read is no longer after the baseline (its record
        # of changes would otherwise move the baseline counters of the slot's next flow).
        self._quarantine: deque[tuple[int, list[int]]] = deque()
        self.recent: deque[_Read] = deque([_Read(0, at_ns)])  # oldest (the baseline) first
        self.groups: dict[Where, int] = {}  # (ifindex, direction) -> its row in live and retired
        self.live = np.zeros((0, len(SUMMED)), np.int64)  # SUMMED of the table's flows, per group
        self.retired = np.zeros((0, len(SUMMED)), np.int64)  # SUMMED of flows deleted, per group
        self._changed: list[Slots] = []  # by the read in progress
        self._records: Slots = np.empty(0, np.int64)  # slots of the latest records (`recorded`)

    def __len__(self) -> int:
        return len(self.slots)

    # --- reads and rates ---

    def begin(self, at_ns: int, min_window_ns: int) -> _Read:
        """Start a read: the baseline is the latest read at least min_window_ns before it (or the
        oldest there is). Returns the baseline."""
        while len(self.recent) > 1 and at_ns - self.recent[1].at_ns >= min_window_ns:
            self.recent.popleft()
            baseline = self.recent[0]
            self.base[baseline.slots] = np.stack((baseline.bytes, baseline.packets), axis=1)
        while self._quarantine and self._quarantine[0][0] <= self.recent[0].number:
            self._free += self._quarantine.popleft()[1]
        self._changed = []
        return self.recent[0]

    def end(self, at_ns: int) -> _Read:
        """Finish a read: what it changed joins the recent reads. Returns it."""
        slots = np.concatenate(self._changed) if self._changed else np.empty(0, np.int64)
        read = _Read(self.recent[-1].number + 1, at_ns, slots, self.values["bytes"][slots].copy(),
                     self.values["packets"][slots].copy())
        self.recent.append(read)
        return read

    def recorded(self, top: int | None, interval: float) -> Slots:
        """The slots to make records of: every live one when `top` is None. Else the `top` fastest of
        those that changed since the baseline (every other rate is 0) and, while fewer changed, idle
        ones (`_idle`): a long-lived connection between its requests keeps its record. At most `top`
        slots for Python to make records of, whatever the table holds."""
        if top is None:
            every: Slots = np.flatnonzero(self.alive)
            return every
        changed_at = self._changed_after_baseline()
        changed = np.flatnonzero(changed_at & self.alive)
        if len(changed) > top:
            byte_rates, _ = self.rates(changed, interval)
            self._records = changed[np.argpartition(-byte_rates, top)[:top]]
        else:
            idle = self._idle(changed_at, top - len(changed), len(self) - len(changed))
            self._records = np.concatenate((changed, idle))
        return self._records

    def _idle(self, changed_at: npt.NDArray[np.bool_], room: int, idle_flows: int) -> Slots:
        """Up to `room` of the `idle_flows` live slots unchanged since the baseline: those of the
        latest records first (an idle flow keeps its record; those with the most bytes if they
        outnumber the room), then, while room is left, the others with the most bytes. That ranking is
        array work over the whole table: done only when the latest records leave room for others."""
        last = self._records
        kept = last[self.alive[last] & ~changed_at[last]]
        if len(kept) >= min(room, idle_flows):
            return self._heaviest(kept, room)
        others = self.alive & ~changed_at
        others[kept] = False
        return np.concatenate((kept, self._heaviest(np.flatnonzero(others), room - len(kept))))

    def _changed_after_baseline(self) -> npt.NDArray[np.bool_]:
        """Per slot: whether a read after the baseline found it changed."""
        changed = np.zeros(len(self.alive), bool)
        for read in list(self.recent)[1:]:
            changed[read.slots] = True
        return changed

    def _heaviest(self, slots: Slots, count: int) -> Slots:
        """The `count` of these slots with the most bytes."""
        if count >= len(slots):
            return slots
        lightest = len(slots) - count
        heaviest: Slots = slots[np.argpartition(self.values["bytes"][slots], lightest - 1)[lightest:]]
        return heaviest

    def rates(self, slots: Slots, interval: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Bytes and packets per second since the baseline read."""
        before = self.base[slots]
        return ((self.values["bytes"][slots] - before[:, 0]) / interval,
                (self.values["packets"][slots] - before[:, 1]) / interval)

    # --- what a read found ---

    def update(self, keys: memoryview, values: npt.NDArray[Any], changed: npt.NDArray[np.intp]) -> None:
        """Entries `changed` of one raw batch (keys as bytes, values as value_dtype) hold new counters."""
        if not changed.size:
            return
        raw = raw_keys(keys, self.key_dtype.itemsize, changed)
        slots = self._slots_of(raw)
        fresh, before = values[changed], self.values[slots]
        self._add(self.live, slots, self._columns(fresh, 1) - self._columns(before, 1))
        self.values[slots] = fresh
        self._changed.append(slots)

    def _slots_of(self, keys: list[bytes]) -> Slots:
        """The slot of each flow, new flows getting theirs (one dictionary lookup per flow, in C)."""
        slots = np.fromiter(map(self.slots.get, keys, repeat(-1)), np.int64, len(keys))
        new = np.flatnonzero(slots < 0)
        slots[new] = self._allocate([keys[i] for i in new.tolist()])
        return slots

    def _allocate(self, keys: list[bytes]) -> Slots:
        """Slots for new flows, zeroed."""
        while len(self._free) < len(keys):
            self._grow()
        taken = self._free[len(self._free) - len(keys):]
        del self._free[len(self._free) - len(keys):]
        slots = np.array(taken, np.int64)
        for key, slot in zip(keys, taken, strict=True):
            self.slots[key] = slot
            self.keys[slot] = key
        parsed = np.frombuffer(b"".join(keys), self.key_dtype, len(keys))
        wheres = zip(parsed["ifindex"].tolist(), parsed["direction"].tolist(), strict=True)
        self.group[slots] = [self._group(where) for where in wheres]
        self.values[slots] = np.zeros(1, self.value_dtype)
        self.base[slots] = 0
        self.alive[slots] = True
        return slots

    def _grow(self) -> None:
        size = len(self.values)
        grown = max(size * 2, _INITIAL_SLOTS)
        self.values = np.resize(self.values, grown)
        self.group = np.resize(self.group, grown)
        self.base = np.resize(self.base, (grown, 2))
        self.alive = np.concatenate((self.alive[:size], np.zeros(grown - size, bool)))
        self.keys += [b""] * (grown - len(self.keys))
        self._free += range(grown - 1, size - 1, -1)

    def _group(self, where: Where) -> int:
        group = self.groups.get(where)
        if group is None:
            group = self.groups[where] = len(self.groups)
            self.live = np.vstack((self.live, np.zeros((1, len(SUMMED)), np.int64)))
            self.retired = np.vstack((self.retired, np.zeros((1, len(SUMMED)), np.int64)))
        return group

    def _add(self, sums: npt.NDArray[np.int64], slots: Slots, columns: npt.NDArray[np.int64]) -> None:
        """Add each slot's SUMMED columns (one row per slot) to its group's sums."""
        np.add.at(sums, self.group[slots], columns)

    @staticmethod
    def _columns(values: npt.NDArray[Any], sign: int) -> npt.NDArray[np.int64]:
        return sign * np.stack([values[name].astype(np.int64) for name in SUMMED], axis=1)

    # --- flows leaving the table ---

    def retire(self, keys: list[bytes], finals: npt.NDArray[Any]) -> None:
        """Flows deleted from the table: their counts as deleted (`finals`, value_dtype) move to
        their interfaces' own."""
        slots = self._slots_of(keys)  # a flow made and gone between two reads gets one too
        self._add(self.retired, slots, self._columns(finals, 1))
        self.drop(keys)

    def drop(self, keys: list[bytes]) -> None:
        """Flows gone from the table, whose counts go nowhere (their interface is no longer watched)."""
        slots = np.array([slot for key in keys if (slot := self.slots.pop(key, None)) is not None], np.int64)
        self._add(self.live, slots, self._columns(self.values[slots], -1))
        self.alive[slots] = False
        self._quarantine.append((self.recent[-1].number + 1, slots.tolist()))

    def stalest(self, count: int) -> list[bytes]:
        """The keys of the `count` flows seen longest ago."""
        slots = np.flatnonzero(self.alive)
        if count >= len(slots):
            return [self.keys[slot] for slot in slots.tolist()]
        seen = self.values["last_seen_ns"][slots]
        return [self.keys[slot] for slot in slots[np.argpartition(seen, count)[:count]].tolist()]

    def forget(self, ifindex: int) -> None:
        """An interface gone: what its deleted flows counted (its live flows are dropped as orphans)."""
        for (index, _direction), group in self.groups.items():
            if index == ifindex:
                self.retired[group] = 0

    def totals(self, where: Where) -> list[int]:
        """SUMMED of an interface and direction: its flows in the table and those deleted."""
        group = self.groups.get(where)
        if group is None:
            return [0] * len(SUMMED)
        sums: list[int] = (self.live[group] + self.retired[group]).tolist()
        return sums
