"""Load CO-RE objects, attach their programs, read their maps — and close everything deterministically.

A probe module (flows, sendlat, cuda, sched) declares an ordered list of `Strategy`s; `load_first`
opens the object once per strategy with only that strategy's programs enabled, and keeps the first
that loads *and* attaches, recording why each earlier one was skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import numpy as np

from . import elf, libbpf, uprobe_events
from .btf import Btf, decode
from .libbpf import BpfError

_PERCPU_MAP_TYPES = {5, 6, 10}  # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
_BATCH_CHUNK = 4096
# A batch lookup's value buffer is at most this big: maps of histograms (10 KiB values) read in batches
# of ~100 entries, not a 40 MiB buffer zeroed at every read (a +40 MiB RSS spike each refresh). Never
# fewer than _MIN_BATCH entries: a hash bucket must fit in one batch (else ENOSPC).
_BATCH_BYTES = 1 << 20
_MIN_BATCH = 64
_LOG_BUF_SIZE = 4 << 20
# Maps that several objects declare alike (from one header) to share: an object declaring one reuses
# (bpf_map__reuse_fd) the map of a loaded object that holds it, else makes its own for later ones to
# reuse, so either may load first and each runs alone. The kernel frees the map with its last holder:
# nothing pinned, nothing left behind.
SHARED_MAPS = frozenset({"cuda_sync_time"})  # bpf/cuda_sync.h: cuda writes it, streams (in sendlat) reads it
_shared_holders: dict[str, list[BpfObject]] = {}  # map name -> loaded objects holding it
_shared_lock = threading.Lock()


class ProbeUnavailable(RuntimeError):
    """No strategy of a probe could load and attach; `reasons` says why for each."""

    def __init__(self, probe: str, reasons: dict[str, str]) -> None:
        self.probe = probe
        self.reasons = reasons
        detail = "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "no strategy declared"
        super().__init__(f"{probe}: no strategy could run ({detail})")


def objects_dir() -> Path:
    """Where the compiled .bpf.o files live: inside the installed package, or $AIPROBE_BPF_DIR."""
    override = os.environ.get("AIPROBE_BPF_DIR")
    return Path(override) if override else Path(__file__).parent / "bpf_objects"


def object_path(name: str) -> Path:
    path = objects_dir() / f"{name}.bpf.o"
    if not path.exists():
        raise FileNotFoundError(f"BPF object {path} is missing; build it with `make bpf`")
    return path


# The C constants user space needs (an enum's names, an array's length) come from the object's own BTF,
# not from a file generated at build time: the object the loader opens is then the one place they live,
# with nothing else to build, ship or keep in step with it (AIPROBE_BPF_DIR points at other objects and
# the constants follow). Reading them needs libbpf and the built object, so it waits for first use, and
# importing a module that declares them never fails.

@functools.cache
def object_btf(name: str) -> Btf:
    """Object `name`'s BTF, parsed from its file (nothing is loaded into the kernel); kept for good."""
    return Btf.parse_elf(object_path(name))


Item = TypeVar("Item")


class Lazy(Sequence[Item]):
    """A tuple made when first used (indexed, iterated, measured), for constants read from BTF."""

    def __init__(self, make: Callable[[], Iterable[Item]]) -> None:
        self._make = make

    @functools.cached_property
    def _items(self) -> tuple[Item, ...]:
        return tuple(self._make())

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Item, ...]: ...

    def __getitem__(self, index: int | slice) -> Item | tuple[Item, ...]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:  # the tuple's own, not an index at a time (once per entry read)
        return iter(self._items)


def enum_labels(obj: str, enum: str, prefix: str, label: Callable[[str], str] = str.lower) -> Lazy[str]:
    """Label values named by C enum `enum` of object `obj`, in value order: each enumerator without
    `prefix`, through `label`; a count (a name ending in _MAX) is none. Its header puts the enum into
    the object's BTF (BTF_EXPORT_ENUM)."""
    def read() -> list[str]:
        names = object_btf(obj).enum_names(enum)
        return [label(name.removeprefix(prefix)) for name in names if not name.endswith("_MAX")]

    return Lazy(read)


class Link:
    """One attachment. Closing it detaches; closing twice is harmless."""

    def __init__(self, description: str, detach: Callable[[], None], fd: int = -1) -> None:
        self.description = description
        self.fd = fd
        self._detach: Callable[[], None] | None = detach

    def close(self) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()

    @property
    def closed(self) -> bool:
        return self._detach is None

    def __repr__(self) -> str:
        return f"<Link {self.description}{' closed' if self.closed else ''}>"


