/* SPDX-License-Identifier: GPL-2.0 */
/* Reading the bytes of a send in progress (its msghdr's iov_iter) or of a read just returned, across
 * iovec segments and across kernels' iov_iter layouts. */
#ifndef AIPROBE_MSG_H
#define AIPROBE_MSG_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define MSG_SEGMENTS 32		/* iovec segments one skip crosses (gRPC writes each header name and value apart) */

/* Where the walk through a send's iovec segments stands (in map memory: plain numbers to the verifier,
 * so the frame walk's turns look alike). */
struct msg_cursor {
	__u64 iov;		/* kernel address of the iovec array; 0: one user buffer */
	__u64 base;		/* user address of the current segment's first byte not yet passed */
	__u64 left;		/* its bytes from there */
	__u64 segment;
	__u64 segments;
};

/* Before 6.4 the iovec array was iov_iter.iov (now __iov). */
struct iov_iter___pre_6_4 {
	const struct iovec *iov;
} __attribute__((preserve_access_index));

/* `n` where it is 1-8, else 0: a read's size, bounded for the verifier on the register returned. Two
 * comparisons (n && n <= 8) become one on a copy in clang's hands (n - 1 < 8), and a bound found on a
 * copy does not come back to `n` in 5.10's verifier (which then sees sizes of up to 9); a bound clang
 * knew is dropped as well, so 5.10 finds it again here. */
static __always_inline __u64 read_size_1_to_8(__u64 n)
{
	__u64 less = n - 1;

	if (less >= 8)
		return 0;
	barrier_var(less);
	return less + 1;
}

/* Before 5.14 the iterator's kind was `type`, with its direction (READ 0, WRITE 1) in the low bit. */
struct iov_iter___pre_5_14 {
	unsigned int type;
} __attribute__((preserve_access_index));

static __always_inline __u8 iter_type_of(struct iov_iter *iter)
{
	if (bpf_core_field_exists(iter->iter_type))
		return iter->iter_type;
	return ((struct iov_iter___pre_5_14 *)iter)->type & ~1U;
}

/* The cursor at a send's first byte: a user buffer (ITER_UBUF, 6.0+) or the first of an iovec
 * array's segments; false for anything else. `msg` is a BTF pointer (the fentry and tp_btf programs'
 * argument): its scalar fields are plain loads (a probe-read helper each cost ~30 ns on every send
 * looked at). Its pointers are probe-read: 6.1's verifier refuses arithmetic on a BTF pointer, and
 * 6.12's loses the type of one loaded at a CO-RE-relocated offset. Every layout detail through CO-RE
 * (the iter_type values and the array's name changed between kernels). */
static __always_inline bool cursor_start(struct msg_cursor *c, struct msghdr *msg)
{
	struct iov_iter *iter = &msg->msg_iter;
	__u64 offset = iter->iov_offset;
	__u8 type = iter_type_of(iter);
	struct iovec first;

	c->segment = 0;
	c->iov = 0;
	c->segments = 1;
	if (bpf_core_enum_value_exists(enum iter_type, ITER_UBUF) &&
	    type == bpf_core_enum_value(enum iter_type, ITER_UBUF)) {
		c->base = (__u64)BPF_CORE_READ(iter, ubuf) + offset;
		c->left = iter->count;
		return true;
	}
	if (type != bpf_core_enum_value(enum iter_type, ITER_IOVEC))
		return false;
	if (bpf_core_field_exists(iter->__iov))
		c->iov = (__u64)BPF_CORE_READ(iter, __iov);
	else
		c->iov = (__u64)BPF_CORE_READ((struct iov_iter___pre_6_4 *)iter, iov);
	if (!c->iov || bpf_probe_read_kernel(&first, sizeof(first), (void *)c->iov))
		return false;
	c->segments = iter->nr_segs;
	c->base = (__u64)first.iov_base + offset;
	c->left = first.iov_len - offset;
	return true;
}

/* Move `skip` bytes on, across segments; false past the end or past MSG_SEGMENTS hops. */
static __always_inline bool cursor_skip(struct msg_cursor *c, __u64 skip)
{
	struct iovec next;

	for (int hop = 0; hop < MSG_SEGMENTS; hop++) {
		if (skip < c->left) {
			c->base += skip;
			c->left -= skip;
			return true;
		}
		skip -= c->left;
		if (++c->segment >= c->segments || !c->iov ||
		    bpf_probe_read_kernel(&next, sizeof(next), (void *)(c->iov + c->segment * sizeof(next))))
			return false;
		c->base = (__u64)next.iov_base;
		c->left = next.iov_len;
	}
	return false;
}

#endif /* AIPROBE_MSG_H */
