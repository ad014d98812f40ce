"""The CUDA libraries installed on the host, found at the probe's start, before any process maps
them: a uprobe attaches to the file itself, so the first process to load one has its cold start
watched from its first call (the scanner in probe.py finds a library only once a process maps it,
after its cuInit has returned).

Found where the dynamic loader and the NVIDIA container toolkit look for them: each driver root's
loader cache (`etc/ld.so.cache`, read as data: a malformed one finds nothing) and the toolkit's
library directories under it (`cuda_driver_roots`: the host's own, /, and the GPU operator's driver
container's, /run/nvidia/driver), and the directories of `cuda_library_dirs` (GKE's driver
installer's by default). Host
paths are reached through the host's root, /proc/1/root (the DaemonSet shares the host's PID
namespace), or / where that is not ours to follow (the agent runs on the host itself).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("aiprobe.cuda")

DRIVER_ROOTS = ("/", "/run/nvidia/driver")  # the host's, the GPU operator's driver container
# The NVIDIA container toolkit's library search paths (internal/lookup/library.go), under each driver root.
TOOLKIT_DIRECTORIES = (
    "/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current", "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current", "/lib/aarch64-linux-gnu/nvidia/current",
)
LIBRARY_DIRECTORIES = ("/home/kubernetes/bin/nvidia/lib64",)  # GKE's driver installer's
LD_CACHE = "etc/ld.so.cache"
FOUND_IN_CACHE, FOUND_IN_DIRECTORY, FOUND_BY_PROCESS = "ld.so.cache", "directory", "process"

# glibc's loader cache ("new" format, also the tail of a "compat" one): a header, then entries
# whose name and path are offsets of NUL-terminated strings from the header's start.
_CACHE_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_MAGIC = b"ld.so-1.7.0"
_OLD_HEADER, _OLD_ENTRY = 16, 12  # magic + count; flags, name, path
_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, entries, string bytes, flags, extensions
_ENTRY = struct.Struct("<iIIIQ")  # flags, name, path, OS version, hwcap
_MAX_CACHE_BYTES = 64 << 20
_MAX_PATH = 4096
_MAX_SYMLINKS = 40  # as the kernel's path walk


class LdCacheError(ValueError):
    """A loader cache aiprobe does not read: the message says why."""


def _string(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset, offset + _MAX_PATH)
    if offset >= len(data) or end < 0:
        raise LdCacheError(f"string at {offset} outside the cache or unterminated")
    return os.fsdecode(data[offset:end])


def ld_cache_entries(data: bytes) -> list[tuple[str, str]]:
    """(library name, path) of each entry of a loader cache; LdCacheError for anything else."""
    if data.startswith(_OLD_MAGIC) and len(data) >= _OLD_HEADER:
        (old_entries,) = struct.unpack_from("<I", data, len(_OLD_MAGIC) + 1)
        data = data[(_OLD_HEADER + old_entries * _OLD_ENTRY + 7) & ~7:]
    if len(data) < _HEADER.size or not data.startswith(_CACHE_MAGIC):
        raise LdCacheError("not a glibc-ld.so.cache1.1 file")
    _, count, _, _, _ = _HEADER.unpack_from(data)
    if _HEADER.size + count * _ENTRY.size > len(data):
        raise LdCacheError(f"{count} entries do not fit in {len(data)} bytes")
    return [(_string(data, name), _string(data, path))
            for _, name, path, _, _ in _ENTRY.iter_unpack(data[_HEADER.size:_HEADER.size + count * _ENTRY.size])]


@dataclass(frozen=True)
class InstalledLibrary:
    """A CUDA library file found on the host at start."""

    path: str  # on the host, symlinks followed
    dev: int
    inode: int
    kind: str
    found: str  # FOUND_IN_CACHE or FOUND_IN_DIRECTORY
    host_root: str  # how the host's / is reached from here

    @property
    def key(self) -> tuple[int, int]:
        return self.dev, self.inode

    def host_path(self, _proc: Path) -> str:
        return under(self.host_root, self.path)


def under(root: str, path: str) -> str:
    """Absolute `path` inside `root`."""
    return os.path.join(root, path.lstrip("/"))


def maps_key(device: str, inode: str) -> tuple[int, int]:
    """(dev, inode) from a /proc/PID/maps line's fields; ValueError for what the kernel does not write."""
    major, minor = (int(part, 16) for part in device.split(":"))
    return os.makedev(major, minor), int(inode)


