/* SPDX-License-Identifier: GPL-2.0 */
/* Log-linear histogram of durations (HdrHistogram-style): 16 sub-buckets per power of two, so a
 * bucket is at most 1/16 (6.25%) wider than its lower bound and a quantile interpolated inside it is
 * within that of the truth. Durations are counted in units of 2^-14 ms (61.03515625 ns): then every
 * m * 2^k ms with m < 32 is a bucket edge, among them the shipped rules' thresholds (2, 5, 20 and 50
 * ms), so "p99 above 50 ms" reads exactly. Slot i < 32 holds units [i, i + 1); above, slot
 * 16 * s + m (16 <= m < 32) holds [m * 2^s, (m + 1) * 2^s). The last slot holds everything from
 * 2^16 ms (65.536 s) up. agent/histogram.py decodes the slots. */
#ifndef AIPROBE_HIST_H
#define AIPROBE_HIST_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#define HIST_SUB_BITS 4
#define HIST_SUB (1 << HIST_SUB_BITS)
#define HIST_MAX_UNITS (1ULL << 30)		/* 2^16 ms */
#define HIST_MAX_NS 65536000000ULL		/* the same in ns */
#define HIST_SLOTS 433				/* 25 octaves of 16 above 32 linear slots, and the open one */
/* units = ns * 2^14 / 10^6, as a multiply and shift: ns * round(2^32 * 0.016384) >> 32; exact to a
 * few ns below HIST_MAX_NS, where the product still fits 64 bits. */
#define HIST_UNITS_MUL 70368744ULL

struct hist {
	__u64 slots[HIST_SLOTS];
	__u64 count;
	__u64 sum_ns;
};

static __always_inline __u32 msb_index(__u64 v)
{
	__u32 msb = 0;

	/* Unrolled binary search: bounded, verifier-friendly. */
	if (v >= (1ULL << 32)) { v >>= 32; msb += 32; }
	if (v >= (1ULL << 16)) { v >>= 16; msb += 16; }
	if (v >= (1ULL << 8)) { v >>= 8; msb += 8; }
	if (v >= (1ULL << 4)) { v >>= 4; msb += 4; }
	if (v >= (1ULL << 2)) { v >>= 2; msb += 2; }
	if (v >= (1ULL << 1)) { msb += 1; }
	return msb;
}

static __always_inline __u32 hist_slot(__u64 value_ns)
{
	__u64 units;
	__u32 shift;

	if (value_ns >= HIST_MAX_NS)
		return HIST_SLOTS - 1;
	units = (value_ns * HIST_UNITS_MUL) >> 32;
	if (units < 2 * HIST_SUB)
		return units;
	shift = msb_index(units) - HIST_SUB_BITS;
	return shift * HIST_SUB + (units >> shift);
}

static __always_inline void hist_add(struct hist *h, __u64 value_ns)
{
	__u64 slot = hist_slot(value_ns);

	/* The check must be on the register that indexes: 6.1's verifier does not carry a bound over
	 * to a 32-bit copy, and the compiler checked one copy and indexed with another. */
	barrier_var(slot);
	if (slot < HIST_SLOTS)
		__sync_fetch_and_add(&h->slots[slot], 1);
	__sync_fetch_and_add(&h->count, 1);
	__sync_fetch_and_add(&h->sum_ns, value_ns);
}

/* Adds the time from `start` to `end` to `h` (a TTFB, a duration); false, adding nothing, when `end`
 * precedes `start` (a read and a write of two threads racing on one connection): no made-up value in
 * the last slot. */
static __always_inline bool hist_add_span(struct hist *h, __u64 start, __u64 end)
{
	if (end < start)
		return false;
	hist_add(h, end - start);
	return true;
}

#endif /* AIPROBE_HIST_H */
