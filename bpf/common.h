/* SPDX-License-Identifier: GPL-2.0 */
/* Small helpers the programs share: BTF exports, map entries made on first use, counters, tc verdicts,
 * byte comparisons. User space decodes map keys and values from the object's BTF, so the structs in the
 * per-probe headers are the single source of their layout. */
#ifndef AIPROBE_COMMON_H
#define AIPROBE_COMMON_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

/* tc verdicts are #defines in uapi, so vmlinux.h lacks them. */
#define TC_ACT_UNSPEC (-1)
#define TC_ACT_OK 0

/* Puts `struct name` into the object's BTF (locals alone are not emitted), so user space can decode
 * ring-buffer records by struct name: BTF_EXPORT(slow_send_event); */
#define BTF_EXPORT(name) const volatile struct name *__btf_export_##name __attribute__((unused))
/* The same for `enum name`, whose enumerators user space reads (label values, in value order) rather
 * than copying them: BTF_EXPORT_ENUM(send_error); */
#define BTF_EXPORT_ENUM(name) const volatile enum name *__btf_export_enum_##name __attribute__((unused))

/* Adds 1 to entry `index` of a probe's counters (an ARRAY of __u64). */
static __always_inline void counter_inc(void *counters, __u32 index)
{
	__u64 *value = bpf_map_lookup_elem(counters, &index);

	if (value)
		__sync_fetch_and_add(value, 1);
}

/* The entry of `key` in a stats map, created from `zero` on first use; NULL when the map is full. */
static __always_inline void *lookup_or_init(void *map, const void *key, const void *zero)
{
	void *value = bpf_map_lookup_elem(map, key);

	if (value)
		return value;
	bpf_map_update_elem(map, key, zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, key);
}

/* Four bytes as one little-endian word, to compare a buffer's first four with first4(). */
#define BYTES4(a, b, c, d) ((__u32)(a) | (__u32)(b) << 8 | (__u32)(c) << 16 | (__u32)(d) << 24)

static __always_inline __u32 first4(const char *bytes)
{
	__u32 word;

	__builtin_memcpy(&word, bytes, 4);
	return word;
}

/* `value`, hidden from the compiler: a bound checked on it stays on the register that is used after. */
static __always_inline __u64 opaque(__u64 value)
{
	asm volatile("" : "+r"(value));
	return value;
}

#endif /* AIPROBE_COMMON_H */
