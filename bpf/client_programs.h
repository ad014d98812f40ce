/* SPDX-License-Identifier: GPL-2.0 */
/* The client side of requests: HTTP/1.x requests the host sends on connections it opened (a gateway
 * calling its inference service), timed on the programs streams already runs (streams_programs.h calls
 * these where a socket has no server state). A socket gets its state at its first send, when that is a
 * request line (an accepted connection's first send is a response: it is not one). A connection is
 * marked when it connects (client_connecting()) and decided at its first send: one that is not a
 * request line is marked as none; from then on its sends and reads, like those of sockets that were
 * never marked (connected before the agent started), stop at the socket-storage lookup, before any
 * read of user memory or of the clock.
 *
 * A request starts at its first send (its method from the request line's first 8 bytes); its
 * response's first read ends the time to first byte (its status from the status line, and how its body
 * ends from its head, read in the read syscall's buffer). It is counted, in map client_stats per (process,
 * cgroup, server address and port, method, status), at the read that ends its response (Content-Length,
 * the last chunk, no body); else at the next request's send or the connection's close, or by the agent
 * once the response has had no read for a while (map client_pending: whichever deletes the request's
 * entry counts it). Its duration runs to its response's last read. docs/requests.md has the rules. */
#ifndef AIPROBE_CLIENT_PROGRAMS_H
#define AIPROBE_CLIENT_PROGRAMS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "http1.h"
#include "msg.h"
#include "requests.h"
#include "sk_state.h"
#include "sock.h"
#include "streams_maps.h"
#include "syscalls.h"

/* CLIENT_NEW: connected, nothing sent yet; CLIENT_NONE: its first send was not a request line. */
enum client_phase { CLIENT_NEW, CLIENT_NONE, CLIENT_IDLE, CLIENT_REQUEST, CLIENT_RESPONSE };

/* Per connection the host opened that sent a request line. */
struct client_socket {
	__u64 request_ns;	/* the request's first send */
	__u64 first_read_ns;	/* its response's first read */
	__u64 last_read_ns;	/* its response's last read */
	__u64 cgroup_id;	/* of the sender */
	__s64 body_left;	/* BODY_LENGTH: the body's bytes still to read */
	__u32 tgid;
	__u16 status;		/* from the response's first read; 0: not readable */
	__u8 method;		/* enum http_method */
	__u8 phase;		/* enum client_phase */
	__u8 body;		/* enum http1_body: how the response ends */
	__u8 pending;		/* it has an entry in client_pending */
};

SOCKET_STATE_MAP(client_sockets, struct client_socket);

ENDPOINT_MAP(client_stats, struct client_key, struct client_stats, REQUEST_MAX_ENDPOINTS);

/* Requests whose response's end is not seen, once read (more: counted at the next send or the close). */
#define CLIENT_PENDING_MAX 4096

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CLIENT_PENDING_MAX);
	__type(key, struct client_pending_key);
	__type(value, struct client_pending);
} client_pending SEC(".maps");

static struct client_stats zero_client_stats;
static struct client_socket zero_client_socket;

/* `sk`'s client state (sk_state.h); where `make`, made if it has none. */
static __always_inline struct client_socket *client_socket_of(struct sock *sk, bool make)
{
	return socket_entry(&client_sockets, sk, &zero_client_socket, make);
}

/* The entry of the request in progress on `sk` in client_pending. */
static __always_inline struct client_pending_key pending_key(struct sock *sk, struct client_socket *c)
{
	struct client_pending_key key = { .sock = (__u64)sk, .request_ns = c->request_ns };

	return key;
}

/* The aggregate `sk`'s request in progress counts in. */
static __always_inline struct client_key client_key_of(struct sock *sk, struct client_socket *c)
{
	struct client_key key = {
		.tgid = c->tgid, .port = bpf_ntohs(sk->__sk_common.skc_dport), .status = c->status,
		.family = sk->__sk_common.skc_family, .method = c->method, .cgroup_id = c->cgroup_id,
	};

	if (key.family == AF_INET)
		__builtin_memcpy(key.addr, &sk->__sk_common.skc_daddr, 4);
	else
		__builtin_memcpy(key.addr, &sk->__sk_common.skc_v6_daddr, 16);
	return key;
}