def mapped_key(path: str) -> tuple[int, int] | None:
    """The file's (dev, inode) as /proc/PID/maps shows it once mapped: the key of the files processes
    map (on overlayfs that may be the file underneath, not the one stat sees). None: not mappable."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 1, access=mmap.ACCESS_COPY) as view:
            start = f"{ctypes.addressof(ctypes.c_char.from_buffer(view)):x}-"
            with open("/proc/self/maps") as maps:
                fields = next(line.split() for line in maps if line.startswith(start))
            return maps_key(fields[3], fields[4])
    except (OSError, ValueError, StopIteration):  # unreadable, empty
        return None


def host_root(proc: Path) -> str:
    """The host's / from here: through its init process when we may follow that, else our own."""
    root = f"{proc}/1/root"
    return root if os.access(root, os.R_OK | os.X_OK) else "/"


def resolve(host: str, root: str, path: str) -> str | None:
    """`path` (inside driver root `root`) on the host, its last component's symlinks followed
    inside that root (ldconfig's links are relative; an absolute one must not leave the root);
    None: it leads nowhere."""
    path = under(root, path)
    for _ in range(_MAX_SYMLINKS):
        try:
            target = os.readlink(under(host, path))
        except FileNotFoundError:
            return None
        except OSError:  # not a symlink (EINVAL), or not ours to read: the path itself
            return path
        path = under(root, target) if target.startswith("/") else os.path.normpath(
            os.path.join(os.path.dirname(path), target))
    return None


def _cache_paths(root: str) -> list[str]:
    """The paths in the loader cache of `root` (a driver root, as reached from here), inside that root."""
    cache = under(root, LD_CACHE)
    try:
        with open(cache, "rb") as file:
            return [path for _, path in ld_cache_entries(file.read(_MAX_CACHE_BYTES))]
    except FileNotFoundError:
        return []
    except (OSError, LdCacheError) as exc:
        log.warning("cuda: %s: %s; its libraries are found once a process maps them", cache, exc)
        return []


def _directory_paths(root: str, directory: str) -> list[str]:
    """The paths of the files in `directory` of `root` (as reached from here), inside that root."""
    try:
        return sorted(os.path.join(directory, name) for name in os.listdir(under(root, directory)))
    except OSError:  # absent, or not a directory
        return []


def _candidates(roots: Iterable[str], directories: Iterable[str], host: str) -> Iterator[tuple[str, str, str]]:
    """(driver root, path in it, how found), loader caches first."""
    for root in roots:
        yield from ((root, path, FOUND_IN_CACHE) for path in _cache_paths(under(host, root)))
    for root in roots:
        for directory in TOOLKIT_DIRECTORIES:
            yield from ((root, path, FOUND_IN_DIRECTORY) for path in _directory_paths(under(host, root), directory))
    for directory in directories:
        yield from (("/", path, FOUND_IN_DIRECTORY) for path in _directory_paths(host, directory))


def installed_libraries(kind_of: Callable[[str], str | None], roots: Iterable[str] = DRIVER_ROOTS,
                        directories: Iterable[str] = LIBRARY_DIRECTORIES, host: str = "/") -> list[InstalledLibrary]:
    """Each CUDA library file (one per dev and inode) under the driver roots and directories, by
    the kind `kind_of` gives its name."""
    found: dict[tuple[int, int], InstalledLibrary] = {}
    for root, path, how in _candidates(roots, directories, host):
        kind = kind_of(path)
        resolved = resolve(host, root, path) if kind is not None else None
        if kind is None or resolved is None:
            continue
        try:
            regular = stat.S_ISREG(os.stat(under(host, resolved)).st_mode)
        except OSError:
            continue
        key = mapped_key(under(host, resolved)) if regular else None
        if key is not None and key not in found:
            found[key] = InstalledLibrary(resolved, *key, kind, how, host)
    return list(found.values())
