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
 * response's first read ends the time to first byte (its status from the status line, read in the read
 * syscall's buffer); the next request's send, or the connection's close, ends it: its duration runs to
 * its response's last read. Counted then in map client_stats, per (process, cgroup, server address and
 * port, method, status). docs/requests.md has the rules. */
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
	__u32 tgid;
	__u16 status;		/* from the response's first read; 0: not readable */
	__u8 method;		/* enum http_method */
	__u8 phase;		/* enum client_phase */
};

SOCKET_STATE_MAP(client_sockets, struct client_socket);

ENDPOINT_MAP(client_stats, struct client_key, struct client_stats, REQUEST_MAX_ENDPOINTS);

static struct client_stats zero_client_stats;
static struct client_socket zero_client_socket;

/* `sk`'s client state (sk_state.h); where `make`, made if it has none. */
static __always_inline struct client_socket *client_socket_of(struct sock *sk, bool make)
{
	return socket_entry(&client_sockets, sk, &zero_client_socket, make);
}

/* The request in progress on `sk` ended, if its response was read: counted. Named after the current
 * process only when it is the sender (a close may run in softirq, on behalf of any process). */
static __always_inline void client_end(struct sock *sk, struct client_socket *c)
{
	struct client_key key = {
		.tgid = c->tgid, .port = bpf_ntohs(sk->__sk_common.skc_dport), .status = c->status,
		.family = sk->__sk_common.skc_family, .method = c->method, .cgroup_id = c->cgroup_id,
	};
	struct client_stats *stats;

	if (c->phase != CLIENT_RESPONSE)
		return;
	c->phase = CLIENT_IDLE;
	if (key.family == AF_INET)
		__builtin_memcpy(key.addr, &sk->__sk_common.skc_daddr, 4);
	else
		__builtin_memcpy(key.addr, &sk->__sk_common.skc_v6_daddr, 16);
	stats = endpoint_entry(&client_stats, &key, &zero_client_stats, STREAM_COUNTER_CLIENT_ENDPOINTS_FULL);
	if (!stats)
		return;
	if (bpf_get_current_pid_tgid() >> 32 == c->tgid)
		name_entry(stats->comm);
	hist_add_span(&stats->duration, c->request_ns, c->last_read_ns);
	hist_add_span(&stats->ttfb, c->request_ns, c->first_read_ns);
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

/* A read of `ret` bytes on `sk`, which has no server state: its request's response. The first ends
 * the time to first byte and holds the status line (readable in the read syscall's buffer). */
static __always_inline void client_received(struct sock *sk, int ret)
{
	struct client_socket *c = client_socket_of(sk, false);
	char line[12];
	__u64 user, now;

	if (!c || c->phase < CLIENT_REQUEST)
		return;
	now = bpf_ktime_get_ns();
	c->last_read_ns = now;
	if (c->phase == CLIENT_RESPONSE)
		return;
	c->phase = CLIENT_RESPONSE;
	c->first_read_ns = now;
	user = received_buffer();
	if (ret >= (int)sizeof(line) && user && !bpf_probe_read_user(line, sizeof(line), (void *)user))
		c->status = http1_status(line, sizeof(line));
}

/* The host's side of the connection is done writing: the request in progress ends. */
static __always_inline void client_closed(struct sock *sk)
{
	struct client_socket *c = client_socket_of(sk, false);

	if (c)
		client_end(sk, c);
}

#endif /* AIPROBE_CLIENT_PROGRAMS_H */
