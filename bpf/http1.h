/* SPDX-License-Identifier: GPL-2.0 */
/* HTTP/1.x responses, from the bytes of a write: a status line, Server-Sent Events (the content type
 * text/event-stream), the end of the headers, chunked encoding's last chunk; and where a response's
 * body ends, from its head (Content-Length, chunked). */
#ifndef AIPROBE_HTTP1_H
#define AIPROBE_HTTP1_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "common.h"
#include "requests.h"

/* A load the compiler must make where it is written (no copy kept from a store or an earlier load). */
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))

/* Of a response's first write, the bytes read to tell its protocol; the SSE content type is searched
 * for in these. A buffer passed to has_event_stream() holds this many. */
#define HTTP1_PEEK_BYTES 512

/* "HTTP/1." (len >= 8) */
static __always_inline bool is_http1(const char *bytes, __u64 len)
{
	return len >= 8 && first4(bytes) == BYTES4('H', 'T', 'T', 'P') && bytes[4] == '/' && bytes[5] == '1' &&
	       bytes[6] == '.';
}

/* --- searching bytes a word at a time --- */

/* The top bit of each byte of `word` that is `c` (where a byte of `word ^ c*8` is zero, subtracting 1 borrows
 * through its top bit). A byte above one that is `c` may be flagged too: a visit looks at its byte again. */
static __always_inline __u64 bytes_equal(__u64 word, char c)
{
	const __u64 ones = 0x0101010101010101ULL;
	__u64 x = word ^ (ones * (__u8)c);

	return (x - ones) & ~x & (ones << 7);
}

/* The index of the byte whose top bit is the lowest one set in `flags` (bytes_equal()'s). */
static __always_inline __u32 lowest_byte(__u64 flags)
{
	return (((flags & -flags) >> 7) * 0x0001020304050607ULL) >> 56;
}

/* Bytes equal to `c` visited in a word: enough for the '\n's of a head of CRLF lines (2 bytes at least
 * each), and for its 'v's, which a head holds few of (more than 4 in the word of "event-stream"'s, only
 * hostile, miss it: that response reads as `http`). */
#define BYTE_VISITS_PER_WORD 4

/* Each byte equal to `c` in the first `words` words of `bytes` (a map value's first bytes), lowest first,
 * until `visit(i, ctx)` returns nonzero. Most words hold none and cost one load and a few ALU ops. A plain
 * bounded loop, not bpf_loop: a call per turn cost more than the turn (a bpf_loop turn per byte cost nginx
 * ~400 ns per response, 6% of its CPU, in its ~170-byte head). `i` passes through `*at`, map memory: an
 * index the verifier tracks from the word keeps every turn's states apart (1M instructions walked on 6.12,
 * E2BIG); read back, it is bounded by visit's own checks. Bytes past the caller's length are a scratch's
 * leftovers: each visit checks the length first. */
static __always_inline void each_byte(const char *bytes, __u32 words, char c, __u32 *at,
				      long (*visit)(__u32 i, void *ctx), void *ctx)
{
	const __u64 *word = (const __u64 *)bytes;	/* a map value's start: aligned, one load a word */
	__u64 found;

	for (__u32 turn = 0; turn < words && turn < HTTP1_PEEK_BYTES / 8; turn++) {
		found = bytes_equal(word[turn], c);
		for (int n = 0; n < BYTE_VISITS_PER_WORD && found; n++) {
			*at = turn * 8 + lowest_byte(found);
			if (visit(READ_ONCE(*at), ctx))
				return;
			found &= found - 1;
		}
	}
}

/* Eight bytes as one little-endian word. */
#define BYTES8(a, b, c, d, e, f, g, h) ((__u64)BYTES4(a, b, c, d) | (__u64)BYTES4(e, f, g, h) << 32)
/* ASCII letters (and '-', ':', which have the bit already) in lower case: header names are case-insensitive. */
#define LOWER8 0x2020202020202020ULL

/* How a response's body ends, as its head tells (RFC 9112 6.3). */
enum http1_body {
	BODY_UNKNOWN,	/* at the connection's close, or not told in the bytes read (the head longer than them) */
	BODY_LENGTH,	/* after Content-Length bytes */
	BODY_CHUNKED,	/* at the last chunk */
};

/* A response's head, as far as its framing goes. */
struct http1_head {
	__u32 len;		/* the bytes searched */
	__u32 body_at;		/* the body's first byte; 0: the blank line is not in the bytes read */
	__u32 length_at;	/* Content-Length's value; 0: none */
	__u32 chunked_at;	/* Transfer-Encoding's value; 0: none */
	__s64 content_length;	/* -1: none */
	__u32 at;		/* each_byte()'s: the byte it visits */
};