/* The request in progress on `sk` ended, if its response was read: counted, unless the agent counted it
 * (it deleted its pending entry first). Named after the current process only when it is the sender (a
 * close may run in softirq, on behalf of any process). */
static __always_inline void client_end(struct sock *sk, struct client_socket *c)
{
	struct client_key key = client_key_of(sk, c);
	struct client_pending_key pending = pending_key(sk, c);
	struct client_stats *stats;

	if (c->phase != CLIENT_RESPONSE)
		return;
	c->phase = CLIENT_IDLE;
	if (c->pending) {
		c->pending = 0;
		if (bpf_map_delete_elem(&client_pending, &pending))
			return;
	}
	stats = endpoint_entry(&client_stats, &key, &zero_client_stats, STREAM_COUNTER_CLIENT_ENDPOINTS_FULL);
	if (!stats)
		return;
	if (bpf_get_current_pid_tgid() >> 32 == c->tgid)
		name_entry(stats->comm);
	hist_add_span(&stats->duration, c->request_ns, c->last_read_ns);
	hist_add_span(&stats->ttfb, c->request_ns, c->first_read_ns);
}

/* The response's end is not seen: the request is left for the agent to count too (docs/requests.md).
 * Where client_pending is full, it waits for the next send or the close. */
static __always_inline void client_pend(struct sock *sk, struct client_socket *c)
{
	struct client_pending_key key = pending_key(sk, c);
	struct client_pending entry = {
		.key = client_key_of(sk, c), .request_ns = c->request_ns, .first_read_ns = c->first_read_ns,
		.last_read_ns = c->last_read_ns,
	};

	if (bpf_get_current_pid_tgid() >> 32 == c->tgid)
		name_entry(entry.comm);
	c->pending = !bpf_map_update_elem(&client_pending, &key, &entry, BPF_NOEXIST);
}

/* A read of a pending request's response: its entry's last read moves (gone: the agent counted it). */
static __always_inline void client_pending_read(struct sock *sk, struct client_socket *c)
{
	struct client_pending_key key = pending_key(sk, c);
	struct client_pending *entry = bpf_map_lookup_elem(&client_pending, &key);

	if (entry)
		entry->last_read_ns = c->last_read_ns;
}

/* The method of the request line a send starts with; HTTP_METHOD_OTHER where it is none or not readable. */
static __always_inline __u8 sent_method(struct msghdr *msg)
{
	struct stream_peek *peek;
	__u32 zero = 0;

	peek = bpf_map_lookup_elem(&stream_peek, &zero);
	if (!peek || !cursor_start(&peek->cursor, msg) || peek->cursor.left < 8 ||
	    bpf_probe_read_user(peek->bytes, 8, (void *)peek->cursor.base))
		return HTTP_METHOD_OTHER;
	return http1_method(peek->bytes);
}

/* `sk` is connecting: marked, its first send will tell whether it carries requests. */
static __always_inline void client_connecting(struct sock *sk)
{
	if (requests_enabled)
		client_socket_of(sk, true);
}

/* A send on `sk`, which has no server state: a request's first send starts it (and ends the one
 * before); the rest of a request's sends change nothing. A send that is not a request line ends the
 * request before (an upgraded connection's traffic is not requests). */
static __always_inline void client_send_begin(struct sock *sk, struct msghdr *msg)
{
	struct client_socket *c = client_socket_of(sk, false);
	__u64 pid_tgid;
	__u8 method;

	if (!c || c->phase == CLIENT_NONE || c->phase == CLIENT_REQUEST)
		return;
	method = sent_method(msg);
	/* Only a connection's first send makes it a client's. */
	if (c->phase == CLIENT_NEW) {
		c->phase = method == HTTP_METHOD_OTHER ? CLIENT_NONE : CLIENT_IDLE;
		if (c->phase == CLIENT_NONE)
			return;
	}
	client_end(sk, c);
	if (method == HTTP_METHOD_OTHER)
		return;
	pid_tgid = bpf_get_current_pid_tgid();
	c->phase = CLIENT_REQUEST;
	c->method = method;
	c->status = 0;
	c->request_ns = bpf_ktime_get_ns();
	c->tgid = pid_tgid >> 32;
	c->cgroup_id = bpf_get_current_cgroup_id();
}