def _libbpf_link(ptr: int, description: str) -> Link:
    fd = libbpf.lib().bpf_link__fd(ptr)
    return Link(description, lambda: libbpf.lib().bpf_link__destroy(ptr), fd)


def _fd_link(fd: int, description: str) -> Link:
    return Link(description, lambda: os.close(fd), fd)


@dataclass
class TestRun:
    retval: int
    duration_ns: int
    data_out: bytes


class Program:
    def __init__(self, obj: BpfObject, ptr: int) -> None:
        self._obj = obj
        self._ptr = ptr
        self.name = libbpf.lib().bpf_program__name(ptr).decode()
        self.section = libbpf.lib().bpf_program__section_name(ptr).decode()
        self._log_buf: ctypes.Array | None = None

    @property
    def fd(self) -> int:
        return libbpf.lib().bpf_program__fd(self._ptr)

    @property
    def autoload(self) -> bool:
        return bool(libbpf.lib().bpf_program__autoload(self._ptr))

    @autoload.setter
    def autoload(self, enabled: bool) -> None:
        libbpf.lib().bpf_program__set_autoload(self._ptr, enabled)

    @property
    def flags(self) -> int:
        """BPF_F_* load flags (BPF_PROG_LOAD's prog_flags), beyond those its SEC() adds at load."""
        return int(libbpf.lib().bpf_program__flags(self._ptr))

    @flags.setter
    def flags(self, flags: int) -> None:
        libbpf.call("bpf_program__set_flags", self._ptr, flags)

    def keep_verifier_log(self, level: int) -> None:
        self._log_buf = ctypes.create_string_buffer(_LOG_BUF_SIZE)
        libbpf.lib().bpf_program__set_log_buf(self._ptr, self._log_buf, _LOG_BUF_SIZE)
        libbpf.lib().bpf_program__set_log_level(self._ptr, level)

    @property
    def verifier_log(self) -> str:
        return self._log_buf.value.decode(errors="replace") if self._log_buf is not None else ""

    def attach(self) -> Link:
        """Attach as the SEC() name says (tracepoint, raw_tp, tp_btf, fentry, kprobe ...)."""
        ptr = libbpf.new_ptr("bpf_program__attach", self._ptr)
        return self._obj.own(_libbpf_link(ptr, f"{self.name} ({self.section})"))

    def attach_uprobe(self, binary: str, func_name: str | None = None, *, offset: int = 0, retprobe: bool = False,
                      pid: int = -1) -> Link:
        """uprobe/uretprobe on `func_name` in `binary`, or at file `offset` (libbpf then does not parse
        the file), for every process (pid -1) that maps it. Where the perf uprobe PMU is refused (it
        needs CAP_SYS_ADMIN on current kernels), through a tracefs uprobe event (aiprobe.uprobe_events)."""
        opts = libbpf.sized(libbpf.UprobeOpts, retprobe=retprobe,
                            func_name=func_name.encode() if func_name else None)
        kind = "uretprobe" if retprobe else "uprobe"
        description = f"{self.name} {kind} {binary}:{func_name or hex(offset)}"
        try:
            ptr = libbpf.new_ptr(
                "bpf_program__attach_uprobe_opts", self._ptr, pid, binary.encode(), offset, ctypes.byref(opts)
            )
        except BpfError as exc:
            if exc.errno != errno.EACCES or pid != -1:
                raise
            if func_name:
                offset += _function_offset(binary, func_name)
            return self._obj.own(self._attach_uprobe_event(binary, offset, retprobe, description))
        return self._obj.own(_libbpf_link(ptr, description))

    def _attach_uprobe_event(self, binary: str, offset: int, retprobe: bool, description: str) -> Link:
        uprobe_events.remove_stale_events()
        name, tracepoint_id = uprobe_events.create_event(binary, offset, retprobe=retprobe)
        try:
            perf_fd = uprobe_events.open_tracepoint(tracepoint_id)
            try:
                ptr = libbpf.new_ptr("bpf_program__attach_perf_event", self._ptr, perf_fd)
            except BaseException:
                os.close(perf_fd)
                raise
        except BaseException:
            uprobe_events.remove_event(name)
            raise

        def detach() -> None:
            libbpf.lib().bpf_link__destroy(ptr)  # closes perf_fd
            uprobe_events.remove_event(name)

        return Link(f"{description} (tracefs {uprobe_events.GROUP}/{name})", detach, libbpf.lib().bpf_link__fd(ptr))

    def attach_xdp(self, ifindex: int, mode: str | None = None) -> Link:
        """XDP through a bpf_link; mode 'native', 'generic' or None (kernel's choice)."""
        flags = {"native": libbpf.XDP_FLAGS_DRV_MODE, "generic": libbpf.XDP_FLAGS_SKB_MODE, None: 0}[mode]
        opts = libbpf.sized(libbpf.LinkCreateOpts, flags=flags)
        fd = libbpf.call("bpf_link_create", self.fd, ifindex, libbpf.BPF_XDP, ctypes.byref(opts))
        return self._obj.own(_fd_link(fd, f"{self.name} xdp/{mode or 'auto'} ifindex {ifindex}"))

    def attach_tcx(self, ifindex: int, direction: str) -> Link:
        """tc through a TCX bpf_link (kernel >= 6.6); direction 'ingress' or 'egress'."""
        attach_type = libbpf.BPF_TCX_INGRESS if direction == "ingress" else libbpf.BPF_TCX_EGRESS
        fd = libbpf.call("bpf_link_create", self.fd, ifindex, attach_type, None)
        return self._obj.own(_fd_link(fd, f"{self.name} tcx/{direction} ifindex {ifindex}"))

    def attach_tc_clsact(self, ifindex: int, direction: str, *, handle: int, priority: int) -> Link:
        """Fallback for kernels without TCX: a direct-action filter with our own handle and priority
        on the clsact qdisc. The qdisc is created when missing and never removed here: other tools may
        have filters on it. Detaching removes only our filter."""
        hook = _tc_hook(ifindex, direction)
        with contextlib.suppress(BpfError):  # EEXIST: clsact is already there
            libbpf.call("bpf_tc_hook_create", ctypes.byref(hook))
        opts = libbpf.sized(libbpf.TcOpts, prog_fd=self.fd, handle=handle, priority=priority)
        libbpf.call("bpf_tc_attach", ctypes.byref(hook), ctypes.byref(opts))
        ours = _program_info(self.fd).id

        def detach() -> None:
            with contextlib.suppress(BpfError):  # the interface may be gone already
                # Still ours? If our filter was removed by hand, another aiprobe may have the handle now.
                if tc_clsact_query(ifindex, direction, handle=handle, priority=priority) == ours:
                    tc_clsact_detach(ifindex, direction, handle=handle, priority=priority)

        return self._obj.own(Link(f"{self.name} clsact/{direction} ifindex {ifindex}", detach))

    def test_run(self, data: bytes, repeat: int = 1) -> TestRun:
        """BPF_PROG_TEST_RUN: run the program on `data`; duration is the mean per repetition."""
        data_in = ctypes.create_string_buffer(data, len(data))
        data_out = ctypes.create_string_buffer(len(data) + 256)
        opts = libbpf.sized(
            libbpf.TestRunOpts,
            data_in=ctypes.cast(data_in, ctypes.c_void_p),
            data_size_in=len(data),
            data_out=ctypes.cast(data_out, ctypes.c_void_p),
            data_size_out=len(data_out),
            repeat=repeat,
        )
        libbpf.call("bpf_prog_test_run_opts", self.fd, ctypes.byref(opts))
        return TestRun(opts.retval, opts.duration, data_out.raw[: opts.data_size_out])


