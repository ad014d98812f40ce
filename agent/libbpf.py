"""Thin ctypes binding to libbpf.so.1 (>= 1.0): only the C entry points aiprobe calls.

Everything above this module speaks Python objects (see `loader`); nothing else touches ctypes
signatures of libbpf. libbpf >= 1.0 returns NULL / negative errno and sets errno, so every call
goes through `check_ptr` / `check_rc`, which raise `BpfError` carrying errno and the last lines
libbpf printed.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno as errno_mod
import os
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    c_bool,
    c_char_p,
    c_int,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)

LIBBPF_SONAME = "libbpf.so.1"
MIN_VERSION = (1, 0)

# enum bpf_attach_type values used here (uapi/linux/bpf.h); TCX arrived in 6.6.
BPF_XDP = 37
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47
# enum bpf_map_type
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_RINGBUF = 27
# enum bpf_prog_type
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_PROG_TYPE_XDP = 6
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
# enum bpf_func_id
BPF_FUNC_TASK_STORAGE_GET = 156
BPF_FUNC_KTIME_GET_COARSE_NS = 160
BPF_FUNC_LOOP = 181
BPF_FUNC_XDP_GET_BUFF_LEN = 188
# BPF_PROG_LOAD's prog_flags
BPF_F_XDP_HAS_FRAGS = 1 << 5
# enum bpf_tc_attach_point
BPF_TC_INGRESS = 1
BPF_TC_EGRESS = 2
# XDP attach flags (uapi/linux/if_link.h)
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2


class LibbpfUnavailable(RuntimeError):
    """libbpf.so.1 is missing or too old."""


# The kernel's own ENOTSUPP (include/linux/errno.h), which user space's strerror does not name: what the
# kernel answers, for one, a BPF trampoline on a function with more arguments than its arch takes.
KERNEL_ENOTSUPP = 524


def _error_text(err: int) -> str:
    return "not supported by this kernel (ENOTSUPP)" if err == KERNEL_ENOTSUPP else os.strerror(err)


class BpfError(OSError):
    """A libbpf call failed: `errno`, the operation, and what libbpf printed just before."""

    def __init__(self, err: int, operation: str, libbpf_log: str = "") -> None:
        message = f"{operation}: {_error_text(err)}"
        if libbpf_log:
            message += f" — libbpf: {libbpf_log}"
        super().__init__(err, message)
        self.operation = operation
        self.libbpf_log = libbpf_log

    def __str__(self) -> str:
        return self.args[1]


# --- option structs (libbpf.h / bpf.h); `sz` lets libbpf accept older or newer layouts ---


class UprobeOpts(ctypes.Structure):
    _fields_ = [
        ("sz", c_size_t),
        ("ref_ctr_offset", c_size_t),
        ("bpf_cookie", c_uint64),
        ("retprobe", c_bool),
        ("func_name", c_char_p),
    ]


class TcHook(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("ifindex", c_int), ("attach_point", c_int), ("parent", c_uint32)]


class TcOpts(ctypes.Structure):
    _fields_ = [
        ("sz", c_size_t),
        ("prog_fd", c_int),
        ("flags", c_uint32),
        ("prog_id", c_uint32),
        ("handle", c_uint32),
        ("priority", c_uint32),
    ]


class LinkCreateOpts(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("flags", c_uint32)]


class MapBatchOpts(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("elem_flags", c_uint64), ("flags", c_uint64)]


class TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", c_size_t),
        ("data_in", c_void_p),
        ("data_out", c_void_p),
        ("data_size_in", c_uint32),
        ("data_size_out", c_uint32),
        ("ctx_in", c_void_p),
        ("ctx_out", c_void_p),
        ("ctx_size_in", c_uint32),
        ("ctx_size_out", c_uint32),
        ("retval", c_uint32),
        ("repeat", c_int),
        ("duration", c_uint32),
        ("flags", c_uint32),
        ("cpu", c_uint32),
        ("batch_size", c_uint32),
    ]


class BpfProgInfo(ctypes.Structure):
    """The head of struct bpf_prog_info, up to the name: the kernel fills as much as we ask for."""

    _fields_ = [
        ("type", c_uint32),
        ("id", c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", c_uint32),
        ("xlated_prog_len", c_uint32),
        ("jited_prog_insns", c_uint64),
        ("xlated_prog_insns", c_uint64),
        ("load_time", c_uint64),
        ("created_by_uid", c_uint32),
        ("nr_map_ids", c_uint32),
        ("map_ids", c_uint64),
        ("name", ctypes.c_char * 16),
    ]


class BtfType(ctypes.Structure):
    _fields_ = [("name_off", c_uint32), ("info", c_uint32), ("size_or_type", c_uint32)]


def sized(struct_type: type[ctypes.Structure], **fields: object) -> ctypes.Structure:
    """An opts struct with `sz` filled in, as LIBBPF_OPTS() does in C."""
    opts = struct_type(**fields)
    opts.sz = ctypes.sizeof(struct_type)
    return opts


PRINT_FN = CFUNCTYPE(c_int, c_int, c_char_p, c_void_p)
RINGBUF_SAMPLE_FN = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t)

# (name, restype, argtypes). Pointers to opaque libbpf objects are plain c_void_p.
_SIGNATURES: list[tuple[str, object, list[object]]] = [
    ("libbpf_major_version", c_uint32, []),
    ("libbpf_minor_version", c_uint32, []),
    ("libbpf_set_print", c_void_p, [PRINT_FN]),
    ("libbpf_num_possible_cpus", c_int, []),
    ("bpf_object__open_file", c_void_p, [c_char_p, c_void_p]),
    ("bpf_object__load", c_int, [c_void_p]),
    ("bpf_object__close", None, [c_void_p]),
    ("bpf_object__btf", c_void_p, [c_void_p]),
    ("bpf_object__next_program", c_void_p, [c_void_p, c_void_p]),
    ("bpf_object__next_map", c_void_p, [c_void_p, c_void_p]),
    ("bpf_program__name", c_char_p, [c_void_p]),
    ("bpf_program__section_name", c_char_p, [c_void_p]),
    ("bpf_program__set_autoload", c_int, [c_void_p, c_bool]),
    ("bpf_program__autoload", c_bool, [c_void_p]),
    ("bpf_program__flags", c_uint32, [c_void_p]),
    ("bpf_program__set_flags", c_int, [c_void_p, c_uint32]),
    ("bpf_program__fd", c_int, [c_void_p]),
    ("bpf_program__set_log_level", c_int, [c_void_p, c_uint32]),
    ("bpf_program__set_log_buf", c_int, [c_void_p, c_char_p, c_size_t]),
    ("bpf_program__attach", c_void_p, [c_void_p]),
    ("bpf_program__attach_uprobe_opts", c_void_p, [c_void_p, c_int, c_char_p, c_size_t, c_void_p]),
    ("bpf_program__attach_perf_event", c_void_p, [c_void_p, c_int]),
    ("bpf_link__destroy", c_int, [c_void_p]),
    ("bpf_link__fd", c_int, [c_void_p]),
    ("bpf_link_create", c_int, [c_int, c_int, c_int, c_void_p]),
    ("bpf_tc_hook_create", c_int, [c_void_p]),
    ("bpf_tc_hook_destroy", c_int, [c_void_p]),
    ("bpf_tc_attach", c_int, [c_void_p, c_void_p]),
    ("bpf_tc_detach", c_int, [c_void_p, c_void_p]),
    ("bpf_tc_query", c_int, [c_void_p, c_void_p]),
    ("bpf_map__name", c_char_p, [c_void_p]),
    ("bpf_map__fd", c_int, [c_void_p]),
    ("bpf_map__type", c_int, [c_void_p]),
    ("bpf_map__key_size", c_uint32, [c_void_p]),
    ("bpf_map__value_size", c_uint32, [c_void_p]),
    ("bpf_map__max_entries", c_uint32, [c_void_p]),
    ("bpf_map__set_max_entries", c_int, [c_void_p, c_uint32]),
    ("bpf_map__set_type", c_int, [c_void_p, c_int]),
    ("bpf_map__set_map_flags", c_int, [c_void_p, c_uint32]),
    ("bpf_map__reuse_fd", c_int, [c_void_p, c_int]),
    ("bpf_map__btf_key_type_id", c_uint32, [c_void_p]),
    ("bpf_map__btf_value_type_id", c_uint32, [c_void_p]),
    ("bpf_map__initial_value", c_void_p, [c_void_p, POINTER(c_size_t)]),
    ("bpf_map_create", c_int, [c_int, c_char_p, c_uint32, c_uint32, c_uint32, c_void_p]),
    ("bpf_map_lookup_elem", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_update_elem", c_int, [c_int, c_void_p, c_void_p, c_uint64]),
    ("bpf_map_delete_elem", c_int, [c_int, c_void_p]),
    ("bpf_map_lookup_and_delete_elem", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_get_next_key", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_lookup_batch", c_int,
     [c_int, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), c_void_p]),
    ("bpf_map_delete_batch", c_int, [c_int, c_void_p, POINTER(c_uint32), c_void_p]),
    ("bpf_prog_load", c_int, [c_int, c_char_p, c_char_p, c_void_p, c_size_t, c_void_p]),
    ("bpf_prog_test_run_opts", c_int, [c_int, c_void_p]),
    ("bpf_prog_query", c_int, [c_int, c_int, c_uint32, c_void_p, c_void_p, POINTER(c_uint32)]),
    ("bpf_prog_get_fd_by_id", c_int, [c_uint32]),
    ("bpf_obj_get_info_by_fd", c_int, [c_int, c_void_p, POINTER(c_uint32)]),
    ("bpf_enable_stats", c_int, [c_int]),
    ("libbpf_probe_bpf_helper", c_int, [c_int, c_int, c_void_p]),
    ("btf__load_vmlinux_btf", c_void_p, []),
    ("btf__parse_elf", c_void_p, [c_char_p, c_void_p]),
    ("btf__free", None, [c_void_p]),
    ("btf__type_by_id", POINTER(BtfType), [c_void_p, c_uint32]),
    ("btf__name_by_offset", c_char_p, [c_void_p, c_uint32]),
    ("btf__find_by_name_kind", c_int, [c_void_p, c_char_p, c_uint32]),
    ("ring_buffer__new", c_void_p, [c_int, RINGBUF_SAMPLE_FN, c_void_p, c_void_p]),
    ("ring_buffer__poll", c_int, [c_void_p, c_int]),
    ("ring_buffer__consume", c_int, [c_void_p]),
    ("ring_buffer__epoll_fd", c_int, [c_void_p]),
    ("ring_buffer__free", None, [c_void_p]),
]

_LOG_LINES = 20
# libbpf prints from the thread that called it, and three threads call it (the refresh loop, the
# CUDA library scan, the link watcher): one log per thread, so an error quotes its own call's log.
_logs = threading.local()
_lib: ctypes.CDLL | None = None
_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.argtypes = [c_char_p, c_size_t, c_char_p, c_void_p]


@PRINT_FN
def _capture_print(level: int, fmt: bytes, va_list: int) -> int:
    # va_list reaches a callback as a pointer on x86-64 and arm64, so libc can format it for us.
    buf = ctypes.create_string_buffer(1024)
    _libc.vsnprintf(buf, len(buf), fmt, va_list)
    line = buf.value.decode(errors="replace").strip().removeprefix("libbpf: ")
    if line:
        _thread_log().append(line)
        if os.environ.get("AIPROBE_LIBBPF_DEBUG"):
            print(f"libbpf: {line}", flush=True)
    return 0


def lib() -> ctypes.CDLL:
    """The loaded libbpf, with signatures set and its log captured; raises LibbpfUnavailable."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        handle = ctypes.CDLL(os.environ.get("AIPROBE_LIBBPF", LIBBPF_SONAME), use_errno=True)
    except OSError as exc:
        raise LibbpfUnavailable(f"{LIBBPF_SONAME} not found ({exc}); install libbpf1 (>= 1.0)") from None
    for name, restype, argtypes in _SIGNATURES:
        try:
            func = getattr(handle, name)
        except AttributeError:
            raise LibbpfUnavailable(f"{LIBBPF_SONAME} lacks {name}; libbpf >= 1.0 is required") from None
        func.restype = restype
        func.argtypes = argtypes
    if (handle.libbpf_major_version(), handle.libbpf_minor_version()) < MIN_VERSION:
        raise LibbpfUnavailable("libbpf >= 1.0 is required")
    handle.libbpf_set_print(_capture_print)
    _lib = handle
    return handle


