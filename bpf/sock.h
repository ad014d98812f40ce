/* SPDX-License-Identifier: GPL-2.0 */
/* Sockets: the uapi numbers vmlinux.h lacks (address families, TCP states, recv flags), and whether a
 * send left its socket full. */
#ifndef AIPROBE_SOCK_H
#define AIPROBE_SOCK_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#define AF_INET 2
#define AF_INET6 10
#define TCP_ESTABLISHED 1
#define TCP_SYN_RECV 3
#define TCP_CLOSE_WAIT 8
#define MSG_PEEK 2

/* A successful send that left `sk` full: it found no room and sent only part (a non-blocking send,
 * what asyncio servers see rather than an EAGAIN, as they send only once the socket polls writable;
 * or a blocking one cut short by SO_SNDTIMEO or a signal). The kernel flags the socket SOCK_NOSPACE
 * when a send finds it full and clears the flag when room frees up, which a blocking send waits for. */
static __always_inline bool left_full(struct sock *sk)
{
	struct socket *sock = sk->sk_socket;

	return sock && (sock->flags & (1UL << SOCK_NOSPACE));
}

#endif /* AIPROBE_SOCK_H */
