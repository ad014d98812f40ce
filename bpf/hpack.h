/* SPDX-License-Identifier: GPL-2.0 */
/* HPACK (RFC 7541) as far as requests need it: a response's `:status` and its trailers' `grpc-status`,
 * read from every field of the server's header blocks, and a request's `:method` (the block's first field).
 *
 * The server's encoder indexes what it sends into a dynamic table, state of the whole connection: an
 * entry is referenced as 62 + k, k the number of insertions after it (from 0), for as long as it
 * exists, and an encoder never references an entry it evicted. So the table is modelled by the order of
 * insertions alone, no sizes: a ring of the last HPACK_RING, each holding what hpack_entry() says (a
 * :status and its value, a grpc-status and its value, or another field). Every field of every block
 * the server writes is walked (bpf_loop, one field per turn) to count insertions; a block that cannot be
 * walked to its end makes the table `lost`: from then on, dynamic indexes are not readable (unknown,
 * never wrong). */
#ifndef AIPROBE_HPACK_H
#define AIPROBE_HPACK_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "loop.h"
#include "msg.h"
#include "requests.h"

#define HPACK_RING 16		/* insertions kept per connection (a power of 2) */
#define HPACK_FIELDS LOOP_BOUND(24, 12)	/* fields walked per header block */
#define HPACK_STATIC 61		/* static table entries; dynamic indexes follow */

/* What a table entry (or a field) holds: a kind and its value (0: the value is not readable). */
#define HPACK_STATUS 0x8000	/* ":status", value the status code */
#define HPACK_GRPC_STATUS 0x4000	/* "grpc-status", value the code + 1 */
#define HPACK_UNKNOWN 0x2000	/* not known: a dynamic entry of a lost table, one named by such an
				 * entry, a name string across segments */
#define HPACK_VALUE 0x03ff
#define HPACK_OTHER 0		/* any other field */
#define HPACK_STOP 0xffff	/* not a field: the walk cannot go on */

/* The server's encoder's dynamic table, as far as it is modelled: per connection. */
struct hpack_table {
	__u16 entries[HPACK_RING];	/* by insertion, a ring: entry i % HPACK_RING is insertion i */
	__u32 inserted;		/* insertions of the sends that went out whole */
	__u8 pending;		/* insertions of the send in progress, after those */
	__u8 lost;		/* an insertion may have been missed: dynamic entries are unknown */
};

/* What a header block's walk found so far, and its bytes left (in map memory: plain numbers to the
 * verifier, so the walk's turns look alike). */
struct hpack_block {
	__u64 left;
	__u16 status;		/* the block's :status; 0: none readable */
	__u8 rpc_status;	/* its grpc-status + 1; 0: none readable */
	__u8 grpc;		/* it holds a grpc-status, readable or not */
};

/* One header block's walk: the cursor at its next field, the table, what it found. */
struct hpack_walk {
	struct msg_cursor *c;
	struct hpack_table *table;
	struct hpack_block *b;
};

/* "grpc-status", plain (11 bytes: its first 8, its last 3) and Huffman-coded (8 bytes). */
#define GRPC_STATUS_PLAIN8 0x677270632d737461ULL
#define GRPC_STATUS_PLAIN3 0x747573ULL
#define GRPC_STATUS_HUFFMAN 0x9acac8b21234da8fULL

/* The entry static index `index` is: ":status" 200, 204, 206, 304, 400, 404, 500 (8-14), or another. */
static __always_inline __u16 hpack_static(__u32 index)
{
	switch (index) {
	case 8: return HPACK_STATUS | 200;
	case 9: return HPACK_STATUS | 204;
	case 10: return HPACK_STATUS | 206;
	case 11: return HPACK_STATUS | 304;
	case 12: return HPACK_STATUS | 400;
	case 13: return HPACK_STATUS | 404;
	case 14: return HPACK_STATUS | 500;
	default: return HPACK_OTHER;
	}
}

/* The entry of index `index` (1-61 static, 62 on dynamic). */
static __always_inline __u16 hpack_entry(struct hpack_table *t, __u32 index)
{
	__u32 k, total = t->inserted + t->pending, slot;

	if (index <= HPACK_STATIC)
		return hpack_static(index);
	k = index - HPACK_STATIC - 1;
	if (t->lost || k >= HPACK_RING || k >= total)
		return HPACK_UNKNOWN;
	slot = total - 1 - k;
	barrier_var(slot);
	slot &= HPACK_RING - 1;
	return t->entries[slot];
}

static __always_inline void hpack_insert(struct hpack_table *t, __u16 entry)
{
	__u32 slot = t->inserted + t->pending;

	if (t->pending == 0xff) {
		t->lost = 1;
		return;
	}
	barrier_var(slot);
	slot &= HPACK_RING - 1;
	t->entries[slot] = entry;
	t->pending++;
}

