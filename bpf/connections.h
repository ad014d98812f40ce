/* SPDX-License-Identifier: GPL-2.0 */
/* The connections probe's types user space decodes through the object's BTF
 * (agent/probes/connections/probe.py). */
#ifndef AIPROBE_CONNECTIONS_H
#define AIPROBE_CONNECTIONS_H

#include "vmlinux.h"
#include "hist.h"

/* Per listening socket, by its socket cookie (sock_diag's idiag_cookie): cookie 0 collects what
 * happened at a listener no one had asked the cookie of yet (created after the agent's last read). */
struct listener_stats {
	__u64 overflows;	/* connections its full accept queue dropped (TcpExt ListenOverflows) */
	__u64 accepted;		/* connections accept() handed out */
	struct hist accept_wait;	/* handshake complete to accept() returning it; accepted minus
				 * count: connections complete before the probe started */
	struct hist handshake;	/* first SYN-ACK sent to handshake complete (not for SYN cookies) */
};

/* The handshake completing on this CPU: between tcp_v{4,6}_syn_recv_sock's entry and its return. */
struct handshake_start {
	__u64 listener;		/* the listening socket's address */
	__u64 synack_ns;	/* when its first SYN-ACK left (tcp_request_sock.snt_synack, CLOCK_MONOTONIC) */
};

/* Indexes into the `counters` array. */
enum connections_counter {
	CONN_LISTENERS_FULL,	/* events at a listener the full `listeners` table had no room for */
	CONN_COUNTER_MAX,
};

#endif