/* How the body of the response whose head is the scratch's first `len` bytes ends (response_body()),
 * noted in the scratch. A global function: the verifier checks the search once, not once per state of
 * the read that calls it; the bytes are the per-CPU scratch's (a global function takes pointers only
 * from 5.12 on). */
__noinline int peek_response_body(__u32 len)
{
	__u32 zero = 0;
	struct stream_peek *peek = bpf_map_lookup_elem(&stream_peek, &zero);

	if (!peek)
		return BODY_UNKNOWN;
	return response_body(peek->bytes, len, &peek->head);
}

/* How the body of a response to a `method` request, with `status`, whose head is the scratch's first `len`
 * bytes ends; where it has a length, `*left` is it plus the head's bytes (those of the response's first read
 * or write, less that read's or write's bytes, are the body's still to come). A response to HEAD, a 204, a
 * 304 has no body. */
static __always_inline __u8 response_framing(struct stream_peek *peek, __u32 len, __u8 method, __u16 status,
					     __s64 *left)
{
	__u8 body = peek_response_body(len);

	if (peek->head.body_at && (method == HTTP_METHOD_HEAD || status == 204 || status == 304)) {
		body = BODY_LENGTH;
		peek->head.content_length = 0;
	}
	if (body == BODY_LENGTH)
		*left = peek->head.content_length + peek->head.body_at;
	return body;
}

/* How the response whose first read is in the read syscall's buffer (`ret` bytes) ends: its status, and
 * its body's framing. */
static __always_inline void client_response_head(struct client_socket *c, int ret)
{
	struct stream_peek *peek;
	__u32 zero = 0, n;
	__u64 user = received_buffer();

	c->body = BODY_UNKNOWN;
	peek = bpf_map_lookup_elem(&stream_peek, &zero);
	n = opaque(ret < HTTP1_PEEK_BYTES ? ret : HTTP1_PEEK_BYTES);
	if (!peek || !user || n > HTTP1_PEEK_BYTES || bpf_probe_read_user(peek->bytes, n, (void *)user))
		return;
	c->status = http1_status(peek->bytes, n);
	c->body = response_framing(peek, n, c->method, c->status, &c->body_left);
}

/* Whether a read of `ret` bytes ends with chunked encoding's last chunk. */
static __always_inline bool read_last_chunk(int ret)
{
	char tail[5];
	__u64 user = received_buffer();

	return ret >= (int)sizeof(tail) && user && !bpf_probe_read_user(tail, sizeof(tail), (void *)(user + ret - 5)) &&
	       is_last_chunk(tail);
}

/* A read of `ret` bytes on `sk`, which has no server state: its request's response. The first ends
 * the time to first byte and holds the head (readable in the read syscall's buffer); the read that ends
 * the body, where the head tells, counts the request. */
static __always_inline void client_received(struct sock *sk, int ret)
{
	struct client_socket *c = client_socket_of(sk, false);
	__u64 now;

	if (!c || c->phase < CLIENT_REQUEST)
		return;
	now = bpf_ktime_get_ns();
	c->last_read_ns = now;
	if (c->phase == CLIENT_REQUEST) {
		c->phase = CLIENT_RESPONSE;
		c->first_read_ns = now;
		client_response_head(c, ret);
		if (c->body == BODY_UNKNOWN)
			client_pend(sk, c);
	} else if (c->pending) {
		client_pending_read(sk, c);
	}
	c->body_left -= ret;
	if ((c->body == BODY_LENGTH && c->body_left <= 0) || (c->body == BODY_CHUNKED && read_last_chunk(ret)))
		client_end(sk, c);
}

/* The host's side of the connection is done writing: the request in progress ends. */
static __always_inline void client_closed(struct sock *sk)
{
	struct client_socket *c = client_socket_of(sk, false);

	if (c)
		client_end(sk, c);
}

#endif /* AIPROBE_CLIENT_PROGRAMS_H */
