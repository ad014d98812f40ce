// SPDX-License-Identifier: GPL-2.0
/* Connection set-up per listening socket: its accept-queue overflows and the time each connection
 * waits in its accept queue (handshake complete to accept() returning it). The queues themselves
 * (length, capacity, half-open requests) come from sock_diag in user space, with no BPF.
 *
 * An overflow is counted where the kernel counts LINUX_MIB_LISTENOVERFLOWS, from the same test
 * (sk_acceptq_is_full) made at the entry of the function that makes it first:
 *   tcp_conn_request (a SYN at a full queue; unless the SYN queue is full too and SYN cookies are
 *   off, where it drops the SYN before that test), tcp_v4_syn_recv_sock and tcp_v6_syn_recv_sock
 *   (the handshake's last ACK at a full queue; a v4-mapped ACK at a v6 listener is counted by the
 *   v4 function it calls). Summed over listeners, this is the host's ListenOverflows, but for a
 *   queue that an accept() empties between this test and the kernel's.
 * On kernels with neither fentry nor kprobes, the `tracepoint` strategy counts the drops with
 * reason TCP_LISTEN_OVERFLOW (skb:kfree_skb with its rx_sk, 6.15+): the last ACKs only; a SYN at a
 * full queue leaves no trace there.
 *
 * Accept wait: the child socket syn_recv_sock returns is stamped (the `children` table, LRU: a
 * child closed before any accept() leaves no entry behind for long); inet_csk_accept returning it
 * adds now minus the stamp to its listener's histogram.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "common.h"
#include "connections.h"

char LICENSE[] SEC("license") = "GPL";

#define ETH_P_IP 0x0800
#define MAX_LISTENERS 1024	/* 7 KiB each, preallocated: 7 MiB */
#define MAX_WAITING_CHILDREN 65536

BTF_EXPORT_ENUM(connections_counter);

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_LISTENERS);
	__type(key, __u64);	/* socket cookie */
	__type(value, struct listener_stats);
} listeners SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_WAITING_CHILDREN);
	__type(key, __u64);	/* the child socket's address */
	__type(value, __u64);	/* when its handshake completed (CLOCK_MONOTONIC ns) */
} children SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);	/* thread id */
	__type(value, __u64);	/* the listening socket it calls accept() on (kprobe strategy) */
} accepting SEC(".maps");

/* Per CPU: tcp_v{4,6}_syn_recv_sock runs in softirq context (on whichever task it interrupted, the
 * idle task's pid 0 on every CPU), from entry to return on one CPU, never nested. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct handshake_start);
} handshake SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CONN_COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static const struct listener_stats empty_stats;

/* The agent's network namespace (its inode, set before load; 0: every namespace): sock_diag lists
 * its listeners only, and TcpExt ListenOverflows counts its overflows only. */
const volatile __u32 netns_inum = 0;

/* The listener's entry, by the cookie sock_diag gave it (0 while no one asked); NULL for a listener
 * of another network namespace, or when the table is full. */
static __always_inline struct listener_stats *stats_of(const struct sock *sk)
{
	__u64 cookie = BPF_CORE_READ(sk, __sk_common.skc_cookie.counter);
	struct listener_stats *stats;

	if (netns_inum && BPF_CORE_READ(sk, __sk_common.skc_net.net, ns.inum) != netns_inum)
		return NULL;
	stats = lookup_or_init(&listeners, &cookie, &empty_stats);
	if (!stats)
		counter_inc(&counters, CONN_LISTENERS_FULL);
	return stats;
}

static __always_inline void count_overflow(const struct sock *sk)
{
	struct listener_stats *stats = stats_of(sk);

	if (stats)
		__sync_fetch_and_add(&stats->overflows, 1);
}

/* sk_acceptq_is_full(), as the kernel tests it. */
static __always_inline bool accept_queue_full(const struct sock *sk)
{
	return BPF_CORE_READ(sk, sk_ack_backlog) > BPF_CORE_READ(sk, sk_max_ack_backlog);
}

/* tcp_conn_request: a SYN at a full accept queue is an overflow, unless the SYN queue is full too
 * with SYN cookies off, where the SYN is dropped (ListenDrops) before the accept queue's test. */