def _function_offset(binary: str, func_name: str) -> int:
    """Where libbpf would have put a uprobe on `func_name`; ENOENT as libbpf's when undefined."""
    try:
        offsets = elf.function_offsets(binary, [func_name])
    except (elf.ElfError, OSError) as exc:
        raise BpfError(errno.EINVAL, f"uprobe on {func_name}", str(exc)) from None
    if func_name not in offsets:
        raise BpfError(errno.ENOENT, f"uprobe on {func_name}", f"{binary} does not define it")
    return offsets[func_name]


def _tc_hook(ifindex: int, direction: str) -> libbpf.TcHook:
    point = libbpf.BPF_TC_INGRESS if direction == "ingress" else libbpf.BPF_TC_EGRESS
    return libbpf.sized(libbpf.TcHook, ifindex=ifindex, attach_point=point)


def tc_clsact_query(ifindex: int, direction: str, *, handle: int, priority: int) -> int | None:
    """The id of the program in the clsact filter with this handle and priority, None if there is none."""
    opts = libbpf.sized(libbpf.TcOpts, handle=handle, priority=priority)
    rc = libbpf.lib().bpf_tc_query(ctypes.byref(_tc_hook(ifindex, direction)), ctypes.byref(opts))
    if rc in (-errno.ENOENT, -errno.EINVAL):  # no such filter, or no clsact qdisc at all
        return None
    libbpf.check_rc(rc, f"tc filter query on ifindex {ifindex}")
    return opts.prog_id


