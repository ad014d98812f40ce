/* SPDX-License-Identifier: GPL-2.0 */
/* Helpers shared by every aiprobe BPF program. User space decodes map keys and values from the
 * object's BTF, so the structs in the per-probe headers are the single source of their layout. */
#ifndef AIPROBE_COMMON_H
#define AIPROBE_COMMON_H

/* tc verdicts are #defines in uapi, so vmlinux.h lacks them. */
#define TC_ACT_UNSPEC (-1)
#define TC_ACT_OK 0

/* Puts `struct name` into the object's BTF (locals alone are not emitted), so user space can decode
 * ring-buffer records by struct name: BTF_EXPORT(slow_send_event); */
#define BTF_EXPORT(name) const volatile struct name *__btf_export_##name __attribute__((unused))

/* log2 histogram of nanoseconds: slot i counts values in [2^i, 2^(i+1)) ns; the last slot is
 * open-ended (2^35 ns is about 34 s). User space turns slots into cumulative `le` buckets. */
#define HIST_SLOTS 36

struct hist {
	__u64 slots[HIST_SLOTS];
	__u64 count;
	__u64 sum_ns;
};

static __always_inline __u32 log2_slot(__u64 v)
{
	__u32 slot = 0;

	/* Unrolled binary search: bounded, verifier-friendly. */
	if (v >= (1ULL << 32)) { v >>= 32; slot += 32; }
	if (v >= (1ULL << 16)) { v >>= 16; slot += 16; }
	if (v >= (1ULL << 8)) { v >>= 8; slot += 8; }
	if (v >= (1ULL << 4)) { v >>= 4; slot += 4; }
	if (v >= (1ULL << 2)) { v >>= 2; slot += 2; }
	if (v >= (1ULL << 1)) { slot += 1; }
	return slot < HIST_SLOTS ? slot : HIST_SLOTS - 1;
}

static __always_inline void hist_add(struct hist *h, __u64 value_ns)
{
	__sync_fetch_and_add(&h->slots[log2_slot(value_ns)], 1);
	__sync_fetch_and_add(&h->count, 1);
	__sync_fetch_and_add(&h->sum_ns, value_ns);
}

#endif /* AIPROBE_COMMON_H */