static __always_inline void syn_arrived(struct sock *sk)
{
	const struct inet_connection_sock *icsk = (const void *)sk;
	int requests;
	__u8 cookies;

	if (!accept_queue_full(sk))
		return;
	requests = BPF_CORE_READ(icsk, icsk_accept_queue.qlen.counter);
	cookies = BPF_CORE_READ(sk, __sk_common.skc_net.net, ipv4.sysctl_tcp_syncookies);
	if (cookies == 0 && requests >= (int)BPF_CORE_READ(sk, sk_max_ack_backlog))
		return;
	count_overflow(sk);
}

/* tcp_v{4,6}_syn_recv_sock: the handshake's last ACK, an overflow at a full accept queue; else the
 * request's first SYN-ACK time, for its return to time the handshake. */
static __always_inline void ack_arrived(const struct sock *sk, const struct sk_buff *skb,
					const struct request_sock *req, bool v6)
{
	__u32 zero = 0;
	struct handshake_start *start = bpf_map_lookup_elem(&handshake, &zero);

	if (v6 && BPF_CORE_READ(skb, protocol) == bpf_htons(ETH_P_IP))
		return;	/* v4-mapped: tcp_v4_syn_recv_sock tests, counts and times it */
	if (!start)
		return;
	start->synack_ns = 0;
	if (accept_queue_full(sk)) {
		count_overflow(sk);
		return;
	}
	/* tcp_clock_us(): CLOCK_MONOTONIC, as bpf_ktime_get_ns(); 0 for a request rebuilt from a SYN cookie */
	start->listener = (__u64)sk;
	start->synack_ns = BPF_CORE_READ((const struct tcp_request_sock *)req, snt_synack) * 1000;
}

/* tcp_v{4,6}_syn_recv_sock returned `child` (NULL: no connection): its handshake is timed, and the
 * child stamped for accept(). A v4-mapped handshake returns through both functions: the first
 * return takes the CPU's start. */
static __always_inline void handshake_done(const struct sock *child)
{
	__u32 zero = 0;
	__u64 key = (__u64)child, now = bpf_ktime_get_ns();
	struct handshake_start *start = bpf_map_lookup_elem(&handshake, &zero);
	struct listener_stats *stats;

	if (start && start->synack_ns) {
		stats = child && now > start->synack_ns ? stats_of((const struct sock *)start->listener) : NULL;
		if (stats)
			hist_add(&stats->handshake, now - start->synack_ns);
		start->synack_ns = 0;
	}
	if (child)
		bpf_map_update_elem(&children, &key, &now, BPF_ANY);
}

static __always_inline void accepted(const struct sock *listener, const struct sock *child)
{
	struct listener_stats *stats;
	__u64 key = (__u64)child, *ready;

	if (!child)
		return;
	stats = stats_of(listener);
	if (!stats)
		return;
	__sync_fetch_and_add(&stats->accepted, 1);
	ready = bpf_map_lookup_elem(&children, &key);
	if (ready) {
		hist_add(&stats->accept_wait, bpf_ktime_get_ns() - *ready);
		bpf_map_delete_elem(&children, &key);
	}
}

/* --- overflows: the same test at the entry of each function that counts them, by fentry or kprobe --- */

