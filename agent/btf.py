"""BTF -> ctypes: map keys, values, ring-buffer events and .rodata come from the object's own BTF.

The BPF headers in bpf/ are the only definition of a struct's layout, and of the enums and array sizes
user space names (enum_names, array_length); user space never mirrors them by hand, so the two cannot
drift. `decode` turns an instance into plain Python values (dicts, ints, bytes) that collectors map to
metrics.
"""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_uint32
from pathlib import Path
from typing import Any

import numpy as np

from . import libbpf

# BTF kinds (uapi/linux/btf.h)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)
_MODIFIERS = {TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG}
_SIGNED = 1  # BTF_INT_SIGNED

_INTS = {
    (1, False): ctypes.c_uint8, (1, True): ctypes.c_int8,
    (2, False): ctypes.c_uint16, (2, True): ctypes.c_int16,
    (4, False): ctypes.c_uint32, (4, True): ctypes.c_int32,
    (8, False): ctypes.c_uint64, (8, True): ctypes.c_int64,
}


class BtfArray(ctypes.Structure):
    _fields_ = [("type", c_uint32), ("index_type", c_uint32), ("nelems", c_uint32)]


class BtfMember(ctypes.Structure):
    _fields_ = [("name_off", c_uint32), ("type", c_uint32), ("offset", c_uint32)]


class BtfVarSecinfo(ctypes.Structure):
    _fields_ = [("type", c_uint32), ("offset", c_uint32), ("size", c_uint32)]


class BtfEnum(ctypes.Structure):
    _fields_ = [("name_off", c_uint32), ("val", c_int32)]


class Btf:
    """Read access to one BTF blob (an object's, or vmlinux's) through libbpf."""

    def __init__(self, handle: int) -> None:
        self._handle = handle
        self._cache: dict[int, type] = {}

    @classmethod
    def parse_elf(cls, path: Path) -> Btf:
        """The BTF of an object file, read from its .BTF section: nothing is loaded into the kernel."""
        return cls(libbpf.new_ptr("btf__parse_elf", str(path).encode(), None))

    def kind(self, type_id: int) -> int:
        return (self._type(type_id).info >> 24) & 0x1F

    def name(self, type_id: int) -> str:
        raw = libbpf.lib().btf__name_by_offset(self._handle, self._type(type_id).name_off)
        return raw.decode() if raw else ""

    def find(self, name: str, kind: int) -> int:
        type_id = libbpf.lib().btf__find_by_name_kind(self._handle, name.encode(), kind)
        if type_id < 0:
            raise KeyError(f"no BTF type {name!r} of kind {kind}")
        return type_id

    def resolve(self, type_id: int) -> int:
        """Skip typedefs and qualifiers."""
        while self.kind(type_id) in _MODIFIERS:
            type_id = self._type(type_id).size_or_type
        return type_id

    def ctype(self, type_id: int) -> type:
        """The ctypes type with exactly the layout of BTF type `type_id`."""
        type_id = self.resolve(type_id)
        if type_id not in self._cache:
            self._cache[type_id] = self._build(type_id)
        return self._cache[type_id]

    def struct_ctype(self, name: str) -> type:
        return self.ctype(self.find(name, STRUCT))

    def enum_names(self, name: str) -> list[str]:
        """The enumerators of `enum name`, in value order."""
        values = self.enum_values(name)
        return sorted(values, key=values.__getitem__)

    def enum_values(self, name: str) -> dict[str, int]:
        """The enumerators of `enum name` and their values."""
        return {self._member_name(member): member.val for member in self._trailing(self.find(name, ENUM), BtfEnum)}

    def array_length(self, struct: str, member: str) -> int:
        """The number of elements of array `member` of `struct struct`."""
        struct_id = self.find(struct, STRUCT)
        for field in self._trailing(struct_id, BtfMember):
            if self._member_name(field) == member:
                array_id = self.resolve(field.type)
                if self.kind(array_id) != ARRAY:
                    raise TypeError(f"{struct}.{member} is not an array")
                return int(self._trailing_one(array_id, BtfArray).nelems)
        raise KeyError(f"struct {struct} has no member {member!r}")

    def datasec_vars(self, section: str) -> dict[str, tuple[int, int]]:
        """Variables of a DATASEC such as '.rodata': name -> (offset, type id)."""
        sec_id = self.find(section, DATASEC)
        out = {}
        for info in self._trailing(sec_id, BtfVarSecinfo):
            var = self._type(info.type)
            out[self.name(info.type)] = (info.offset, var.size_or_type)
        return out

    # --- internals ---

    def _type(self, type_id: int) -> libbpf.BtfType:
        ptr = libbpf.lib().btf__type_by_id(self._handle, type_id)
        if not ptr:
            raise KeyError(f"no BTF type id {type_id}")
        return ptr.contents

    def _trailing(self, type_id: int, item: type) -> list:
        """The records that follow a btf_type (members, var infos), `vlen` of them."""
        head = self._type(type_id)
        vlen = head.info & 0xFFFF
        base = ctypes.addressof(head) + ctypes.sizeof(libbpf.BtfType)
        return list((item * vlen).from_address(base))

    def _build(self, type_id: int) -> type:
        head = self._type(type_id)
        kind = self.kind(type_id)
        if kind == INT:
            encoding = c_uint32.from_address(ctypes.addressof(head) + ctypes.sizeof(libbpf.BtfType)).value
            signed = bool((encoding >> 24) & _SIGNED)
            if head.size_or_type == 16:
                return ctypes.c_uint8 * 16
            return _INTS[(head.size_or_type, signed)]
        if kind in (ENUM, ENUM64):
            return _INTS[(head.size_or_type, False)]
        if kind == PTR:
            return ctypes.c_uint64
        if kind == DATASEC:  # a global-data map's whole section; variables via datasec_vars()
            return ctypes.c_uint8 * head.size_or_type
        if kind == ARRAY:
            arr = self._trailing_one(type_id, BtfArray)
            return self.ctype(arr.type) * arr.nelems
        if kind in (STRUCT, UNION):
            return self._build_record(type_id, head, kind)
        raise TypeError(f"BTF kind {kind} of type {self.name(type_id)!r} has no ctypes mapping")

    def _trailing_one(self, type_id: int, item: type) -> Any:
        head = self._type(type_id)
        return item.from_address(ctypes.addressof(head) + ctypes.sizeof(libbpf.BtfType))

    def _build_record(self, type_id: int, head: libbpf.BtfType, kind: int) -> type:
        # Fields at explicit byte offsets: ctypes has no offset attribute, so gaps become padding
        # and _pack_ = 1 stops ctypes from adding its own.
        has_bitfields = bool(head.info >> 31)
        fields: list[tuple[str, type]] = []
        cursor = 0
        for index, member in enumerate(self._trailing(type_id, BtfMember)):
            bit_offset = member.offset & 0xFFFFFF if has_bitfields else member.offset
            if has_bitfields and member.offset >> 24:
                raise TypeError(f"bitfield in {self.name(type_id)!r} is not supported")
            name = self._member_name(member) or f"_anon{index}"
            member_type = self.ctype(member.type)
            offset = bit_offset // 8
            if kind == STRUCT and offset > cursor:
                fields.append((f"_pad{index}", ctypes.c_uint8 * (offset - cursor)))
            fields.append((name, member_type))
            cursor = max(cursor, offset + ctypes.sizeof(member_type))
        size = head.size_or_type
        if kind == STRUCT and size > cursor:
            fields.append(("_pad_end", ctypes.c_uint8 * (size - cursor)))
        base = ctypes.Structure if kind == STRUCT else ctypes.Union
        record = type(self.name(type_id) or f"anon_{type_id}", (base,), {"_pack_": 1, "_fields_": fields})
        if ctypes.sizeof(record) != size:
            raise TypeError(f"layout of {self.name(type_id)!r} does not match BTF size {size}")
        return record

    def _member_name(self, member: BtfMember | BtfEnum) -> str:
        raw = libbpf.lib().btf__name_by_offset(self._handle, member.name_off)
        return raw.decode() if raw else ""


