/* SPDX-License-Identifier: GPL-2.0 */
/* Token streams seen from the wire: per response of a TCP server socket, time to first byte, the gaps
 * between its writes, its duration, chunks and bytes; stalls (gaps above a threshold) as ring-buffer
 * events with the evidence of their cause. agent/streams.py reads the types of streams.h through BTF.
 *
 * No program of its own on the send path: sendlat's programs call stream_send_begin() where a send
 * starts (they have its msghdr there) and stream_send_end() where it returns, so a send pays one
 * socket-storage lookup (sockets that are not accepted server connections have none). The receive
 * side (streams_recv) and the connection's life (streams_set_state) are the two programs added. A socket
 * without server state may be a client's: client_programs.h times the requests the host sends on it.
 *
 * A response: the server, having received bytes (the request), writes. Its first write ends the time
 * to first byte; each later write ends a gap; the write completing the body its head frames (HTTP/1.x
 * Content-Length), else the next request received, or the server's side of the connection closing or
 * reset, ends it (its duration runs to its last write). HTTP/1.x is read from the response's first
 * bytes: a write holding only the status line and headers is not a chunk (TTFB runs to the first body
 * write) and chunked encoding's last-chunk write ("0\r\n\r\n") ends the response without being a chunk. On cleartext HTTP/2 each stream is a response of its own: the frame headers
 * of each write, and of each read of the client, walked with bpf_loop (the verifier sees one frame),
 * say which streams they are for. docs/streams.md has the rules. A stall's GPU evidence is its
 * process's time inside CUDA synchronizations, from the map the cuda probe writes (cuda_sync.h): each
 * write notes the process's total, the write ending a gap takes the difference. TLS handshakes run
 * from the connection's first read (the ClientHello) to the read after the server's ServerHello (the
 * client's Finished).
 *
 * The parts: types user space decodes (streams.h), the state and maps (streams_maps.h), one parser per
 * protocol (http1.h, http2.h, tls.h), reading a send's bytes (msg.h), syscalls (syscalls.h). */
#ifndef AIPROBE_STREAMS_PROGRAMS_H
#define AIPROBE_STREAMS_PROGRAMS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "client_programs.h"
#include "cuda_sync.h"
#include "hist.h"
#include "hpack.h"
#include "http1.h"
#include "http2.h"
#include "loop.h"
#include "msg.h"
#include "sock.h"
#include "streams.h"
#include "streams_maps.h"
#include "syscalls.h"
#include "task.h"
#include "tls.h"

/* --- the connection --- */

static __always_inline bool is_h2(struct stream_socket *s)
{
	return s->key.protocol == STREAM_PROTOCOL_HTTP2 || s->key.protocol == STREAM_PROTOCOL_GRPC;
}

/* The protocols whose responses are requests: their status and method are read. */
static __always_inline bool speaks_http(struct stream_socket *s)
{
	return s->key.protocol == STREAM_PROTOCOL_HTTP || s->key.protocol == STREAM_PROTOCOL_SSE || is_h2(s);
}

/* The requests part: response `t` ended; counted per (endpoint, method, status). */
static __always_inline void request_end(struct stream_socket *s, struct stream_timing *t)
{
	struct request_key key = {
		.tgid = s->key.tgid, .port = s->key.port, .status = t->status, .protocol = s->key.protocol,
		.method = t->method, .cgroup_id = s->key.cgroup_id,
		.rpc_status = s->key.protocol == STREAM_PROTOCOL_GRPC ? t->rpc_status : 0,
	};
	struct request_stats *stats;

	if (!requests_enabled || !speaks_http(s) || !key.port || !(stats = request_endpoint(&key)))
		return;
	if (!hist_add_span(&stats->duration, t->request_ns, t->last_write_ns))
		__sync_fetch_and_add(&stats->durations_unknown, 1);
	__sync_fetch_and_add(&stats->request_bytes, t->request_bytes);
	__sync_fetch_and_add(&stats->response_bytes, t->response_bytes);
}

/* A response ended (at its last write): one that wrote a body byte, or its status (headers alone).
 * `stats`: its endpoint's, where the caller has them (NULL: looked up here). */
static __always_inline void timing_end(struct stream_socket *s, struct stream_timing *t, struct stream_stats *stats)
{
	if (t->chunks || t->status)
		request_end(s, t);
	if (t->chunks && !stats)
		stats = bpf_map_lookup_elem(&stream_stats, &s->key);
	if (stats && t->chunks && !hist_add_span(&stats->duration, t->request_ns, t->last_write_ns))
		__sync_fetch_and_add(&stats->durations_unknown, 1);
	t->chunks = 0;
	t->status = 0;
	t->rpc_status = 0;
	t->response_bytes = 0;
}