/* The send in progress went out: whole (`sent`), its insertions count; otherwise the encoder's table
 * and this one may differ from here. */
static __always_inline void hpack_send_end(struct hpack_table *t, bool sent)
{
	if (!t->pending)
		return;
	if (sent)
		t->inserted += t->pending;
	else
		t->lost = 1;
	t->pending = 0;
}

/* Up to 8 bytes at the cursor, within its segment and the block, big-endian at the top of `word`
 * (zeros after); how many (0: none). */
static __always_inline __u32 hpack_peek(struct hpack_walk *w, __u64 *word)
{
	__u64 n = w->c->left < w->b->left ? w->c->left : w->b->left;

	*word = 0;
	n = read_size_1_to_8(n < 8 ? n : 8);
	if (!n || bpf_probe_read_user(word, n, (void *)w->c->base))
		return 0;
	*word = bpf_be64_to_cpu(*word);
	return n;
}

static __always_inline bool hpack_advance(struct hpack_walk *w, __u64 n)
{
	if (n > w->b->left)
		return false;
	w->b->left -= n;
	/* The block's last byte may be the write's last: the cursor cannot stand past it. */
	return !w->b->left || cursor_skip(w->c, n);
}

/* The integer with a `prefix`-bit prefix at the top of `word` (n bytes read), up to 3 continuation
 * bytes; its length in *used (0: longer, or past what was read). */
static __always_inline __u32 hpack_int(__u64 word, __u32 n, __u32 prefix, __u32 *used)
{
	__u32 max = (1U << prefix) - 1, value = (word >> 56) & max, byte;

	*used = 1;
	if (value < max)
		return value;
	for (int i = 1; i <= 3; i++) {
		byte = (word >> (56 - 8 * i)) & 0xff;
		value += (byte & 0x7f) << (7 * (i - 1));
		if (!(byte & 0x80)) {
			*used = i < (int)n ? i + 1 : 0;
			return value;
		}
	}
	*used = 0;
	return 0;
}

/* 1-3 decimal digits: `length` plain bytes, or Huffman-coded in `length` bytes (RFC 7541 Appendix B:
 * '0'-'2' are the 5-bit codes 00000-00010, '3'-'9' the 6-bit 011001-011111, padding under a byte of
 * ones), at the top of `word`; -1 otherwise. */
static __always_inline int hpack_digits(__u64 word, __u32 length, bool huffman)
{
	__u32 bits = length * 8, used = 0, digits = 0, value = 0, code, width, padding;

	if (!length || length > 3)
		return -1;
	word &= ~0ULL << (64 - bits);
	for (int i = 0; i < 3; i++) {
		if (!huffman) {
			if (i >= (int)length)
				break;
			code = (word >> 56) - '0';
			width = 8;
		} else if (word >> 62 == 0) {
			code = word >> 59;
			width = 5;
			if (code > 2)
				return -1;
		} else if (word >> 62 == 1) {
			code = (word >> 58) - 22;
			width = 6;
			if (code < 3)
				return -1;
		} else {
			break;	/* padding */
		}
		if (code > 9 || used + width > bits)
			return -1;
		value = value * 10 + code;
		used += width;
		word <<= width;
		digits++;
	}
	padding = bits - used;
	if (!digits || padding >= 8 || (padding && word >> (64 - padding) != (1ULL << padding) - 1))
		return -1;
	return value;
}

/* A string literal's header at the cursor (H bit, length), moved past: its length, -1 if not readable. */
static __always_inline long hpack_string(struct hpack_walk *w, bool *huffman)
{
	__u64 word;
	__u32 n = hpack_peek(w, &word), used, length;

	length = hpack_int(word, n, 7, &used);
	*huffman = word >> 63;
	if (!n || !used || !hpack_advance(w, used))
		return -1;
	return length;
}

/* A literal's name string, moved past: HPACK_GRPC_STATUS, HPACK_OTHER, or HPACK_UNKNOWN (split across
 * segments); HPACK_STOP if the walk cannot go on. */
