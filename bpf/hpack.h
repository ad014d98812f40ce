/* SPDX-License-Identifier: GPL-2.0 */
/* HPACK (RFC 7541), only as far as a block's first field: a response's `:status` and a request's
 * `:method`, which servers and clients put first. Readable: a static-table index (":status" 200, 204,
 * 206, 304, 400, 404, 500; ":method" GET, POST), and a literal ":status" (its name the static index 8,
 * its value plain or Huffman-coded digits). A dynamic-table index (a status sent before on the
 * connection, by an encoder that indexes it) refers to state this does not keep: not readable. */
#ifndef AIPROBE_HPACK_H
#define AIPROBE_HPACK_H

#include "vmlinux.h"
#include "requests.h"

#define HPACK_STATUS_NAME 8	/* static index of ":status" (200); 8-14: its values below */

/* The status of static-table entry `index`, 0 for an entry that is no status. */
static __always_inline __u16 hpack_static_status(__u8 index)
{
	switch (index) {
	case 8: return 200;
	case 9: return 204;
	case 10: return 206;
	case 11: return 304;
	case 12: return 400;
	case 13: return 404;
	case 14: return 500;
	default: return 0;
	}
}

/* Three decimal digits Huffman-coded (RFC 7541 Appendix B: '0'-'2' are the 5-bit codes 00000-00010,
 * '3'-'9' the 6-bit codes 011001-011111) in the `bytes` bytes left-aligned in `bits`; 0 otherwise. */
static __always_inline __u16 hpack_huffman_digits(__u32 bits, __u32 bytes)
{
	__u32 value = 0, used = 0, code;

	for (int i = 0; i < 3; i++) {
		if (bits >> 30 == 0) {
			code = bits >> 27;
			if (code > 2)
				return 0;
			bits <<= 5;
			used += 5;
		} else if (bits >> 30 == 1) {
			code = bits >> 26;
			if (code < 25)
				return 0;
			code -= 22;
			bits <<= 6;
			used += 6;
		} else {
			return 0;
		}
		value = value * 10 + code;
	}
	return used <= bytes * 8 && bytes * 8 - used < 8 ? value : 0;	/* padding: under a byte */
}

/* Three plain decimal digits, the top three bytes of `bits`; 0 otherwise. */
static __always_inline __u16 hpack_plain_digits(__u32 bits)
{
	__u32 value = 0, digit;

	for (int i = 0; i < 3; i++) {
		digit = (bits >> 24) - '0';
		if (digit > 9)
			return 0;
		value = value * 10 + digit;
		bits <<= 8;
	}
	return value;
}

/* The block's first field, past a one-byte dynamic table size update: `word` holds the block's first
 * 8 bytes, big-endian. */
static __always_inline __u64 hpack_first_field(__u64 word)
{
	if (word >> 61 == 1 && word >> 56 != 0x3f)	/* 001xxxxx: a size update that fits its byte */
		return word << 8;
	return word;
}

/* The `:status` a response's header block starts with (its first 8 bytes, big-endian); 0: not readable. */
static __always_inline __u16 hpack_status(__u64 word)
{
	__u8 first, length;
	__u32 value;
	__u16 status;

	word = hpack_first_field(word);
	first = word >> 56;
	if (first & 0x80)
		return hpack_static_status(first & 0x7f);
	/* A literal whose name is static index 8: with incremental indexing (01), without (0000) or never
	 * indexed (0001); then its value's length (the top bit: Huffman-coded) and the value. */
	if (first != (0x40 | HPACK_STATUS_NAME) && first != HPACK_STATUS_NAME && first != (0x10 | HPACK_STATUS_NAME))
		return 0;
	length = word >> 48;
	value = word >> 16;
	if (length == 3)
		status = hpack_plain_digits(value);
	else if (length == (0x80 | 2) || length == (0x80 | 3))
		status = hpack_huffman_digits(value, length & 0x7f);
	else
		return 0;
	return status >= 200 && status <= 599 ? status : 0;
}

/* The `:method` a request's header block starts with (static indexes 2 and 3). */
static __always_inline __u8 hpack_method(__u64 word)
{
	switch (hpack_first_field(word) >> 56) {
	case 0x82: return HTTP_METHOD_GET;
	case 0x83: return HTTP_METHOD_POST;
	default: return HTTP_METHOD_OTHER;
	}
}

#endif /* AIPROBE_HPACK_H */