/* The search of a response's head for its end and its framing headers. Its length and what it finds are in
 * `head`, in map memory, which the verifier does not track: a turn that finds a header, or compares the
 * length, leaves the same state as one that does not, so a bounded loop's turns are walked once each, not
 * once per place where each header may have been found or the bytes may end. */
struct head_search {
	const char *bytes;
	struct http1_head *head;
};

/* A '\n' at `i`: the line after it may be the blank line ending the head, or one of the headers. 1: the
 * search is over (the head's end, or the end of the bytes). */
static __always_inline long head_search_at(__u32 i, void *ctx)
{
	struct head_search *search = ctx;
	__u32 len = READ_ONCE(search->head->len);	/* read at each '\n' (above) */
	const char *line;
	__u64 name, rest;

	if (i + 3 > len || i > HTTP1_PEEK_BYTES - 20)
		return 1;
	line = search->bytes + i + 1;
	if (search->bytes[i] != '\n')
		return 0;
	if (line[0] == '\r' && line[1] == '\n') {
		search->head->body_at = i + 3;
		return 1;
	}
	if (i + 19 > len)
		return 0;
	__builtin_memcpy(&name, line, 8);
	__builtin_memcpy(&rest, line + 8, 8);
	name |= LOWER8;
	rest |= LOWER8;
	if (name == BYTES8('c', 'o', 'n', 't', 'e', 'n', 't', '-') &&
	    (rest & 0x00ffffffffffffffULL) == BYTES8('l', 'e', 'n', 'g', 't', 'h', ':', 0))
		search->head->length_at = i + 16;
	else if (name == BYTES8('t', 'r', 'a', 'n', 's', 'f', 'e', 'r') &&
		 rest == BYTES8('-', 'e', 'n', 'c', 'o', 'd', 'i', 'n') && (line[16] | 0x20) == 'g' && line[17] == ':')
		search->head->chunked_at = i + 19;
	return 0;
}

/* `at` within HTTP1_PEEK_BYTES, as the verifier sees it: masked where the compiler cannot drop the mask
 * (it would, having checked the bound on another register, which 5.10's verifier does not link). */
static __always_inline __u32 peek_index(__u32 at)
{
	return opaque(at) & (HTTP1_PEEK_BYTES - 1);
}

/* The search of a head for "event-stream" (the content type text/event-stream), by its 'v's, which few
 * other bytes of a head are: "ev" starts one byte before each. Its length and index are in `head` (map
 * memory), as the head search's. */
struct sse_search {
	const char *bytes;
	struct http1_head *head;
	bool found;
};

static __always_inline long sse_search_at(__u32 i, void *ctx)
{
	const __u64 event_st = 0x74732d746e657665ULL;	/* "event-st" little-endian */
	struct sse_search *search = ctx;
	__u32 start = peek_index(i - 1), tail;
	__u64 word;

	if (i + 11 > READ_ONCE(search->head->len))
		return 1;	/* the bytes end before "ream" would */
	if (!i || start > HTTP1_PEEK_BYTES - 12)
		return 0;
	__builtin_memcpy(&word, search->bytes + start, 8);
	if (word != event_st)
		return 0;
	__builtin_memcpy(&tail, search->bytes + start + 8, 4);
	search->found = tail == BYTES4('r', 'e', 'a', 'm');
	return search->found;
}

/* Whether a head's first `len` bytes name text/event-stream. `head` is map memory for the search. */
static __always_inline bool has_event_stream(const char *bytes, __u32 len, struct http1_head *head)
{
	struct sse_search search = { .bytes = bytes, .head = head };

	head->len = len;
	each_byte(bytes, (HTTP1_PEEK_BYTES - 12) / 8 + 1, 'v', &head->at, sse_search_at, &search);
	return search.found;
}

/* The first non-space byte of a header's value at `at` (up to 2 spaces skipped). */
static __always_inline __u32 header_value(const char *bytes, __u32 at)
{
	for (int i = 0; i < 2; i++) {
		if (at < HTTP1_PEEK_BYTES && bytes[peek_index(at)] == ' ')
			at++;
	}
	return at;
}

/* Content-Length's value at `at` (up to 12 digits); -1 where none is readable. */
static __always_inline __s64 content_length(const char *bytes, __u32 len, __u32 at)
{
	__s64 length = -1;
	__u32 j;
	char c;

	at = header_value(bytes, at);
	for (int i = 0; i < 12; i++) {
		j = at + i;
		if (j >= len || j >= HTTP1_PEEK_BYTES)
			break;
		c = bytes[peek_index(j)];
		if (c < '0' || c > '9')
			break;
		length = (length < 0 ? 0 : length * 10) + (c - '0');
	}
	return length;
}