static __always_inline __u16 hpack_name(struct hpack_walk *w)
{
	__u64 word;
	bool huffman;
	long length = hpack_string(w, &huffman);

	if (length < 0)
		return HPACK_STOP;
	if (length != (huffman ? 8 : 11))
		return hpack_advance(w, length) ? HPACK_OTHER : HPACK_STOP;
	if (hpack_peek(w, &word) < 8)
		return hpack_advance(w, length) ? HPACK_UNKNOWN : HPACK_STOP;
	if (!hpack_advance(w, 8))
		return HPACK_STOP;
	if (huffman)
		return word == GRPC_STATUS_HUFFMAN ? HPACK_GRPC_STATUS : HPACK_OTHER;
	if (word != GRPC_STATUS_PLAIN8)
		return hpack_advance(w, 3) ? HPACK_OTHER : HPACK_STOP;
	if (hpack_peek(w, &word) < 3)
		return hpack_advance(w, 3) ? HPACK_UNKNOWN : HPACK_STOP;
	if (!hpack_advance(w, 3))
		return HPACK_STOP;
	return word >> 40 == GRPC_STATUS_PLAIN3 ? HPACK_GRPC_STATUS : HPACK_OTHER;
}

/* A literal's value string, moved past: the field, `kind` | its value (`kind` alone where the value is
 * not readable); HPACK_STOP if the walk cannot go on. */
static __always_inline __u16 hpack_value(struct hpack_walk *w, __u16 kind)
{
	__u64 word;
	bool huffman;
	long length = hpack_string(w, &huffman);
	int value = -1;

	if (length < 0)
		return HPACK_STOP;
	if ((kind == HPACK_STATUS || kind == HPACK_GRPC_STATUS) && length <= 3 && hpack_peek(w, &word) >= length)
		value = hpack_digits(word, length, huffman);
	if (!hpack_advance(w, length))
		return HPACK_STOP;
	if (kind == HPACK_STATUS && value >= 200 && value <= 599)
		return kind | value;
	if (kind == HPACK_GRPC_STATUS && value >= 0 && value <= 16)
		return kind | (value + 1);
	return kind;
}

/* A field found in the block: the first :status and the last grpc-status it holds, readable or not. */
static __always_inline void hpack_found(struct hpack_walk *w, __u16 field)
{
	if ((field & HPACK_STATUS) && !w->b->status)
		w->b->status = field & HPACK_VALUE;
	if (field & HPACK_GRPC_STATUS) {
		w->b->rpc_status = field & HPACK_VALUE;
		w->b->grpc = 1;
	}
}

/* One field of the block at the cursor (the loop's callback): read, its insertion counted; stops at
 * the block's end, and where it cannot go on (w->b->left stays above 0). Not inlined in the bounded
 * build either: its paths end at its return, so the verifier walks each turn from fewer states. */
static __noinline long hpack_field(__u32 turn, struct hpack_walk *w)
{
	__u64 word;
	__u32 n, used, index;
	__u16 field;
	bool inserts;

	if (!w->b->left)
		return 1;
	n = hpack_peek(w, &word);
	if (!n)
		return 1;
	if (word >> 63) {				/* 1xxxxxxx: indexed */
		index = hpack_int(word, n, 7, &used);
		if (!used || !index || !hpack_advance(w, used))
			return 1;
		hpack_found(w, hpack_entry(w->table, index));
		return 0;
	}
	if (word >> 61 == 1) {				/* 001xxxxx: table size update */
		hpack_int(word, n, 5, &used);
		return used && hpack_advance(w, used) ? 0 : 1;
	}
	/* 01xxxxxx: a literal with incremental indexing; 0000xxxx, 0001xxxx: without. The name: an index,
	 * or 0 and a string; then the value string. */
	inserts = word >> 62 == 1;
	index = hpack_int(word, n, inserts ? 6 : 4, &used);
	if (!used || !hpack_advance(w, used))
		return 1;
	field = index ? hpack_entry(w->table, index) & ~HPACK_VALUE : hpack_name(w);
	if (field != HPACK_STOP)
		field = hpack_value(w, field);
	if (field == HPACK_STOP)
		return 1;
	hpack_found(w, field);
	if (inserts)
		hpack_insert(w->table, field);
	return 0;
}

/* Walk the header block of `length` bytes at cursor `c` (which it moves) into `b`: its :status and
 * grpc-status, and its insertions into `t` (lost where the walk stops before the block's end). */
static __always_inline void hpack_walk_block(struct hpack_table *t, struct msg_cursor *c, __u64 length,
					     struct hpack_block *b)
{
	struct hpack_walk w = { .c = c, .table = t, .b = b };

	b->left = length;
	b->status = 0;
	b->rpc_status = 0;
	b->grpc = 0;
	LOOP(HPACK_FIELDS, hpack_field, &w);
	if (b->left)
		t->lost = 1;
}

/* The block's first field, past a one-byte dynamic table size update: `word` holds the block's first
 * 8 bytes, big-endian. */
static __always_inline __u64 hpack_first_field(__u64 word)
{
	if (word >> 61 == 1 && word >> 56 != 0x3f)	/* 001xxxxx: a size update that fits its byte */
		return word << 8;
	return word;
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