def kernel_enum_names(name: str) -> list[str]:
    """The enumerators of the running kernel's `enum name`, from its BTF, in value order."""
    handle = libbpf.new_ptr("btf__load_vmlinux_btf")
    try:
        return Btf(handle).enum_names(name)
    finally:
        libbpf.lib().btf__free(handle)


def decode(value: Any) -> Any:
    """A ctypes value as plain Python: structs -> dict (padding dropped), byte arrays -> bytes."""
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {
            name: decode(getattr(value, name))
            for name, _ in value._fields_
            if not name.startswith("_pad")
        }
    if isinstance(value, ctypes.Array):
        if value._type_ in (ctypes.c_uint8, ctypes.c_int8, ctypes.c_char):  # incl. C `char` arrays
            return bytes(value)
        if issubclass(value._type_, ctypes._SimpleCData):  # numbers: one slice, not a call per item
            return value[:]  # (a histogram's 433 slots, per entry per refresh)
        return [decode(item) for item in value]
    return value


def field_offset(ctype: Any, path: str) -> int:
    """Where a field of a struct typed from BTF starts: `path` names it through nested structs ("latency.count")."""
    offset = 0
    for name in path.split("."):
        offset += getattr(ctype, name).offset
        ctype = dict(ctype._fields_)[name]
    return offset


def u64_field(rows: np.ndarray[Any, np.dtype[np.uint8]], ctype: Any, path: str,
              count: int = 1) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A u64 field (or `count` of them in a row) of map values of BTF type `ctype`, an (entries, value size)
    byte array: an (entries, count) view of it, no Python object per entry."""
    start = field_offset(ctype, path)
    return rows[:, start:start + 8 * count].view(np.uint64)


def dtype_of(ctype: Any, names: tuple[str, ...]) -> np.dtype[Any]:
    """A numpy dtype over these fields of a struct typed from BTF (its size, padding skipped)."""
    formats = []
    for name in names:
        member = getattr(ctype, name)
        formats.append(f"V{member.size}" if member.size == 16 else f"<u{member.size}")
    offsets = [getattr(ctype, name).offset for name in names]
    return np.dtype({"names": list(names), "formats": formats, "offsets": offsets, "itemsize": ctypes.sizeof(ctype)})