/* Whether Transfer-Encoding's value at `at` is "chunked" (its only coding, as servers send it). */
static __always_inline bool chunked_value(const char *bytes, __u32 len, __u32 at)
{
	__u64 word = 0;

	at = header_value(bytes, at);
	if (at + 7 > len || at > HTTP1_PEEK_BYTES - 8)
		return false;
	__builtin_memcpy(&word, bytes + peek_index(at), 8);	/* within the map value: 8 bytes follow */
	return ((word | LOWER8) & 0x00ffffffffffffffULL) == BYTES8('c', 'h', 'u', 'n', 'k', 'e', 'd', 0);
}

/* A response head's framing, from its first `len` bytes, into `head` (map memory): how its body ends. */
static __always_inline __u8 response_body(const char *bytes, __u32 len, struct http1_head *head)
{
	struct head_search search = { .bytes = bytes, .head = head };
	__u32 length_at, chunked_at;

	__builtin_memset(head, 0, sizeof(*head));
	head->len = len;
	head->content_length = -1;
	each_byte(bytes, (HTTP1_PEEK_BYTES - 20) / 8 + 1, '\n', &head->at, head_search_at, &search);
	/* Read back from the map: the compiler keeps no copy of what a turn found (in a register or on the
	 * stack, the verifier would track it). */
	length_at = READ_ONCE(head->length_at);
	chunked_at = READ_ONCE(head->chunked_at);
	if (!READ_ONCE(head->body_at))
		return BODY_UNKNOWN;
	if (chunked_at && chunked_value(bytes, len, chunked_at))
		return BODY_CHUNKED;
	if (length_at)
		head->content_length = content_length(bytes, len, length_at);
	return head->content_length >= 0 ? BODY_LENGTH : BODY_UNKNOWN;
}

/* Chunked encoding's end, "0\r\n\r\n" (5 bytes). */
static __always_inline bool is_last_chunk(const char *bytes)
{
	return first4(bytes) == BYTES4('0', '\r', '\n', '\r') && bytes[4] == '\n';
}

/* The last 4 bytes of a write that ends the headers (the blank line after them), as first4() reads. */
#define HTTP1_HEADERS_END BYTES4('\r', '\n', '\r', '\n')

/* The status code of a status line ("HTTP/1.1 200 OK": len >= 12); 0 when it is none. */
static __always_inline __u16 http1_status(const char *bytes, __u64 len)
{
	__u16 status = 0;

	if (len < 12 || !is_http1(bytes, len) || bytes[8] != ' ')
		return 0;
	for (int i = 9; i < 12; i++) {
		if (bytes[i] < '0' || bytes[i] > '9')
			return 0;
		status = status * 10 + (bytes[i] - '0');
	}
	return status >= 200 && status <= 599 ? status : 0;
}

/* The request line's methods: its first 4 bytes, where the space after the name is. */
static const struct http1_method {
	__u32 first4;
	__u8 space_at;
	__u8 method;	/* enum http_method */
} http1_methods[] = {
	{ BYTES4('G', 'E', 'T', ' '), 3, HTTP_METHOD_GET },
	{ BYTES4('P', 'U', 'T', ' '), 3, HTTP_METHOD_PUT },
	{ BYTES4('P', 'O', 'S', 'T'), 4, HTTP_METHOD_POST },
	{ BYTES4('H', 'E', 'A', 'D'), 4, HTTP_METHOD_HEAD },
	{ BYTES4('P', 'A', 'T', 'C'), 5, HTTP_METHOD_PATCH },
	{ BYTES4('T', 'R', 'A', 'C'), 5, HTTP_METHOD_TRACE },
	{ BYTES4('D', 'E', 'L', 'E'), 6, HTTP_METHOD_DELETE },
	{ BYTES4('O', 'P', 'T', 'I'), 7, HTTP_METHOD_OPTIONS },
	{ BYTES4('C', 'O', 'N', 'N'), 7, HTTP_METHOD_CONNECT },
};

/* The method of a request line, from its first 8 bytes (the name and the space after it). */
static __always_inline __u8 http1_method(const char bytes[8])
{
	__u32 word = first4(bytes);

	for (int i = 0; i < sizeof(http1_methods) / sizeof(http1_methods[0]); i++) {
		if (word == http1_methods[i].first4 && bytes[http1_methods[i].space_at & 7] == ' ')
			return http1_methods[i].method;
	}
	return HTTP_METHOD_OTHER;
}

#endif /* AIPROBE_HTTP1_H */
