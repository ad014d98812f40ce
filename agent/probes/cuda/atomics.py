"""Whether the kernel takes BPF atomic fetch instructions (fetch-and-add and the like whose result is
used, 5.12), found by loading a program of four instructions holding one. Kernels without them
reject a whole program that holds one, even where it cannot run, so the cuda probe loads its
programs without them there (bpf/cuda.bpf.c, SYNC_PROGRAMS)."""

from __future__ import annotations

import functools
import os
import struct

from ... import libbpf

BPF_PROG_TYPE_SOCKET_FILTER = 1
# Opcodes (uapi/linux/bpf.h): class | size | mode.
_MOV64_IMM = 0x07 | 0xB0  # BPF_ALU64 | BPF_MOV | BPF_K
_STX_DW = 0x03 | 0x18 | 0x60  # BPF_STX | BPF_DW | BPF_MEM
_ATOMIC_DW = 0x03 | 0x18 | 0xC0  # BPF_STX | BPF_DW | BPF_ATOMIC
_EXIT = 0x05 | 0x90  # BPF_JMP | BPF_EXIT
BPF_ADD, BPF_FETCH = 0x00, 0x01
R0, R1, R10 = 0, 1, 10


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


# r0 = 0; *(u64 *)(r10 - 8) = r0; r0 = atomic_fetch_add((u64 *)(r10 - 8), r0); exit
_FETCH_ADD = b"".join((
    _insn(_MOV64_IMM, R0),
    _insn(_STX_DW, R10, R0, -8),
    _insn(_ATOMIC_DW, R10, R0, -8, BPF_ADD | BPF_FETCH),
    _insn(_EXIT),
))


@functools.cache
def fetch_atomics() -> bool:
    """The kernel verifies a program holding an atomic fetch-and-add (once per process)."""
    fd = libbpf.lib().bpf_prog_load(BPF_PROG_TYPE_SOCKET_FILTER, b"aiprobe_fetch", b"GPL", _FETCH_ADD,
                                    len(_FETCH_ADD) // 8, None)
    if fd < 0:
        return False
    os.close(fd)
    return True