def tc_clsact_detach(ifindex: int, direction: str, *, handle: int, priority: int) -> None:
    """Remove the clsact filter with exactly this handle and priority (and nothing else)."""
    opts = libbpf.sized(libbpf.TcOpts, handle=handle, priority=priority)
    libbpf.call("bpf_tc_detach", ctypes.byref(_tc_hook(ifindex, direction)), ctypes.byref(opts))


def program_name(prog_id: int) -> str | None:
    """The name of a loaded program (any owner), None when it no longer exists."""
    rc = libbpf.lib().bpf_prog_get_fd_by_id(prog_id)
    if rc == -errno.ENOENT:
        return None
    fd = libbpf.check_rc(rc, f"open program id {prog_id}")
    try:
        return _program_info(fd).name.decode(errors="replace")
    finally:
        os.close(fd)


def _program_info(fd: int) -> libbpf.BpfProgInfo:
    info = libbpf.BpfProgInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    libbpf.call("bpf_obj_get_info_by_fd", fd, ctypes.byref(info), ctypes.byref(size))
    return info


@dataclass
class MapTable:
    """A map's entries read at once (Map.table()): raw keys, and their values in one buffer, read a value
    at a time as ctypes structs or a field of all of them at once (aiprobe.histogram.Histograms.of_field)."""

    keys: list[bytes]
    buffer: bytearray  # the values, value_type's size each
    value_type: Any

    def values(self) -> list[Any]:
        """The values as ctypes structs over the buffer (no copy)."""
        size = ctypes.sizeof(self.value_type)
        return [self.value_type.from_buffer(self.buffer, offset) for offset in range(0, len(self.buffer), size)]

    def rows(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The values as an (entries, value size) byte array over the buffer (no copy)."""
        return np.frombuffer(self.buffer, np.uint8).reshape(len(self.keys), ctypes.sizeof(self.value_type))

    def delete(self, source: Map, entries: Iterable[int]) -> None:
        """Delete these entries (by position) from `source`, the map read, each value here replaced by
        the one the delete found: what was added to it after the read still counts."""
        size = ctypes.sizeof(self.value_type)
        for i in entries:
            if (final := source.pop(self.keys[i])) is not None:
                self.buffer[i * size:(i + 1) * size] = bytes(final)


class Map:
    """A BPF map with keys and values typed from BTF (raw byte arrays where BTF has none)."""

    def __init__(self, obj: BpfObject, ptr: int) -> None:
        lib = libbpf.lib()
        self._ptr = ptr
        self.name = lib.bpf_map__name(ptr).decode()
        self.type = lib.bpf_map__type(ptr)
        self.key_size = lib.bpf_map__key_size(ptr)
        self.value_size = lib.bpf_map__value_size(ptr)
        self.percpu = self.type in _PERCPU_MAP_TYPES
        self.key_type = self._btf_type(obj.btf, lib.bpf_map__btf_key_type_id(ptr), self.key_size)
        self.value_type = self._btf_type(obj.btf, lib.bpf_map__btf_value_type_id(ptr), self.value_size)
        self._ncpus = lib.libbpf_num_possible_cpus() if self.percpu else 1
        # Per-CPU values sit at an 8-byte stride, one per possible CPU.
        self._stride = (self.value_size + 7) & ~7 if self.percpu else self.value_size
        self._batch_ok = True
        self._atomic_pop = True  # lookup-and-delete on a hash map (5.14+)

    @staticmethod
    def _btf_type(btf: Btf | None, type_id: int, size: int) -> type:
        if btf is not None and type_id:
            with contextlib.suppress(TypeError):  # e.g. bitfields: fall back to raw bytes
                return btf.ctype(type_id)
        return ctypes.c_uint8 * size

    @property
    def fd(self) -> int:
        return libbpf.lib().bpf_map__fd(self._ptr)

    @property
    def max_entries(self) -> int:
        return libbpf.lib().bpf_map__max_entries(self._ptr)

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        libbpf.call("bpf_map__set_max_entries", self._ptr, value)

    def retype(self, map_type: int, flags: int, max_entries: int, key_size: int | None = None) -> None:
        """Before load: make the map one of another type (one the kernel has where it lacks the declared
        type), with the flags and size that type takes. With `key_size` other than the declared key's,
        the map is made here, without BTF (the kernel refuses a key type of another size), and libbpf
        takes it as made."""
        if self.percpu or map_type in _PERCPU_MAP_TYPES:
            raise ValueError(f"map {self.name}: per-CPU maps keep their type")
        libbpf.call("bpf_map__set_type", self._ptr, map_type)
        libbpf.call("bpf_map__set_map_flags", self._ptr, flags)
        self.max_entries = max_entries
        self.type = map_type
        if key_size is not None and key_size != self.key_size:
            self._make(flags, key_size)

    def _make(self, flags: int, key_size: int) -> None:
        if flags:
            raise ValueError(f"map {self.name}: a map made here takes no flags")
        fd = libbpf.call("bpf_map_create", self.type, self.name[:15].encode(), key_size, self.value_size,
                         self.max_entries, None)
        try:
            libbpf.call("bpf_map__reuse_fd", self._ptr, fd)  # libbpf keeps a duplicate
        finally:
            os.close(fd)
        self.key_size = key_size
        self.key_type = ctypes.c_uint8 * key_size

    def _value_buffer(self, count: int = 1) -> ctypes.Array:
        return (ctypes.c_uint8 * (self._stride * self._ncpus * count))()

    def _split(self, buf: ctypes.Array, index: int = 0) -> Any:
        """One element's value: a ctypes value, or a list of them (one per CPU) for per-CPU maps."""
        base = index * self._stride * self._ncpus
        values = [self.value_type.from_buffer_copy(buf, base + cpu * self._stride) for cpu in range(self._ncpus)]
        return values if self.percpu else values[0]

    def _key(self, key: Any) -> Any:
        if isinstance(key, bytes):  # a raw key, as raw_items() gives them
            return self.key_type.from_buffer_copy(key)
        return key if isinstance(key, self.key_type) else self.key_type(key)

    def lookup(self, key: Any) -> Any:
        return self._value_of(libbpf.lib().bpf_map_lookup_elem, key, "lookup")

    def _value_of(self, call: Callable[..., int], key: Any, what: str) -> Any:
        buf = self._value_buffer()
        rc = call(self.fd, ctypes.byref(self._key(key)), buf)
        if rc == -errno.ENOENT:
            return None
        libbpf.check_rc(rc, f"{what} in map {self.name}")
        return self._split(buf)

    def update(self, key: Any, value: Any, flags: int = 0) -> None:
        value = value if isinstance(value, self.value_type) else self.value_type(value)
        rc = libbpf.lib().bpf_map_update_elem(self.fd, ctypes.byref(self._key(key)), ctypes.byref(value), flags)
        libbpf.check_rc(rc, f"update in map {self.name}")

    def push(self, value: Any) -> None:
        """Add a value to a queue or stack map (they have no keys)."""
        value = value if isinstance(value, self.value_type) else self.value_type(value)
        rc = libbpf.lib().bpf_map_update_elem(self.fd, None, ctypes.byref(value), 0)
        libbpf.check_rc(rc, f"push to map {self.name}")

    def pop(self, key: Any) -> Any:
        """Delete an entry, returning its value as it was then (None when there was none): nothing
        added between a lookup and the delete is lost. Before 5.14 (no lookup-and-delete on hash maps)
        a lookup, then a delete, where an update between the two is lost."""
        if self._atomic_pop:
            try:
                return self._value_of(libbpf.lib().bpf_map_lookup_and_delete_elem, key, "lookup and delete")
            except BpfError as exc:
                if exc.errno != libbpf.KERNEL_ENOTSUPP:
                    raise
                self._atomic_pop = False
        value = self.lookup(key)
        self.delete(key)
        return value

    def delete(self, key: Any) -> bool:
        rc = libbpf.lib().bpf_map_delete_elem(self.fd, ctypes.byref(self._key(key)))
        if rc == -errno.ENOENT:
            return False
        libbpf.check_rc(rc, f"delete in map {self.name}")
        return True

    def keys(self) -> Iterator[Any]:
        key = None
        next_key = self.key_type()
        while libbpf.lib().bpf_map_get_next_key(
            self.fd, ctypes.byref(key) if key is not None else None, ctypes.byref(next_key)
        ) == 0:
            key = self.key_type.from_buffer_copy(next_key)
            yield key

    def items(self) -> list[tuple[Any, Any]]:
        """Every (key, value), with batch lookups where the kernel has them."""
        if self._batch_ok:
            try:
                return self._items_batch()
            except BpfError as exc:
                self._no_batches(exc)
        return [(key, value) for key in self.keys() if (value := self.lookup(key)) is not None]

    def _no_batches(self, exc: BpfError) -> None:
        """Falls back to one lookup per key for good when the kernel refused a batch lookup."""
        if exc.errno not in (errno.EINVAL, libbpf.KERNEL_ENOTSUPP, errno.EOPNOTSUPP):
            raise exc
        self._batch_ok = False

    def raw_items(self) -> Iterator[tuple[int, Any, Any]]:
        """Every entry of a map that is not per-CPU as (count, keys, values) batches of raw buffers
        (raw_batches), without one Python object per entry where the kernel has batch lookups."""
        if self._batch_ok:
            try:
                yield from self.raw_batches()
                return
            except BpfError as exc:  # refused at its first call, before any batch was yielded
                self._no_batches(exc)
        pairs = self.items()
        if pairs:
            yield len(pairs), b"".join(bytes(k) for k, _ in pairs), b"".join(bytes(v) for _, v in pairs)

    def table(self) -> MapTable:
        """Every entry of a map that is not per-CPU, its values in one buffer (raw_items' batches joined)."""
        keys, values = [], bytearray()
        for count, raw_keys, raw_values in self.raw_items():
            packed = bytes(memoryview(raw_keys)[:count * self.key_size])
            keys += [packed[i:i + self.key_size] for i in range(0, len(packed), self.key_size)]
            values += memoryview(raw_values)[:count * self.value_size]
        return MapTable(keys, values, self.value_type)

    def _items_batch(self) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = []
        for count, keys, values in self.raw_batches():
            out.extend((self.key_type.from_buffer_copy(keys, i * self.key_size), self._split(values, i))
                       for i in range(count))
        return out

    def raw_batches(self) -> Iterator[tuple[int, ctypes.Array, ctypes.Array]]:
        """The whole map by batch lookups, as (count, keys, values) of raw buffers: keys at key_size,
        values at value_size (per-CPU: one stride per possible CPU). The buffers are reused from one
        batch to the next: decode a batch before asking for the next. Raises BpfError (EINVAL,
        ENOTSUPP) where the kernel has no batch lookups for this map."""
        lib = libbpf.lib()
        token_size = max(self.key_size, 8)
        tokens = [ctypes.create_string_buffer(token_size), ctypes.create_string_buffer(token_size)]
        chunk = max(_MIN_BATCH, min(_BATCH_CHUNK, _BATCH_BYTES // (self._stride * self._ncpus)))
        keys = (ctypes.c_uint8 * (self.key_size * chunk))()
        values = self._value_buffer(chunk)
        opts = libbpf.sized(libbpf.MapBatchOpts)
        in_token, out_token = None, tokens[0]
        while True:
            count = ctypes.c_uint32(chunk)
            rc = lib.bpf_map_lookup_batch(
                self.fd, in_token, out_token, keys, values, ctypes.byref(count), ctypes.byref(opts)
            )
            if rc < 0 and rc != -errno.ENOENT:
                libbpf.check_rc(rc, f"batch lookup in map {self.name}")
            if count.value:
                yield count.value, keys, values
            if rc == -errno.ENOENT:
                return
            in_token, out_token = out_token, tokens[out_token is tokens[0]]

    def array_range(self, first: int, count: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Values `first` to `first + count - 1` of an array map that is not per-CPU, as a (count, value
        size) byte matrix: one batch lookup (arrays have them from 5.6), or where the kernel refuses it
        one lookup per index, each straight into its row."""
        values = np.zeros((count, self.value_size), np.uint8)
        lib = libbpf.lib()
        if self._batch_ok:
            previous, last = ctypes.c_uint32(first - 1), ctypes.c_uint32()  # a batch starts after `previous`
            read, keys = ctypes.c_uint32(count), np.empty(count, np.uint32)
            rc = lib.bpf_map_lookup_batch(self.fd, ctypes.byref(previous) if first else None, ctypes.byref(last),
                                          keys.ctypes.data, values.ctypes.data, ctypes.byref(read),
                                          ctypes.byref(libbpf.sized(libbpf.MapBatchOpts)))
            if rc >= 0 or rc == -errno.ENOENT:  # ENOENT: the array ends within the range
                return values[:read.value]
            try:
                libbpf.check_rc(rc, f"batch lookup in map {self.name}")
            except BpfError as exc:
                self._no_batches(exc)
        for index, row in enumerate(values, first):
            libbpf.check_rc(lib.bpf_map_lookup_elem(self.fd, ctypes.byref(ctypes.c_uint32(index)), row.ctypes.data),
                            f"lookup in map {self.name}")
        return values

    def delete_keys(self, keys: Iterable[Any]) -> None:
        for key in keys:
            self.delete(key)


class RingBuffer:
    """Poll a BPF ring buffer; `callback` gets each record as bytes (decode with an event ctype)."""

    def __init__(self, ring_map: Map, callback: Callable[[bytes], None]) -> None:
        self._callback = callback
        self._error: BaseException | None = None
        self._c_callback = libbpf.RINGBUF_SAMPLE_FN(self._on_sample)  # kept alive with self
        self._ptr = libbpf.new_ptr("ring_buffer__new", ring_map.fd, self._c_callback, None, None)

    def _on_sample(self, _ctx: int, data: int, size: int) -> int:
        try:
            self._callback(ctypes.string_at(data, size))
        except BaseException as exc:  # surfaced by poll(); an exception must not cross into C
            self._error = exc
            return -1
        return 0

    def poll(self, timeout_ms: int = 100) -> int:
        rc = libbpf.lib().ring_buffer__poll(self._ptr, timeout_ms)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if rc == -errno.EINTR:
            return 0
        return libbpf.check_rc(rc, "ring_buffer__poll")

    @property
    def epoll_fd(self) -> int:
        return libbpf.lib().ring_buffer__epoll_fd(self._ptr)

    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr:
            libbpf.lib().ring_buffer__free(ptr)


EventRecord = TypeVar("EventRecord")


class RingRecords(Generic[EventRecord]):
    """The events of ring buffer `ring` (each a struct `event`, read through the object's BTF) as
    records, kept until taken: at most `limit`, the rest counted in `dropped` (a reader that falls
    behind loses events, never memory). The ring is the object's: it is freed with it."""

    def __init__(self, obj: BpfObject, ring: str, event: str, record: Callable[[dict[str, Any]], EventRecord],
                 limit: int) -> None:
        if obj.btf is None:
            raise RuntimeError(f"{obj.name}.bpf.o carries no BTF")
        self._event_type = obj.btf.struct_ctype(event)
        self._record = record
        self._limit = limit
        self._pending: list[EventRecord] = []
        self.dropped = 0
        self.ring = obj.ring_buffer(ring, self._on_event)

    def _on_event(self, data: bytes) -> None:
        if len(self._pending) >= self._limit:
            self.dropped += 1
            return
        self._pending.append(self._record(decode(self._event_type.from_buffer_copy(data))))

    def poll(self, timeout_ms: int = 0) -> list[EventRecord]:
        """Wait up to timeout_ms for events; the new records (take() returns them too)."""
        before = len(self._pending)
        self.ring.poll(timeout_ms)
        return self._pending[before:]

    def take(self) -> list[EventRecord]:
        """The records not taken yet, those of events still in the ring included."""
        self.poll(0)
        records, self._pending = self._pending, []
        return records


class BpfObject:
    """One opened .bpf.o. Use as a context manager: links, ring buffers and the object close together.

    `programs`, when given, names the only programs to load (the rest of the object stays unloaded).
    `verifier_log` > 0 keeps each program's verifier log at that level (`program.verifier_log`).
    """

    def __init__(self, name: str, *, programs: Iterable[str] | None = None, verifier_log: int = 0) -> None:
        self.name = name
        self.path = object_path(name)
        self._ptr = libbpf.new_ptr("bpf_object__open_file", str(self.path).encode(), None)
        self._owned: list[Link | RingBuffer] = []
        self.loaded = False
        btf_ptr = libbpf.lib().bpf_object__btf(self._ptr)
        self.btf = Btf(btf_ptr) if btf_ptr else None
        self.programs = {p.name: p for p in self._each(Program, "bpf_object__next_program")}
        self.maps = {m.name: m for m in self._each(Map, "bpf_object__next_map")}
        if programs is not None:
            wanted = set(programs)
            unknown = wanted - self.programs.keys()
            if unknown:
                self.close()
                raise KeyError(f"{name}.bpf.o has no program {', '.join(sorted(unknown))}")
            for program in self.programs.values():
                program.autoload = program.name in wanted
        if verifier_log:
            for program in self.programs.values():
                program.keep_verifier_log(verifier_log)

    def _each(self, cls: type, iterator: str) -> Iterator[Any]:
        ptr = None
        while ptr := getattr(libbpf.lib(), iterator)(self._ptr, ptr):
            yield cls(self, ptr)

    def set_rodata(self, **values: int) -> None:
        """Set `const volatile` globals (in .rodata) before load: the programs' read-only config."""
        if self.loaded:
            raise RuntimeError(".rodata is frozen once the object is loaded")
        size = ctypes.c_size_t()
        base = libbpf.lib().bpf_map__initial_value(self._section_map(".rodata")._ptr, ctypes.byref(size))
        self._write_globals(".rodata", base, values)

    def set_data(self, section: str, **values: int) -> None:
        """Set globals of a writable data section (`.data`, `.data.<name>`) of the loaded object: the
        programs' run-time settings. The whole section is written back, so it must hold only
        variables user space writes (settings get a section of their own)."""
        data = self._section_map(section)
        contents = data.lookup(0)
        self._write_globals(section, ctypes.addressof(contents), values)
        data.update(0, contents)

    def _section_map(self, section: str) -> Map:
        data = next((m for m in self.maps.values() if m.name.endswith(section)), None)
        if data is None or self.btf is None:
            raise KeyError(f"{self.name}.bpf.o has no {section}")
        return data

    def _write_globals(self, section: str, address: int, values: dict[str, int]) -> None:
        """Write `values` into a copy of `section`'s contents at `address`, by its BTF."""
        assert self.btf is not None  # _section_map found the section
        variables = self.btf.datasec_vars(section)
        for var, value in values.items():
            if var not in variables:
                raise KeyError(f"{self.name}.bpf.o has no {section} variable {var!r}")
            offset, type_id = variables[var]
            self.btf.ctype(type_id).from_address(address + offset).value = value

    def load(self) -> None:
        shared = [m for m in self.maps.values() if m.name in SHARED_MAPS]
        with _shared_lock:
            for own in shared:
                holders = _shared_holders.get(own.name)
                if holders:
                    libbpf.call("bpf_map__reuse_fd", own._ptr, holders[0].maps[own.name].fd)
            libbpf.call("bpf_object__load", self._ptr)
            for own in shared:
                _shared_holders.setdefault(own.name, []).append(self)
        self.loaded = True

    def sharing(self, map_name: str) -> list[str]:
        """The other loaded objects (their names) that hold this object's map `map_name` (SHARED_MAPS)."""
        with _shared_lock:
            return [holder.name for holder in _shared_holders.get(map_name, []) if holder is not self]

    def own(self, resource: Link | RingBuffer) -> Any:
        """Tie a link or ring buffer to this object's lifetime."""
        self._owned.append(resource)
        return resource

    def ring_buffer(self, map_name: str, callback: Callable[[bytes], None]) -> RingBuffer:
        return self.own(RingBuffer(self.maps[map_name], callback))

    def release(self, resource: Link | RingBuffer) -> None:
        """Close one owned resource before the object closes (e.g. a link to a vanished interface)."""
        resource.close()
        if resource in self._owned:
            self._owned.remove(resource)

    @property
    def links(self) -> list[Link]:
        return [r for r in self._owned if isinstance(r, Link) and not r.closed]

    def close(self) -> None:
        """Detach every link, free ring buffers, then unload programs and maps."""
        while self._owned:
            self._owned.pop().close()
        uprobe_events.remove_pending()
        with _shared_lock:
            for holders in _shared_holders.values():
                if self in holders:
                    holders.remove(self)
        ptr, self._ptr = self._ptr, None
        if ptr:
            libbpf.lib().bpf_object__close(ptr)

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Strategy:
    """One way to run a probe: which programs to load, which kernel features they need, and what
    span of time or traffic they observe (reported to users so numbers are read correctly)."""

    name: str
    programs: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    span: str = ""
    # The strategy of a part loaded in the same attempt (cuda's uprobes with a scheduler strategy).
    part: Strategy | None = None

    @property
    def attempt(self) -> str:
        """What a failed load of this attempt is reported under: the part's strategy where it has one
        (the probe's own then failed with each of them)."""
        return self.part.name if self.part else self.name


@dataclass
class Loaded:
    obj: BpfObject
    strategy: Strategy
    skipped: dict[str, str] = field(default_factory=dict)


def attach_all(obj: BpfObject, strategy: Strategy) -> None:
    """Default attach: every program of the strategy as its SEC() name says."""
    for name in strategy.programs:
        obj.programs[name].attach()


def load_first(
    probe: str,
    object_name: str,
    strategies: Iterable[Strategy],
    *,
    configure: Callable[[BpfObject, Strategy], None] | None = None,
    attach: Callable[[BpfObject, Strategy], None] = attach_all,
) -> Loaded:
    """The first strategy that loads and attaches; raises ProbeUnavailable with every reason."""
    skipped: dict[str, str] = {}
    for strategy in strategies:
        obj = BpfObject(object_name, programs=strategy.programs)
        try:
            if configure is not None:
                configure(obj, strategy)
            obj.load()
            attach(obj, strategy)
        except BpfError as exc:
            obj.close()
            skipped[strategy.attempt] = str(exc)
            continue
        except BaseException:
            obj.close()
            raise
        return Loaded(obj, strategy, skipped)
    raise ProbeUnavailable(probe, skipped)
