/* SPDX-License-Identifier: GPL-2.0 */
/* HTTP/2 (cleartext) and gRPC: the connection prefaces, the frame header (length, type, flags, stream)
 * and a gRPC message's prefix. */
#ifndef AIPROBE_HTTP2_H
#define AIPROBE_HTTP2_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "common.h"
#include "msg.h"

#define H2_DATA 0
#define H2_HEADERS 1
#define H2_RST_STREAM 3
#define H2_SETTINGS 4
#define H2_PUSH_PROMISE 5
#define H2_CONTINUATION 9
#define H2_END_STREAM 1		/* flag of DATA and HEADERS */
#define H2_END_HEADERS 0x4	/* flag of HEADERS: no CONTINUATION follows */
#define H2_PADDED 0x8		/* flag of DATA and HEADERS: a padding length byte first */
#define H2_PRIORITY 0x20	/* flag of HEADERS: 5 bytes of priority before the block */
#define H2_FRAME_HEADER 9	/* bytes */
/* The client's connection preface, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n": its length, its first 4 bytes. */
#define H2_CLIENT_PREFACE 24
#define H2_CLIENT_PREFACE_START BYTES4('P', 'R', 'I', ' ')

/* The server's connection preface: a SETTINGS frame on stream 0. */
static __always_inline bool is_h2_server_preface(const char *bytes, __u32 len)
{
	return len >= H2_FRAME_HEADER && bytes[3] == H2_SETTINGS && !bytes[5] && !bytes[6] && !bytes[7] && !bytes[8];
}

/* Up to 8 bytes at user address `from`, big-endian at the top of the result (zeros after). */
static __always_inline __u64 h2_read_top(__u64 from, __u64 n)
{
	__u64 word = 0;

	n = read_size_1_to_8(n);
	if (!n || bpf_probe_read_user(&word, n, (void *)from))
		return 0;
	return bpf_be64_to_cpu(word);
}

/* A frame header whose first `first` bytes (1-8) end the cursor's segment and whose rest begins the
 * next (writev of slices that are not frames: grpc-core's), into `header`. */
static __always_inline bool h2_read_split_header(struct msg_cursor *c, __u8 header[14])
{
	__u64 first = read_size_1_to_8(c->left), head, tail;	/* 1-8: below a frame header */
	struct iovec next;

	if (!first || !c->iov || c->segment + 1 >= c->segments ||
	    bpf_probe_read_kernel(&next, sizeof(next), (void *)(c->iov + (c->segment + 1) * sizeof(next))) ||
	    next.iov_len < H2_FRAME_HEADER - first)
		return false;
	head = h2_read_top(c->base, first);
	tail = h2_read_top((__u64)next.iov_base, H2_FRAME_HEADER - first);
	head |= tail >> (8 * first);
	for (int i = 0; i < 8; i++)
		header[i] = head >> (56 - 8 * i);
	header[8] = tail >> (8 * (first - 1));
	return true;
}

/* The frame header at the cursor into `header`, with a DATA frame's first 5 bytes (a gRPC message's
 * prefix) when the buffer holds them; false when it holds less than a frame header. */
static __always_inline bool h2_read_header(struct msg_cursor *c, __u8 header[14])
{
	if (c->left < H2_FRAME_HEADER)
		return h2_read_split_header(c, header);
	/* 14 bytes: the header and a DATA frame's first 5; only 9 where the buffer may end there. */
	return !bpf_probe_read_user(header, 14, (void *)c->base) ||
	       !bpf_probe_read_user(header, H2_FRAME_HEADER, (void *)c->base);
}

static __always_inline __u32 h2_length(const __u8 *header)
{
	return (__u32)header[0] << 16 | (__u32)header[1] << 8 | header[2];
}

static __always_inline __u32 h2_stream_id(const __u8 *header)
{
	return ((__u32)(header[5] & 0x7f) << 24) | (__u32)header[6] << 16 | (__u32)header[7] << 8 | header[8];
}

/* A gRPC message: a 1-byte compressed flag and its 4-byte big-endian length, filling the frame. */
static __always_inline bool is_grpc_message(const __u8 *prefix, __u32 frame_length)
{
	__u32 length = (__u32)prefix[1] << 24 | (__u32)prefix[2] << 16 | (__u32)prefix[3] << 8 | prefix[4];

	return prefix[0] <= 1 && length + 5 == frame_length;
}

#endif /* AIPROBE_HTTP2_H */