/* The connection's response in progress ended (a response of headers alone has its status). */
static __always_inline void stream_end(struct stream_socket *s, struct stream_stats *stats)
{
	if (s->phase != STREAM_RESPONSE && !s->t.status)
		return;
	s->phase = STREAM_IDLE;
	timing_end(s, &s->t, stats);
}

/* The server's side of the connection is done writing: it left ESTABLISHED (its own close, a reset),
 * or CLOSE_WAIT, where a server still answers a client that half-closed after its request. */
static __always_inline bool writes_ended(int oldstate, int newstate)
{
	return (oldstate == TCP_ESTABLISHED && newstate != TCP_CLOSE_WAIT) || oldstate == TCP_CLOSE_WAIT;
}

/* Accepted connections get their state, connecting ones their client mark; a connection whose server
 * (or client) is done writing ends its responses (its request). */
static __always_inline void connection_changed(struct sock *sk, int oldstate, int newstate)
{
	struct stream_socket *s;

	if (oldstate == TCP_SYN_RECV && newstate == TCP_ESTABLISHED) {
		stream_socket_of(sk, true);
		return;
	}
	if (newstate == TCP_SYN_SENT) {
		client_connecting(sk);
		return;
	}
	if (!writes_ended(oldstate, newstate))
		return;
	s = stream_socket_of(sk, false);
	if (!s) {
		client_closed(sk);
		return;
	}
	stream_end(s, NULL);
	for (int i = 0; i < H2_STREAMS; i++) {
		if (s->h2[i].id) {
			timing_end(s, &s->h2[i].t, NULL);
			s->h2[i].id = 0;
		}
	}
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(streams_set_state, struct sock *sk, int oldstate, int newstate)
{
	if (sk->sk_protocol != IPPROTO_TCP)
		return 0;
	if (streams_enabled)
		connection_changed(sk, oldstate, newstate);
	/* Where the state is a hash by socket address (sk_state.h), the connection's entries go with it,
	 * after its end above: the address may come back as another socket's. */
	if (sockets_by_address && newstate == TCP_CLOSE) {
		socket_entry_delete(&stream_sockets, sk);
		socket_entry_delete(&client_sockets, sk);
	}
	return 0;
}

/* --- reading a response's first bytes --- */

/* Whether the scratch's first `len` bytes name text/event-stream. A global function: the verifier
 * checks the search once, not once per state of the send that calls it; the bytes are the per-CPU
 * scratch's, as a global function takes pointers only from 5.12 on. */
__noinline int peek_is_event_stream(__u32 len)
{
	__u32 zero = 0;
	struct stream_peek *peek = bpf_map_lookup_elem(&stream_peek, &zero);

	return peek && has_event_stream(peek->bytes, len, &peek->head);
}

/* The protocol of a response's first `len` bytes, read into `peek`. */
static __always_inline __u8 protocol_of(struct stream_peek *peek, __u32 len)
{
	const char *bytes = peek->bytes;

	if (is_tls_record(bytes, len))
		return STREAM_PROTOCOL_TLS;	/* encrypted from here */
	if (is_http1(bytes, len))
		return peek_is_event_stream(len) ? STREAM_PROTOCOL_SSE : STREAM_PROTOCOL_HTTP;
	if (is_h2_server_preface(bytes, len))
		return STREAM_PROTOCOL_HTTP2;
	return STREAM_PROTOCOL_TCP;
}

/* What a later write of a classified HTTP/1.x connection needs read: the last chunk (5 bytes); a
 * response's first write is read further (its head: status, framing; the connection's first: an SSE
 * header). */
#define HTTP1_WRITE_PEEK_BYTES 16

/* What a write of an HTTP/1.x response holds: a 5-byte "0\r\n\r\n" is chunked encoding's end; its
 * first write may be the headers alone (it starts with the status line and ends with the blank line). */
static __always_inline __u8 http_write(struct stream_socket *s, const char *first, __u64 user, __u64 len,
					__u64 total)
{
	__u32 last4;

	if (total == 5 && len == 5 && is_last_chunk(first))
		return WRITE_LAST_CHUNK;
	/* Headers alone: the whole write is in the bytes read from (one segment) and ends the block. */
	if (s->phase == STREAM_REQUEST && is_http1(first, len) && len == total) {
		if (bpf_probe_read_user(&last4, 4, (void *)(user + len - 4)))
			return WRITE_BODY;
		return last4 == HTTP1_HEADERS_END ? WRITE_HEADERS : WRITE_BODY;
	}
	return WRITE_BODY;
}

/* --- HTTP/2: the frames a write carries --- */

#define H2_WALK LOOP_BOUND(16, 8)	/* frame headers read per read or write */
/* Of those, the frames carrying DATA or an end that a write times (at most H2_FRAMES). */
#define H2_WRITE_FRAMES LOOP_BOUND(H2_FRAMES, 2)

/* The walks' bounds in this build (bpf/loop.h), which user space states where they are the bounded
 * ones (agent/probes/sendlat/loops.py). */
enum walk_bound {
	WALK_H2_FRAMES = H2_WALK,
	WALK_HPACK_FIELDS = HPACK_FIELDS,
	WALK_WRITE_STREAMS = H2_WRITE_FRAMES,
};
BTF_EXPORT_ENUM(walk_bound);

/* The frame walk's state, through bpf_loop (one frame per turn: the verifier sees one turn). */
struct h2_walk {
	struct msg_cursor *c;
	struct stream_peek *scratch;	/* the server's: the header block walk's */
	struct stream_socket *s;
	__u64 received_ns;	/* reading the client's frames: received then */
};

/* The slot of HTTP/2 stream `id`, or a free one for it (its request: the last read) when `create`. */
static __always_inline struct h2_stream *h2_stream(struct stream_socket *s, __u32 id, bool create)
{
	int i, free = -1;

	for (i = 0; i < H2_STREAMS; i++) {
		if (s->h2[i].id == id)
			return &s->h2[i];
		if (free < 0 && !s->h2[i].id)
			free = i;
	}
	if (!create || free < 0 || free >= H2_STREAMS) {
		if (create)
			stream_count(STREAM_COUNTER_H2_UNTIMED);
		return NULL;
	}
	s->h2[free].id = id;
	__builtin_memset(&s->h2[free].t, 0, sizeof(s->h2[free].t));
	s->h2[free].t.request_ns = s->t.request_ns;
	return &s->h2[free];
}

/* The first 8 bytes (big-endian) of the header block of the HEADERS frame at the cursor (past its
 * padding length and priority); 0 where they are not in the cursor's segment. */
static __always_inline __u64 h2_header_block(struct msg_cursor *c, __u8 flags)
{
	__u64 offset = H2_FRAME_HEADER, word;

	if (flags & H2_PADDED)
		offset += 1;
	if (flags & H2_PRIORITY)
		offset += 5;
	if (c->left <= offset || bpf_probe_read_user(&word, sizeof(word), (void *)(c->base + offset)))
		return 0;
	return bpf_be64_to_cpu(word);
}

/* A frame the client sent on a stream (HEADERS, DATA): its request, until the response begins (its
 * method from the HEADERS, its bytes). */
static __always_inline void h2_request(struct stream_socket *s, struct msg_cursor *c, const __u8 *header,
					__u32 id, __u64 now)
{
	struct h2_stream *stream = h2_stream(s, id, true);

	if (!stream || stream->t.chunks)
		return;
	stream->t.request_ns = now;
	stream->t.request_bytes += H2_FRAME_HEADER + h2_length(header);
	if (header[3] == H2_HEADERS && requests_enabled)
		stream->t.method = hpack_method(h2_header_block(c, header[4]));
}

/* The header block of `length` bytes at the scratch's block cursor, walked into its fields and its
 * copy of the table. A global function: the verifier checks it once, not once per state of the frame
 * walk that calls it; its state is in the per-CPU scratch, as a global function takes pointers only
 * from 5.12 on. */
__noinline int h2_header_block_walk(__u64 length)
{
	__u32 zero = 0;
	struct stream_peek *scratch = bpf_map_lookup_elem(&stream_peek, &zero);

	if (scratch)
		hpack_walk_block(&scratch->table, &scratch->block, length, &scratch->fields);
	return 0;
}

/* A header block the server wrote, walked for its dynamic table insertions (a HEADERS frame's; those
 * of PUSH_PROMISE and CONTINUATION frames are not walked: the table is lost). On a stream: its response's
 * status (the first HEADERS'), its grpc-status (the HEADERS ending it); grpc-status makes it gRPC. */
static __always_inline void h2_response_headers(struct stream_socket *s, struct h2_walk *walk, const __u8 *header,
						 __u32 id)
{
	__u64 length = h2_length(header), offset = H2_FRAME_HEADER;
	struct stream_peek *scratch = walk->scratch;
	struct hpack_block *fields = &scratch->fields;
	struct h2_stream *stream;
	__u8 padding = 0;

	if (header[3] != H2_HEADERS || !(header[4] & H2_END_HEADERS) || !requests_enabled) {
		s->hpack.lost = 1;
		return;
	}
	if ((header[4] & H2_PADDED) &&
	    (walk->c->left <= offset || bpf_probe_read_user(&padding, 1, (void *)(walk->c->base + offset)))) {
		s->hpack.lost = 1;
		return;
	}
	offset += (header[4] & H2_PADDED ? 1 : 0) + (header[4] & H2_PRIORITY ? 5 : 0);
	if (offset + padding >= H2_FRAME_HEADER + length)
		return;	/* an empty block */
	scratch->block = *walk->c;
	if (!cursor_skip(&scratch->block, offset)) {
		s->hpack.lost = 1;
		return;
	}
	scratch->table = s->hpack;
	h2_header_block_walk(H2_FRAME_HEADER + length - offset - padding);
	s->hpack = scratch->table;
	if (fields->grpc && s->key.protocol == STREAM_PROTOCOL_HTTP2)
		s->key.protocol = STREAM_PROTOCOL_GRPC;
	/* A stream whose request was not seen (a read whose buffer this does not see) is made here, as
	 * its first DATA would make it. */
	stream = id ? h2_stream(s, id, true) : NULL;
	if (!stream)
		return;
	if (!stream->t.status)
		stream->t.status = fields->status;
	if (header[4] & H2_END_STREAM)
		stream->t.rpc_status = fields->rpc_status;
}

/* One frame header of a write (which stream it carries DATA for or ends), or of a read (which stream
 * a request is for); the cursor moves to the next frame. */
static __always_inline long h2_frame(struct h2_walk *walk, bool received)
{
	struct stream_socket *s = walk->s;
	struct msg_cursor *c = walk->c;
	__u8 header[14];
	__u32 length, stream, n = s->frames;
	__u8 carries;

	if (!h2_read_header(c, header))
		return 1;
	length = h2_length(header);
	stream = h2_stream_id(header);
	if (received) {
		if ((header[3] == H2_HEADERS || header[3] == H2_DATA) && stream)
			h2_request(s, c, header, stream, walk->received_ns);
		return cursor_skip(c, H2_FRAME_HEADER + (__u64)length) ? 0 : 1;
	}
	s->walked += H2_FRAME_HEADER + (__u64)length;
	if (header[3] == H2_HEADERS || header[3] == H2_PUSH_PROMISE || header[3] == H2_CONTINUATION)
		h2_response_headers(s, walk, header, stream);
	carries = 0;
	if (header[3] == H2_DATA && length)
		carries = H2_CARRIES_DATA;
	if ((header[3] == H2_DATA || header[3] == H2_HEADERS) && (header[4] & H2_END_STREAM))
		carries |= H2_CARRIES_END;
	if (header[3] == H2_RST_STREAM)
		carries = H2_CARRIES_END;
	if (carries && stream && n < H2_FRAMES) {
		/* The bound again, on the register the stores use: 6.1's verifier loses it when n is
		 * spilled and refilled (invalid access to map value). */
		barrier_var(n);
		n &= H2_FRAMES - 1;
		s->frame_stream[n] = stream;
		s->frame_carries[n] = carries;
		s->frames = n + 1;
	}
	if (header[3] == H2_DATA && length >= 5 && c->left >= 14 && s->key.protocol == STREAM_PROTOCOL_HTTP2 &&
	    is_grpc_message(header + H2_FRAME_HEADER, length))
		s->key.protocol = STREAM_PROTOCOL_GRPC;
	return cursor_skip(c, H2_FRAME_HEADER + (__u64)length) ? 0 : 1;
}

/* bpf_loop's callbacks, one per direction: each verified without the other's branch. */
static long h2_frame_sent(__u32 index, struct h2_walk *walk)
{
	return h2_frame(walk, false);
}

static long h2_frame_received(__u32 index, struct h2_walk *walk)
{
	return h2_frame(walk, true);
}

/* Which streams the write carries DATA for, and which it ends (HEADERS or DATA with END_STREAM,
 * RST_STREAM), from its first H2_FRAMES frame headers (each within one iovec segment or across two);
 * its header blocks. A write not walked to its end (more than H2_WALK frames, a frame header across
 * three segments, a frame ending in a later write) may hold header blocks not walked: the dynamic
 * table is lost. */
static __always_inline void h2_frames(struct stream_socket *s, struct msghdr *msg, struct stream_peek *scratch)
{
	struct h2_walk walk = { .c = &scratch->cursor, .scratch = scratch, .s = s };

	s->frames = 0;
	hpack_send_end(&s->hpack, false);	/* a send whose end was not seen */
	s->sending = msg->msg_iter.count;
	s->walked = 0;
	if (cursor_start(walk.c, msg))
		LOOP(H2_WALK, h2_frame_sent, &walk);
	if (s->walked != s->sending)
		s->hpack.lost = 1;
}

/* A send on `sk` starts (`msg` not yet copied): read what it holds when that matters — the
 * connection's first response (its protocol), HTTP/1.x writes that are not chunks, HTTP/2 frames. */
static __always_inline void stream_send_begin(struct sock *sk, struct msghdr *msg)
{
	struct stream_socket *s;
	struct stream_peek *peek;
	__u32 zero = 0, n;
	__u64 user, len, limit;

	if (!streams_enabled)
		return;
	s = stream_socket_of(sk, false);
	if (!s) {
		client_send_begin(sk, msg);
		return;
	}
	s->write = WRITE_BODY;
	s->frames = 0;
	peek = bpf_map_lookup_elem(&stream_peek, &zero);
	if (!peek)
		return;
	if (s->classified && is_h2(s)) {
		h2_frames(s, msg, peek);
		return;
	}
	if (s->classified && s->key.protocol != STREAM_PROTOCOL_HTTP && s->key.protocol != STREAM_PROTOCOL_SSE)
		return;
	/* HTTP/1.x: a response's first write, and 5-byte writes (the last chunk). */
	if (s->classified && !(s->phase == STREAM_REQUEST || msg->msg_iter.count == 5))
		return;
	if (!cursor_start(&peek->cursor, msg))
		return;
	user = peek->cursor.base;
	len = peek->cursor.left;
	if (!user || !len)
		return;
	limit = s->classified && s->phase != STREAM_REQUEST ? HTTP1_WRITE_PEEK_BYTES : HTTP1_PEEK_BYTES;
	n = opaque(len < limit ? len : limit);
	if (n > HTTP1_PEEK_BYTES || bpf_probe_read_user(peek->bytes, n, (void *)user))
		return;
	if (!s->classified) {
		s->key.protocol = protocol_of(peek, n);
		s->classified = 1;
		if (s->key.protocol == STREAM_PROTOCOL_TLS)
			s->tls_awaiting = server_hello_version(peek->bytes, n);
		if (is_h2(s)) {
			h2_frames(s, msg, peek);
			return;
		}
	}
	if (s->key.protocol != STREAM_PROTOCOL_HTTP && s->key.protocol != STREAM_PROTOCOL_SSE)
		return;
	s->write = http_write(s, peek->bytes, user, len, msg->msg_iter.count);
	if (s->phase != STREAM_REQUEST || !is_http1(peek->bytes, n))
		return;
	/* The response's head: its status, how its body ends. */
	if (!s->t.status)
		s->t.status = http1_status(peek->bytes, n);
	s->body = response_framing(peek, n, s->t.method, s->t.status, &s->body_left);
}

/* --- the server's reads --- */

/* HTTP/2: the client's frames in what it sent (its first read also holds the connection preface,
 * "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", which makes the connection HTTP/2 before the server writes). */
static __always_inline void h2_received(struct stream_socket *s, int ret, __u64 now)
{
	__u32 zero = 0, first4_bytes = 0;
	struct stream_peek *scratch = bpf_map_lookup_elem(&stream_peek, &zero);
	struct h2_walk walk = { .s = s, .received_ns = now };
	__u64 user = received_buffer();

	if (!scratch || !user)
		return;
	walk.c = &scratch->cursor;
	walk.c->iov = 0;
	walk.c->segment = 0;
	walk.c->segments = 1;
	walk.c->base = user;
	walk.c->left = ret;
	if (!s->classified) {
		if (bpf_probe_read_user(&first4_bytes, 4, (void *)user) || first4_bytes != H2_CLIENT_PREFACE_START ||
		    !cursor_skip(walk.c, H2_CLIENT_PREFACE))
			return;
		s->key.protocol = STREAM_PROTOCOL_HTTP2;
		s->classified = 1;
	}
	LOOP(H2_WALK, h2_frame_received, &walk);
}

/* TLS: the read after the server's ServerHello is the client's Finished (with what came before it in
 * its flight): the handshake took from the ClientHello's read (the connection's first) to now, counted
 * in the entry of the endpoint and the version (the key with its tls_version). */
static __always_inline void tls_handshake_done(struct stream_socket *s, __u64 now)
{
	struct stream_key key = s->key;
	struct stream_stats *stats;

	key.tls_version = s->tls_awaiting;
	s->tls_awaiting = TLS_VERSION_NONE;
	if (key.port && (stats = stream_endpoint(&key)))
		hist_add_span(&stats->handshake, s->first_read_ns, now);
}

/* HTTP/1.x (or not yet known): `ret` bytes of a request. Its first read holds the request line, whose
 * method the read syscall's buffer tells (reads through other calls, io_uring's, tell none). */
static __always_inline void request_received(struct stream_socket *s, int ret)
{
	char first[8];
	__u64 user;

	if (s->phase == STREAM_REQUEST) {
		s->t.request_bytes += ret;
		return;
	}
	s->phase = STREAM_REQUEST;
	s->body = BODY_UNKNOWN;
	s->t.request_bytes = ret;
	s->t.method = HTTP_METHOD_OTHER;
	if (!requests_enabled || (s->classified && !speaks_http(s)) || ret < (int)sizeof(first))
		return;
	user = received_buffer();
	if (user && !bpf_probe_read_user(first, sizeof(first), (void *)user))
		s->t.method = http1_method(first);
}

/* The server received `ret` bytes: a request (or more of it). On HTTP/2 the frames say which
 * stream's (clients also send acknowledgements while they read); elsewhere the response in
 * progress ends. */
static __always_inline void stream_received(struct sock *sk, int ret, int flags)
{
	struct stream_socket *s;
	__u64 now;

	if (!streams_enabled || ret <= 0 || (flags & MSG_PEEK))
		return;
	s = stream_socket_of(sk, false);
	if (!s) {
		client_received(sk, ret);
		return;
	}
	now = bpf_ktime_get_ns();
	if (!s->first_read_ns)
		s->first_read_ns = now;
	if (s->tls_awaiting)
		tls_handshake_done(s, now);
	/* The response in progress ends before this read becomes the next request: timed from its own
	 * request, not from this one (which would make it negative). */
	if (!is_h2(s))
		stream_end(s, NULL);
	s->t.request_ns = now;
	if (!s->classified || is_h2(s))
		h2_received(s, ret, now);
	if (!is_h2(s))
		request_received(s, ret);
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(streams_recv, struct sock *sk, int ret, int flags)
{
	stream_received(sk, ret, flags);
	return 0;
}

/* tcp_recvmsg's arguments changed over time (6, then 5 from 5.19); its return did not. Where the
 * kernel has bpf_get_func_ret (5.17) it finds the return value whatever their number; every kernel
 * without it has the 6 of before 5.19 (sk, msg, len, nonblock, flags, addr_len), and fexit's context
 * holds the arguments then the return value: ctx[6]. A CO-RE constant picks the branch, so the verifier
 * never visits the other one (there an unknown helper, here a 7th argument a 5-argument function lacks). */
SEC("fexit/tcp_recvmsg")
int BPF_PROG(streams_fexit_recv, struct sock *sk)
{
	__u64 ret = 0;

	if (bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_get_func_ret))
		bpf_get_func_ret(ctx, &ret);
	else
		ret = ctx[6];
	stream_received(sk, (int)ret, 0);
	return 0;
}

/* --- the server's writes --- */

/* A send that returned bytes, as its timings and stalls note it: its writer's thread and run delay are
 * read once, from the task the program already has, not through two more helper calls per write. */
struct stream_sent {
	struct sock *sk;
	struct stream_socket *s;
	__u64 now;
	__u64 start_ns;		/* the send's start where it was timed, else 0 */
	__u64 run_delay_ns;	/* the writer's sched_info.run_delay */
	long ret;		/* bytes not counted yet (HTTP/2: the write's first stream counts them) */
	__u32 tid;		/* the writer's */
};

static __always_inline __u64 at_most(__u64 value, __u64 limit)
{
	return value < limit ? value : limit;
}

static __always_inline void emit_stall(struct stream_sent *w, struct stream_timing *t, struct stream_stats *stats,
				       __u32 stream_id, __u64 gap)
{
	struct stream_socket *s = w->s;
	struct sock *sk = w->sk;
	struct stream_stall_event *event;
	__u64 since, network, sync_now, now = w->now;
	__u8 cause = STALL_SERVER;

	event = bpf_ringbuf_reserve(&stream_stalls, sizeof(*event), 0);
	if (!event) {
		stream_count(STREAM_COUNTER_LOST_STALLS);
		return;
	}
	since = s->full_since_ns > t->last_write_ns ? s->full_since_ns : t->last_write_ns;
	event->unwritable_ns = s->full_since_ns ? now - since : 0;
	event->blocked_send_ns = w->start_ns ? at_most(now - w->start_ns, gap) : 0;
	event->runqueue_ns = w->tid == t->writer_tid ? at_most(w->run_delay_ns - t->run_delay_ns, gap) : 0;
	sync_now = cuda_syncs_shared ? cuda_sync_ns(s->key.tgid, now) : 0;
	/* Less than at the last write: the cuda probe restarted, its counts anew (or started since: unread). */
	event->cuda_sync_ns = sync_now > t->cuda_sync_ns ? at_most(sync_now - t->cuda_sync_ns, gap) : 0;
	/* A cause explains a stall when its evidence covers at least half of it. Evidence overlaps (a
	 * socket stays full while the process synchronizes): the largest explains the stall, and on a
	 * tie the first of network, cpu, gpu. None: the server was slow to produce. */
	network = event->unwritable_ns + event->blocked_send_ns;
	if (network >= gap / 2)
		cause = STALL_NETWORK;
	if (event->runqueue_ns >= gap / 2 && event->runqueue_ns > network)
		cause = STALL_CPU;
	if (event->cuda_sync_ns >= gap / 2 && event->cuda_sync_ns > network && event->cuda_sync_ns > event->runqueue_ns)
		cause = STALL_GPU;
	__sync_fetch_and_add(&stats->stalls[cause], 1);
	event->cause = cause;
	event->tgid = s->key.tgid;
	event->tid = w->tid;
	event->cgroup_id = s->key.cgroup_id;
	event->protocol = s->key.protocol;
	event->family = sk->__sk_common.skc_family;
	event->local_port = sk->__sk_common.skc_num;
	event->remote_port = bpf_ntohs(sk->__sk_common.skc_dport);
	if (event->family == AF_INET) {
		__builtin_memcpy(event->local_addr, &sk->__sk_common.skc_rcv_saddr, 4);
		__builtin_memcpy(event->remote_addr, &sk->__sk_common.skc_daddr, 4);
	} else {
		__builtin_memcpy(event->local_addr, &sk->__sk_common.skc_v6_rcv_saddr, 16);
		__builtin_memcpy(event->remote_addr, &sk->__sk_common.skc_v6_daddr, 16);
	}
	event->gap_ns = gap;
	event->elapsed_ns = now - t->request_ns;
	event->chunk = t->chunks + 1;
	event->stream_id = stream_id;
	__builtin_memcpy(event->comm, stats->comm, sizeof(event->comm));
	bpf_ringbuf_submit(event, 0);
}


/* Write `w` of response `t` (stream `stream_id` on HTTP/2): the first byte ends the TTFB, later ones a
 * gap. */
static __always_inline void timing_write(struct stream_sent *w, struct stream_timing *t, struct stream_stats *stats,
					 __u32 stream_id)
{
	__u64 gap, now = w->now;

	if (!t->chunks) {
		__sync_fetch_and_add(&stats->streams, 1);
		hist_add_span(&stats->ttfb, t->request_ns, now);
	} else {
		gap = now - t->last_write_ns;
		hist_add(&stats->gap, gap);
		if (gap >= stall_threshold_ns)
			emit_stall(w, t, stats, stream_id, gap);
	}
	t->chunks++;
	t->response_bytes += w->ret;
	__sync_fetch_and_add(&stats->chunks, 1);
	__sync_fetch_and_add(&stats->bytes, w->ret);
	t->last_write_ns = now;
	t->writer_tid = w->tid;
	t->run_delay_ns = w->run_delay_ns;
	t->cuda_sync_ns = cuda_syncs_shared ? cuda_sync_ns(w->s->key.tgid, now) : SYNCS_UNREAD;
}

/* One frame of an HTTP/2 write, through bpf_loop (one frame per turn: the verifier sees one turn, not
 * H2_FRAMES copies of the timing and stall code). */
static long h2_write_frame(__u32 i, struct stream_sent *w)
{
	struct stream_socket *s = w->s;
	struct stream_stats *stats = NULL;
	struct h2_stream *stream;
	__u8 carries;

	if (i >= s->frames || i >= H2_FRAMES)
		return 1;
	carries = s->frame_carries[i];
	stream = h2_stream(s, s->frame_stream[i], carries & H2_CARRIES_DATA);
	if (!stream)
		return 0;
	/* Several frames of one stream in one write are one chunk. The endpoint is looked up per frame, not
	 * kept from the last: a pointer kept across turns doubles what a bounded loop's verifier walks. */
	if ((carries & H2_CARRIES_DATA) && !(stream->t.chunks && stream->t.last_write_ns == w->now) &&
	    (stats = stream_endpoint(&s->key))) {
		timing_write(w, &stream->t, stats, stream->id);
		w->ret = 0;
	}
	if (carries & H2_CARRIES_END) {
		if (!stream->t.chunks)
			stream->t.last_write_ns = w->now;	/* headers alone */
		timing_end(s, &stream->t, stats);
		stream->id = 0;
	}
	return 0;
}

/* A chunk of each stream the write carries DATA for; the streams it ends end. Bytes are the write's,
 * counted once (with its first stream). The endpoint's entry is made at the first DATA, when the
 * protocol (http2 or grpc) is known. */
static __always_inline void h2_write(struct stream_sent *w)
{
	LOOP(H2_WRITE_FRAMES, h2_write_frame, w);
}

/* A TCP sendmsg of `task`, of thread (tgid, cgroup_id), on `sk` returned `ret` at `now` (0: not read yet,
 * as the send was not timed); `start_ns`: its start if timed. */
static __always_inline void stream_send_end(struct sock *sk, struct task_struct *task, long ret, __u64 start_ns,
					    __u64 now, __u32 tgid, __u64 cgroup_id)
{
	struct stream_stats *stats = NULL;
	struct stream_sent w;
	struct stream_socket *s;
	__u8 write;

	if (!streams_enabled || !(s = stream_socket_of(sk, false)))
		return;
	write = s->write;
	s->write = WRITE_BODY;
	hpack_send_end(&s->hpack, ret == s->sending);
	if (!now)
		now = bpf_ktime_get_ns();
	if (ret <= 0) {
		if (ret == -EAGAIN && !s->full_since_ns)
			s->full_since_ns = now;
		return;
	}
	/* The endpoint: the writing process serving on `sk`, with the protocol as known now. */
	s->key.tgid = tgid;
	s->key.cgroup_id = cgroup_id;
	s->key.port = sk->__sk_common.skc_num;
	w = (struct stream_sent){ .sk = sk, .s = s, .now = now, .start_ns = start_ns, .ret = ret,
				   .tid = TASK_READ(task, pid), .run_delay_ns = TASK_READ(task, sched_info.run_delay) };
	if (is_h2(s)) {
		h2_write(&w);
		s->frames = 0;
		goto done;
	}
	if (write == WRITE_HEADERS)
		s->t.last_write_ns = now;	/* a response of headers alone ends here */
	if (s->phase == STREAM_IDLE)
		goto done;	/* the server speaks first */
	if (write == WRITE_HEADERS)
		goto body;	/* the headers alone: not a chunk */
	if (write == WRITE_LAST_CHUNK) {
		stream_end(s, NULL);
		s->phase = STREAM_IDLE;	/* also a response without a body write: no stream */
		goto done;
	}
	if (s->phase == STREAM_REQUEST) {
		s->phase = STREAM_RESPONSE;
		s->t.chunks = 0;
		stats = stream_endpoint(&s->key);
	} else {
		stats = bpf_map_lookup_elem(&stream_stats, &s->key);
	}
	if (stats)
		timing_write(&w, &s->t, stats, 0);
body:
	/* The write that ends a body of known length ends its response (a body of none: its headers'). */
	s->body_left -= ret;
	if (s->body == BODY_LENGTH && s->body_left <= 0) {
		stream_end(s, stats);
		s->phase = STREAM_IDLE;
	}
done:
	if (left_full(sk)) {
		if (!s->full_since_ns)
			s->full_since_ns = now;
	} else {
		s->full_since_ns = 0;
	}
}


#endif /* AIPROBE_STREAMS_PROGRAMS_H */