/* Declares <name>_fentry and <name>_kprobe on `func`, both running `body` over its arguments. */
#define AT_ENTRY(name, func, body, ...)								\
	SEC("fentry/" #func) int BPF_PROG(name##_fentry, __VA_ARGS__) { body; return 0; }		\
	SEC("kprobe/" #func) int BPF_KPROBE(name##_kprobe, __VA_ARGS__) { body; return 0; }

AT_ENTRY(cn_syn, tcp_conn_request, syn_arrived(sk),
	 struct request_sock_ops *rsk_ops, const void *af_ops, struct sock *sk)
AT_ENTRY(cn_ack4, tcp_v4_syn_recv_sock, ack_arrived(sk, skb, req, false),
	 const struct sock *sk, struct sk_buff *skb, struct request_sock *req)
AT_ENTRY(cn_ack6, tcp_v6_syn_recv_sock, ack_arrived(sk, skb, req, true),
	 const struct sock *sk, struct sk_buff *skb, struct request_sock *req)

/* --- handshake and accept wait: fexit --- */

/* Their return value is read with bpf_get_func_ret: the Debian kernels' BTF gives the return slot
 * of tcp_v{4,6}_syn_recv_sock a type the verifier refuses to read directly ("arg6 type FUNC_PROTO
 * is not a struct"); the child is only a key here, so its address as a number is all we need. */
static __always_inline void handshake_returned(__u64 *ctx)
{
	__u64 child = 0;

	bpf_get_func_ret(ctx, &child);
	handshake_done((const struct sock *)child);
}

SEC("fexit/tcp_v4_syn_recv_sock")
int cn_ready4_fexit(__u64 *ctx)
{
	handshake_returned(ctx);
	return 0;
}

SEC("fexit/tcp_v6_syn_recv_sock")
int cn_ready6_fexit(__u64 *ctx)
{
	handshake_returned(ctx);
	return 0;
}

/* inet_csk_accept's arguments changed in 6.10 (flags, err, kern -> one struct): the listener is
 * its first either way, and bpf_get_func_ret finds the return value whatever their number. */
SEC("fexit/inet_csk_accept")
int cn_accept_fexit(__u64 *ctx)
{
	__u64 child = 0;

	bpf_get_func_ret(ctx, &child);
	accepted((const struct sock *)ctx[0], (const struct sock *)child);
	return 0;
}

/* --- handshake and accept wait: kretprobe, kprobe --- */

SEC("kretprobe/tcp_v4_syn_recv_sock")
int BPF_KRETPROBE(cn_ready4_kret, struct sock *child)
{
	handshake_done(child);
	return 0;
}

SEC("kretprobe/tcp_v6_syn_recv_sock")
int BPF_KRETPROBE(cn_ready6_kret, struct sock *child)
{
	handshake_done(child);
	return 0;
}

SEC("kprobe/inet_csk_accept")
int BPF_KPROBE(cn_acc_kprobe, struct sock *listener)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 sk = (__u64)listener;

	bpf_map_update_elem(&accepting, &tid, &sk, BPF_ANY);
	return 0;
}

SEC("kretprobe/inet_csk_accept")
int BPF_KRETPROBE(cn_acc_kret, struct sock *child)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *listener = bpf_map_lookup_elem(&accepting, &tid);

	if (listener) {
		accepted((const struct sock *)*listener, child);
		bpf_map_delete_elem(&accepting, &tid);
	}
	return 0;
}

/* --- tracepoint: drops with reason TCP_LISTEN_OVERFLOW (6.15+), at the listener that dropped; user space
 * refuses the strategy on a kernel without that reason --- */

SEC("tp_btf/kfree_skb")
int BPF_PROG(cn_drop_tp, struct sk_buff *skb, void *location, enum skb_drop_reason reason, struct sock *rx_sk)
{
	if (reason == bpf_core_enum_value(enum skb_drop_reason, SKB_DROP_REASON_TCP_LISTEN_OVERFLOW) && rx_sk)
		count_overflow(rx_sk);
	return 0;
}

/* --- reference for `make bench`: an empty program on each hook of each strategy above, named
 * cn_empty_<the program's name without cn_>; no strategy loads them --- */

#define EMPTY(name, hook) SEC(hook) int cn_empty_##name(void *ctx) { return 0; }

EMPTY(syn_fentry, "fentry/tcp_conn_request")
EMPTY(ack4_fentry, "fentry/tcp_v4_syn_recv_sock")
EMPTY(ack6_fentry, "fentry/tcp_v6_syn_recv_sock")
EMPTY(ready4_fexit, "fexit/tcp_v4_syn_recv_sock")
EMPTY(ready6_fexit, "fexit/tcp_v6_syn_recv_sock")
EMPTY(accept_fexit, "fexit/inet_csk_accept")
EMPTY(syn_kprobe, "kprobe/tcp_conn_request")
EMPTY(ack4_kprobe, "kprobe/tcp_v4_syn_recv_sock")
EMPTY(ack6_kprobe, "kprobe/tcp_v6_syn_recv_sock")
EMPTY(ready4_kret, "kretprobe/tcp_v4_syn_recv_sock")
EMPTY(ready6_kret, "kretprobe/tcp_v6_syn_recv_sock")
EMPTY(acc_kprobe, "kprobe/inet_csk_accept")
EMPTY(acc_kret, "kretprobe/inet_csk_accept")
EMPTY(drop_tp, "tp_btf/kfree_skb")
