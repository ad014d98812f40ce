"""File offsets of functions in ELF files that other processes control.

A container can make the agent look at any file it names `libcuda.so*`, so nothing here trusts the
file: the header is checked before anything else is read, every table must lie inside the file,
the work per file is bounded (tables, symbols, string bytes), and names are compared as bytes,
never decoded or interpreted. uprobes are then attached at the offsets found here, so libbpf never
parses the file itself.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_SECTIONS = 4096
MAX_SEGMENTS = 256
MAX_SYMBOLS = 1_000_000  # per symbol table; libcuda's .dynsym has a few thousand
MAX_STRINGS_BYTES = 64 << 20  # per string table

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64, _ELFDATA2LSB = 2, 1
_ET_EXEC, _ET_DYN = 2, 3
_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SEGMENT = struct.Struct("<IIQQQQQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_PT_LOAD, _PF_X = 1, 1
_STT_FUNC = 2


class ElfError(ValueError):
    """The file is not a 64-bit little-endian ELF object this reader accepts (the reason says why)."""


@dataclass(frozen=True)
class _Section:
    kind: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class _Segment:
    offset: int
    vaddr: int
    filesz: int


class _Reader:
    def __init__(self, fd: int, size: int) -> None:
        self._fd, self.size = fd, size

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ElfError(f"{what} lies outside the file")
        data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise ElfError(f"{what}: short read")
        return data


def _header(reader: _Reader) -> tuple[Any, ...]:
    if reader.size < _HEADER.size:
        raise ElfError("shorter than an ELF header")
    header = _HEADER.unpack(reader.read(0, _HEADER.size, "header"))
    ident, e_type = header[0], header[1]
    if ident[:4] != _ELF_MAGIC:
        raise ElfError("not an ELF file")
    if ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB:
        raise ElfError("not a 64-bit little-endian ELF file")
    if e_type not in (_ET_EXEC, _ET_DYN):
        raise ElfError("neither a shared object nor an executable")
    return header


def _sections(reader: _Reader, header: tuple[Any, ...]) -> list[_Section]:
    shoff, shentsize, shnum = header[6], header[11], header[12]
    if shnum > MAX_SECTIONS or (shnum and shentsize != _SECTION.size):
        raise ElfError("unexpected section header table")
    table = reader.read(shoff, shnum * _SECTION.size, "section headers") if shnum else b""
    return [_Section(s[1], s[4], s[5], s[6], s[9]) for s in _SECTION.iter_unpack(table)]


def _executable_segments(reader: _Reader, header: tuple[Any, ...]) -> list[_Segment]:
    phoff, phentsize, phnum = header[5], header[9], header[10]
    if phnum > MAX_SEGMENTS or (phnum and phentsize != _SEGMENT.size):
        raise ElfError("unexpected program header table")
    table = reader.read(phoff, phnum * _SEGMENT.size, "program headers") if phnum else b""
    return [_Segment(p[2], p[3], p[5]) for p in _SEGMENT.iter_unpack(table) if p[0] == _PT_LOAD and p[1] & _PF_X]


def _file_offset(segments: list[_Segment], vaddr: int) -> int | None:
    for segment in segments:
        if segment.vaddr <= vaddr < segment.vaddr + segment.filesz:
            return vaddr - segment.vaddr + segment.offset
    return None


def _functions(reader: _Reader, sections: list[_Section], table: _Section,
               wanted: dict[bytes, str]) -> dict[str, int]:
    """Virtual addresses of the wanted functions a symbol table defines."""
    if table.entsize != _SYMBOL.size or table.size % _SYMBOL.size or table.size // _SYMBOL.size > MAX_SYMBOLS:
        raise ElfError("unexpected symbol table")
    if not 0 <= table.link < len(sections):
        raise ElfError("symbol table without its string table")
    strings_section = sections[table.link]
    if strings_section.size > MAX_STRINGS_BYTES:
        raise ElfError("string table too large")
    strings = reader.read(strings_section.offset, strings_section.size, "string table")
    longest = max(map(len, wanted), default=0) + 1
    found: dict[str, int] = {}
    for st_name, st_info, _other, st_shndx, st_value, _size in _SYMBOL.iter_unpack(
            reader.read(table.offset, table.size, "symbol table")):
        if st_info & 0xF != _STT_FUNC or not st_shndx or not st_value:
            continue
        name = wanted.get(strings[st_name:st_name + longest].split(b"\0", 1)[0])
        if name is not None:
            found.setdefault(name, st_value)
    return found


def function_offsets(path: str, names: Iterable[str]) -> dict[str, int]:
    """File offsets of those of `names` that the ELF file at `path` defines as functions (its
    .dynsym first, then .symtab: a statically linked library's functions are only there). Raises
    ElfError for a file this reader does not accept, OSError when it cannot be read."""
    wanted = {name.encode(): name for name in names}
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        reader = _Reader(fd, os.fstat(fd).st_size)
        header = _header(reader)
        sections = _sections(reader, header)
        segments = _executable_segments(reader, header)
        addresses: dict[str, int] = {}
        for kind in (_SHT_DYNSYM, _SHT_SYMTAB):
            for table in (s for s in sections if s.kind == kind):
                for name, vaddr in _functions(reader, sections, table, wanted).items():
                    addresses.setdefault(name, vaddr)
    finally:
        os.close(fd)
    offsets = {name: _file_offset(segments, vaddr) for name, vaddr in addresses.items()}
    return {name: offset for name, offset in offsets.items() if offset is not None}
