"""The CUDA libraries found installed at start (aiprobe.probes.cuda.discovery): loader caches made by
the host's own ldconfig, hostile caches, symlinks kept inside their driver root. The cold start of the
first process to map one is in tests/test_cuda.py."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiprobe.probes.cuda.discovery import LdCacheError, installed_libraries, ld_cache_entries, resolve
from aiprobe.probes.cuda.probe import _library_kind, mapped_cuda_libraries

LIBRARIES = ("libcuda.so.550.54", "libcudart.so.12", "libz.so.1")


def _root(tmp_path: Path, *libraries: str) -> Path:
    """A driver root whose /opt/lib holds small shared objects named `libraries` (each its own soname)
    and whose loader cache ldconfig built, in the new format and (etc/compat.cache) in compat."""
    root = tmp_path / "root"
    (root / "opt/lib").mkdir(parents=True)
    (root / "etc").mkdir()
    source = tmp_path / "lib.c"
    source.write_text("int cuInit(unsigned flags) { return 0; }\n")
    for name in libraries:
        soname = "libcuda.so.1" if name.startswith("libcuda.so") else name
        subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", root / "opt/lib" / name, source],
                       check=True)
    (root / "etc/ld.so.conf").write_text("/opt/lib\n")
    for cache, fmt in (("/etc/ld.so.cache", "new"), ("/etc/compat.cache", "compat")):
        subprocess.run(["ldconfig", "-c", fmt, "-r", root, "-C", cache, "-f", "/etc/ld.so.conf"], check=True,
                       capture_output=True)
    return root


def test_cache_entries_are_those_ldconfig_prints(tmp_path) -> None:
    root = _root(tmp_path, *LIBRARIES)
    printed = subprocess.run(["ldconfig", "-p", "-C", root / "etc/ld.so.cache"], check=True, capture_output=True,
                             text=True).stdout
    expected = sorted((line.split()[0], line.split(" => ")[1]) for line in printed.splitlines()[1:] if " => " in line)
    assert expected == [("libcuda.so.1", "/opt/lib/libcuda.so.1"), ("libcudart.so.12", "/opt/lib/libcudart.so.12"),
                        ("libz.so.1", "/opt/lib/libz.so.1")]
    for cache in ("ld.so.cache", "compat.cache"):
        assert sorted(ld_cache_entries((root / "etc" / cache).read_bytes())) == expected, cache


def test_every_truncated_or_garbage_cache_is_refused_with_a_reason(tmp_path) -> None:
    data = (_root(tmp_path, *LIBRARIES) / "etc/ld.so.cache").read_bytes()
    strings_end = data.rindex(b"/opt/lib/") + len(b"/opt/lib/libcuda.so.1")  # after that, ldconfig's extensions
    for length in range(len(data)):
        if length > strings_end:
            assert len(ld_cache_entries(data[:length])) == 3
        else:
            with pytest.raises(LdCacheError):
                ld_cache_entries(data[:length])
    header_and_entries = 48 + 3 * 24
    for garbage in (b"", os.urandom(4096), data[:20] + os.urandom(4096), b"ld.so-1.7.0\0\xff\xff\xff\xff",
                    data[:header_and_entries] + b"\xff" * 64,  # string offsets past the end
                    data[:20] + (1 << 31).to_bytes(4, "little") + data[24:]):  # more entries than fit
        with pytest.raises(LdCacheError):
            ld_cache_entries(garbage)


def test_a_broken_cache_finds_nothing_and_the_directories_still_do(tmp_path) -> None:
    root = _root(tmp_path, "libcuda.so.550.54")
    (root / "etc/ld.so.cache").write_bytes(b"glibc-ld.so.cache1.1" + os.urandom(200))
    assert installed_libraries(_library_kind, (str(root),), ()) == []
    [found] = installed_libraries(_library_kind, (str(root),), (str(root / "opt/lib"),))
    assert (found.path, found.kind, found.found) == (str(root / "opt/lib/libcuda.so.550.54"), "driver", "directory")
    (root / "usr/lib64").mkdir(parents=True)  # where the NVIDIA container toolkit looks, in the driver root
    shutil.copy(root / "opt/lib/libcuda.so.550.54", root / "usr/lib64/libcuda.so.1")
    [found] = installed_libraries(_library_kind, (str(root),), ())
    assert (found.path, found.found) == (str(root / "usr/lib64/libcuda.so.1"), "directory")


def test_each_file_is_found_once_through_its_symlinks_with_the_cache_first(tmp_path) -> None:
    root = _root(tmp_path, *LIBRARIES)
    found = installed_libraries(_library_kind, (str(root),), (str(root / "opt/lib"),))
    assert sorted((lib.path, lib.kind, lib.found) for lib in found) == [
        (str(root / "opt/lib/libcuda.so.550.54"), "driver", "ld.so.cache"),
        (str(root / "opt/lib/libcudart.so.12"), "runtime", "ld.so.cache")]
    # Not stat's (dev, inode): on overlayfs (a guest's /tmp) a mapping shows the file underneath.
    [driver] = [lib for lib in found if lib.kind == "driver"]
    assert driver.key == _key_a_process_sees(root / "opt/lib/libcuda.so.550.54")


def test_an_absolute_symlink_is_followed_inside_its_driver_root(tmp_path) -> None:
    root = _root(tmp_path, "libcuda.so.550.54")
    (root / "opt/lib/libcuda.so").symlink_to("/opt/lib/libcuda.so.1")  # absolute: inside the root, not ours
    (root / "opt/lib/loop.so").symlink_to("loop.so")
    assert resolve("/", str(root), "/opt/lib/libcuda.so") == str(root / "opt/lib/libcuda.so.550.54")
    assert resolve("/", str(root), "/opt/lib/loop.so") is None
    assert resolve("/", str(root), "/opt/lib/absent.so") is None


def _key_a_process_sees(path: Path) -> tuple[int, int]:
    """The file's (dev, inode) as the scanner reads it in the maps of a process mapping it (this one)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ):
        [mapped] = [lib for lib in mapped_cuda_libraries(os.getpid()) if Path(lib.path).name == path.name]
    return mapped.key


@contextlib.contextmanager
def _mounted(kind: str, target: Path, options: str = "") -> Iterator[Path]:
    subprocess.run(["mount", "-t", kind, kind, *(("-o", options) if options else ()), target], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", target], check=True)


def test_a_file_on_overlayfs_has_the_key_of_a_process_mapping_it(tmp_path) -> None:
    """The GPU operator's driver root is a container's overlayfs: a file found there must have the key the
    scanner reads in /proc/PID/maps (on some kernels the file underneath), or it would be probed twice."""
    root = _root(tmp_path, "libcuda.so.550.54")
    (tmp_path / "layers").mkdir()
    with _mounted("tmpfs", tmp_path / "layers") as layers:  # an upper layer must not be on overlayfs itself
        lower, upper, work, merged = (layers / name for name in ("lower", "upper", "work", "merged"))
        for directory in (lower, upper, work, merged):
            directory.mkdir()
        shutil.copy(root / "opt/lib/libcuda.so.550.54", lower)
        with _mounted("overlay", merged, f"lowerdir={lower},upperdir={upper},workdir={work}"):
            [installed] = installed_libraries(_library_kind, (), (str(merged),))
            assert installed.key == _key_a_process_sees(merged / "libcuda.so.550.54")