def version() -> str:
    return f"{lib().libbpf_major_version()}.{lib().libbpf_minor_version()}"


def _thread_log() -> collections.deque:
    if not hasattr(_logs, "lines"):
        _logs.lines = collections.deque(maxlen=_LOG_LINES)
    return _logs.lines


def drain_log() -> str:
    """The lines libbpf printed in this thread since the last call, joined; clears them."""
    lines = _thread_log()
    text = " | ".join(list(lines)[-4:])
    lines.clear()
    return text


def _errno(rc: int | None = None) -> int:
    if rc is not None and rc < 0:
        return -rc
    return ctypes.get_errno() or errno_mod.EINVAL


def check_rc(rc: int, operation: str) -> int:
    """Raise BpfError for a negative libbpf return code; return rc otherwise."""
    if rc < 0:
        raise BpfError(_errno(rc), operation, drain_log())
    return rc


def check_ptr(ptr: int | None, operation: str) -> int:
    """Raise BpfError when a libbpf constructor returned NULL."""
    if not ptr:
        raise BpfError(_errno(), operation, drain_log())
    return ptr


def call(name: str, *args: object) -> int:
    """Call a libbpf function that returns 0 / -errno, with errno cleared first."""
    ctypes.set_errno(0)
    drain_log()
    return check_rc(getattr(lib(), name)(*args), name)


def new_ptr(name: str, *args: object) -> int:
    """Call a libbpf constructor (returns a pointer or NULL)."""
    ctypes.set_errno(0)
    drain_log()
    return check_ptr(getattr(lib(), name)(*args), name)
