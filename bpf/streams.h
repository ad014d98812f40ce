/* SPDX-License-Identifier: GPL-2.0 */
/* Token streams seen from the wire: per response of a TCP server socket, time to first byte, the gaps
 * between its writes, its duration, chunks and bytes; stalls (gaps above a threshold) as ring-buffer
 * events with the evidence of their cause. agent/streams.py reads the structs below through BTF.
 *
 * No program of its own on the send path: sendlat's programs call stream_send_begin() where a send
 * starts (they have its msghdr there) and stream_send_end() where it returns, so a send pays one
 * socket-storage lookup (sockets that are not accepted server connections have none). The receive
 * side (stream_received) and the connection's life (stream_state) are the two programs added.
 *
 * A response: the server, having received bytes (the request), writes. Its first write ends the time
 * to first byte; each later write ends a gap; the next request received, or the connection leaving
 * ESTABLISHED, ends it. HTTP/1.x is read from the response's first bytes: a write holding only the
 * status line and headers is not a chunk (TTFB runs to the first body write) and chunked encoding's
 * last-chunk write ("0\r\n\r\n") ends the response without being a chunk. Include after sendlat's
 * maps: it uses left_full() and its thread's tgid and cgroup. */
#ifndef AIPROBE_STREAMS_H
#define AIPROBE_STREAMS_H

#define TCP_ESTABLISHED 1
#define TCP_SYN_RECV 3
#define MSG_PEEK 2
#define STREAM_MAX_ENDPOINTS 4096
#define STREAM_PEEK_BYTES 512	/* of a response's first write, searched for the SSE content type */

enum stream_protocol {
	STREAM_PROTOCOL_TCP,	/* unreadable or not recognised */
	STREAM_PROTOCOL_HTTP,
	STREAM_PROTOCOL_SSE,
	STREAM_PROTOCOL_HTTP2,
	STREAM_PROTOCOL_GRPC,
	STREAM_PROTOCOL_TLS,
	STREAM_PROTOCOL_MAX,
};

enum stall_cause {
	STALL_SERVER,		/* none of the others: the application was slow to produce */
	STALL_NETWORK,		/* the socket was full (EAGAIN, a partial or a blocked send) */
	STALL_CPU,		/* the writing thread waited runnable for a CPU */
	STALL_GPU,		/* set by user space from the CUDA probe, never here */
	STALL_CAUSE_MAX,
};

/* The aggregate's key: a process in a cgroup serving one listening port with one protocol. */
struct stream_key {
	__u32 tgid;
	__u16 port;		/* local (listening) port, host order */
	__u8 protocol;		/* enum stream_protocol */
	__u8 pad;
	__u64 cgroup_id;
};

struct stream_stats {
	struct hist ttfb;	/* request received -> first body byte written */
	struct hist gap;	/* between successive writes of a response */
	struct hist duration;	/* request received -> last write, of ended responses */
	__u64 streams;		/* responses that wrote a first byte */
	__u64 chunks;		/* their writes (headers-only and last-chunk writes excluded) */
	__u64 bytes;
	__u64 stalls[STALL_CAUSE_MAX];
	char comm[16];
};

/* One gap above the threshold, when the write ending it happens. */
struct stream_stall_event {
	__u32 tgid;
	__u32 tid;
	__u64 cgroup_id;
	__u16 family;
	__u16 local_port;
	__u16 remote_port;
	__u8 protocol;
	__u8 cause;		/* enum stall_cause */
	__u8 local_addr[16];
	__u8 remote_addr[16];
	__u64 gap_ns;
	__u64 elapsed_ns;	/* request received -> the write ending the gap */
	__u32 chunk;		/* the chunk ending the gap, from 1 */
	__u32 pad;
	/* Evidence, each within the gap: */
	__u64 unwritable_ns;	/* the socket was full (since an EAGAIN or a partial send) */
	__u64 blocked_send_ns;	/* the ending send itself blocked (timed sends only) */
	__u64 runqueue_ns;	/* the writing thread waited runnable (same thread as the last write) */
	char comm[16];
};

/* Per accepted connection. */
enum stream_phase { STREAM_IDLE, STREAM_REQUEST, STREAM_RESPONSE };
enum stream_write { WRITE_BODY, WRITE_HEADERS, WRITE_LAST_CHUNK };

struct stream_socket {
	__u64 request_ns;	/* last request bytes received */
	__u64 last_write_ns;
	__u64 full_since_ns;	/* the socket found full since; 0: writable */
	__u64 run_delay_ns;	/* writer's sched_info.run_delay at its last write */
	struct stream_key key;
	__u32 writer_tid;
	__u32 chunks;
	__u8 phase;		/* enum stream_phase */
	__u8 write;		/* enum stream_write: what the send in progress holds (stream_send_begin) */
	__u8 classified;	/* protocol read from the connection's first response */
};

/* Set by user space while running (its own section: sendlat's `.data` stays sendlat's). */
__u32 streams_enabled SEC(".data.streams") = 0;
__u64 stall_threshold_ns SEC(".data.streams") = 250 * 1000 * 1000;

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct stream_socket);
} stream_sockets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, STREAM_MAX_ENDPOINTS);
	__type(key, struct stream_key);
	__type(value, struct stream_stats);
} stream_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} stream_stalls SEC(".maps");

/* Scratch for the first bytes of a response (too large for the stack). */
struct stream_peek {
	char bytes[STREAM_PEEK_BYTES];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stream_peek);
} stream_peek SEC(".maps");

/* Indexes of `stream_counters`. */
enum stream_counter {
	STREAM_COUNTER_LOST_STALLS,
	STREAM_COUNTER_ENDPOINTS_FULL,
	STREAM_COUNTER_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, STREAM_COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stream_counters SEC(".maps");

BTF_EXPORT(stream_stall_event);

static struct stream_stats zero_stream_stats;

static __always_inline void stream_count(enum stream_counter index)
{
	__u32 key = index;
	__u64 *value = bpf_map_lookup_elem(&stream_counters, &key);

	if (value)
		__sync_fetch_and_add(value, 1);
}

/* The stats of the socket's endpoint, created (named after the current process) on first use. */
static __noinline struct stream_stats *stream_endpoint(struct stream_key *key)
{
	struct stream_stats *stats = bpf_map_lookup_elem(&stream_stats, key);
	struct task_struct *leader;

	if (stats)
		return stats;
	bpf_map_update_elem(&stream_stats, key, &zero_stream_stats, BPF_NOEXIST);
	stats = bpf_map_lookup_elem(&stream_stats, key);
	if (!stats) {
		stream_count(STREAM_COUNTER_ENDPOINTS_FULL);
		return NULL;
	}
	if (!stats->comm[0]) {
		leader = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), group_leader);
		bpf_core_read_str(stats->comm, sizeof(stats->comm), &leader->comm);
	}
	return stats;
}

/* --- the connection --- */

/* The response in progress ended (at its last write). */
static __always_inline void stream_end(struct stream_socket *s)
{
	struct stream_stats *stats;

	if (s->phase != STREAM_RESPONSE)
		return;
	s->phase = STREAM_IDLE;
	stats = bpf_map_lookup_elem(&stream_stats, &s->key);
	if (stats)
		hist_add(&stats->duration, s->last_write_ns - s->request_ns);
}

/* Accepted connections get their state; a connection leaving ESTABLISHED ends its response. */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(streams_set_state, struct sock *sk, int oldstate, int newstate)
{
	struct stream_socket *s;

	if (!streams_enabled || sk->sk_protocol != IPPROTO_TCP)
		return 0;
	if (oldstate == TCP_SYN_RECV && newstate == TCP_ESTABLISHED) {
		bpf_sk_storage_get(&stream_sockets, sk, NULL, BPF_SK_STORAGE_GET_F_CREATE);
		return 0;
	}
	if (oldstate == TCP_ESTABLISHED && (s = bpf_sk_storage_get(&stream_sockets, sk, NULL, 0)))
		stream_end(s);
	return 0;
}

/* The server received `ret` bytes: a request (or more of it). */
static __always_inline void stream_received(struct sock *sk, int ret, int flags)
{
	struct stream_socket *s;

	if (!streams_enabled || ret <= 0 || (flags & MSG_PEEK))
		return;
	s = bpf_sk_storage_get(&stream_sockets, sk, NULL, 0);
	if (!s)
		return;
	stream_end(s);
	s->phase = STREAM_REQUEST;
	s->request_ns = bpf_ktime_get_ns();
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(streams_recv, struct sock *sk, int ret, int flags)
{
	stream_received(sk, ret, flags);
	return 0;
}

SEC("fexit/tcp_recvmsg")
int BPF_PROG(streams_fexit_recv, struct sock *sk)
{
	__u64 ret = 0;

	bpf_get_func_ret(ctx, &ret);	/* tcp_recvmsg's arguments changed over time; its return did not */
	stream_received(sk, (int)ret, 0);
	return 0;
}

/* --- reading a response's first bytes --- */

/* Where the send's data starts in user memory, and its length; 0 when not a plain user buffer. */
static __always_inline __u64 send_buffer(struct msghdr *msg, __u64 *len)
{
	struct iov_iter *iter = &msg->msg_iter;
	const struct iovec *iov;
	__u64 offset = iter->iov_offset;

	*len = iter->count;
	if (iter->iter_type == ITER_UBUF)
		return (__u64)iter->ubuf + offset;
	if (iter->iter_type != ITER_IOVEC)
		return 0;
	iov = iter->__iov;
	/* Only the first segment is read: its length bounds what is contiguous. */
	*len = BPF_CORE_READ(iov, iov_len) - offset;
	return (__u64)BPF_CORE_READ(iov, iov_base) + offset;
}

#define BYTES4(a, b, c, d) ((__u32)(a) | (__u32)(b) << 8 | (__u32)(c) << 16 | (__u32)(d) << 24)

static __always_inline __u32 first4(const char *bytes)
{
	__u32 word;

	__builtin_memcpy(&word, bytes, 4);
	return word;
}

/* "HTTP/1." (len >= 8) */
static __always_inline bool is_http1(const char *bytes, __u64 len)
{
	return len >= 8 && first4(bytes) == BYTES4('H', 'T', 'T', 'P') && bytes[4] == '/' && bytes[5] == '1' &&
	       bytes[6] == '.';
}

/* Whether the headers name text/event-stream: searched for "event-st" then "ream". */
static __always_inline bool has_event_stream(const char *bytes, __u32 len)
{
	const __u64 event_st = 0x74732d746e657665ULL;	/* "event-st" little-endian */
	__u64 word;
	__u32 tail;

	for (__u32 i = 0; i + 12 <= STREAM_PEEK_BYTES; i++) {
		if (i + 12 > len)
			break;
		__builtin_memcpy(&word, bytes + i, 8);
		if (word != event_st)
			continue;
		__builtin_memcpy(&tail, bytes + i + 8, 4);
		if (tail == BYTES4('r', 'e', 'a', 'm'))
			return true;
	}
	return false;
}

static __always_inline __u8 protocol_of(const char *bytes, __u32 len)
{
	if (len >= 3 && bytes[0] == 0x16 && bytes[1] == 0x03)
		return STREAM_PROTOCOL_TLS;	/* a handshake record: encrypted from here */
	if (len >= 3 && bytes[0] == 0x17 && bytes[1] == 0x03)
		return STREAM_PROTOCOL_TLS;
	if (is_http1(bytes, len))
		return has_event_stream(bytes, len) ? STREAM_PROTOCOL_SSE : STREAM_PROTOCOL_HTTP;
	/* The server's connection preface: a SETTINGS frame (type 4) on stream 0. */
	if (len >= 9 && bytes[3] == 4 && !bytes[5] && !bytes[6] && !bytes[7] && !bytes[8])
		return STREAM_PROTOCOL_HTTP2;
	return STREAM_PROTOCOL_TCP;
}

/* What a write of an HTTP/1.x response holds: a 5-byte "0\r\n\r\n" is chunked encoding's end; its
 * first write may be the headers alone (it starts with the status line and ends with the blank line). */
static __always_inline __u8 http_write(struct stream_socket *s, const char *first, __u64 user, __u64 len)
{
	__u32 last4;

	if (len == 5 && first4(first) == BYTES4('0', '\r', '\n', '\r') && first[4] == '\n')
		return WRITE_LAST_CHUNK;
	if (s->phase == STREAM_REQUEST && is_http1(first, len)) {
		if (bpf_probe_read_user(&last4, 4, (void *)(user + len - 4)))
			return WRITE_BODY;
		return last4 == BYTES4('\r', '\n', '\r', '\n') ? WRITE_HEADERS : WRITE_BODY;
	}
	return WRITE_BODY;
}

/* A send on `sk` starts (`msg` not yet copied): read what it holds when that matters — the
 * connection's first response (its protocol), a response's first write, a 5-byte write. */
static __always_inline void stream_send_begin(struct sock *sk, struct msghdr *msg)
{
	struct stream_socket *s;
	struct stream_peek *peek;
	__u32 zero = 0, n;
	__u64 user, len;
	bool plain_http;

	if (!streams_enabled || !(s = bpf_sk_storage_get(&stream_sockets, sk, NULL, 0)))
		return;
	s->write = WRITE_BODY;
	plain_http = s->key.protocol == STREAM_PROTOCOL_HTTP || s->key.protocol == STREAM_PROTOCOL_SSE;
	if (s->phase == STREAM_IDLE || (s->classified && !plain_http))
		return;
	if (s->phase == STREAM_RESPONSE && !(plain_http && msg->msg_iter.count == 5))
		return;
	user = send_buffer(msg, &len);
	peek = bpf_map_lookup_elem(&stream_peek, &zero);
	if (!user || !len || !peek)
		return;
	n = len < STREAM_PEEK_BYTES ? len : STREAM_PEEK_BYTES;
	if (bpf_probe_read_user(peek->bytes, n, (void *)user))
		return;
	if (!s->classified) {
		s->key.protocol = protocol_of(peek->bytes, n);
		s->classified = 1;
	}
	if (s->key.protocol == STREAM_PROTOCOL_HTTP || s->key.protocol == STREAM_PROTOCOL_SSE)
		s->write = http_write(s, peek->bytes, user, len);
}

/* --- the server's writes --- */

static __always_inline __u64 run_delay_of_current(void)
{
	return bpf_get_current_task_btf()->sched_info.run_delay;
}

static __always_inline __u64 at_most(__u64 value, __u64 limit)
{
	return value < limit ? value : limit;
}

static __always_inline void emit_stall(struct sock *sk, struct stream_socket *s, struct stream_stats *stats,
				       __u64 now, __u64 gap, __u64 start_ns)
{
	struct stream_stall_event *event;
	__u64 since;
	__u8 cause = STALL_SERVER;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	event = bpf_ringbuf_reserve(&stream_stalls, sizeof(*event), 0);
	if (!event) {
		stream_count(STREAM_COUNTER_LOST_STALLS);
		return;
	}
	since = s->full_since_ns > s->last_write_ns ? s->full_since_ns : s->last_write_ns;
	event->unwritable_ns = s->full_since_ns ? now - since : 0;
	event->blocked_send_ns = start_ns ? at_most(now - start_ns, gap) : 0;
	event->runqueue_ns = tid == s->writer_tid ? at_most(run_delay_of_current() - s->run_delay_ns, gap) : 0;
	/* A cause explains a stall when it covers at least half of it; the larger one wins. */
	if (event->unwritable_ns + event->blocked_send_ns >= gap / 2)
		cause = STALL_NETWORK;
	if (event->runqueue_ns >= gap / 2 && event->runqueue_ns > event->unwritable_ns + event->blocked_send_ns)
		cause = STALL_CPU;
	__sync_fetch_and_add(&stats->stalls[cause], 1);
	event->cause = cause;
	event->tgid = s->key.tgid;
	event->tid = tid;
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
	event->elapsed_ns = now - s->request_ns;
	event->chunk = s->chunks + 1;
	event->pad = 0;
	__builtin_memcpy(event->comm, stats->comm, sizeof(event->comm));
	bpf_ringbuf_submit(event, 0);
}

/* The first body write of a response. */
static __always_inline struct stream_stats *stream_begin(struct sock *sk, struct stream_socket *s, __u32 tgid,
							 __u64 cgroup_id, __u64 now)
{
	struct stream_stats *stats;

	s->key.tgid = tgid;
	s->key.cgroup_id = cgroup_id;
	s->key.port = sk->__sk_common.skc_num;
	stats = stream_endpoint(&s->key);
	if (!stats)
		return NULL;
	s->phase = STREAM_RESPONSE;
	s->chunks = 0;
	__sync_fetch_and_add(&stats->streams, 1);
	hist_add(&stats->ttfb, now - s->request_ns);
	return stats;
}

/* A TCP sendmsg of thread (tgid, cgroup_id) on `sk` returned `ret`; `start_ns`: its start if timed. */
static __always_inline void stream_send_end(struct sock *sk, long ret, __u64 start_ns, __u32 tgid, __u64 cgroup_id)
{
	struct stream_socket *s;
	struct stream_stats *stats;
	__u64 now, gap;
	__u8 write;

	if (!streams_enabled || !(s = bpf_sk_storage_get(&stream_sockets, sk, NULL, 0)))
		return;
	write = s->write;
	s->write = WRITE_BODY;
	now = bpf_ktime_get_ns();
	if (ret <= 0) {
		if (ret == -EAGAIN && !s->full_since_ns)
			s->full_since_ns = now;
		return;
	}
	if (s->phase == STREAM_IDLE || write == WRITE_HEADERS)
		goto done;	/* the server speaks first, or the headers alone: not a chunk */
	if (write == WRITE_LAST_CHUNK) {
		stream_end(s);
		s->phase = STREAM_IDLE;	/* also a response without a body write: no stream */
		goto done;
	}
	if (s->phase == STREAM_REQUEST) {
		if (!(stats = stream_begin(sk, s, tgid, cgroup_id, now)))
			goto done;
	} else {
		if (!(stats = bpf_map_lookup_elem(&stream_stats, &s->key)))
			goto done;
		gap = now - s->last_write_ns;
		hist_add(&stats->gap, gap);
		if (gap >= stall_threshold_ns)
			emit_stall(sk, s, stats, now, gap, start_ns);
	}
	s->chunks++;
	__sync_fetch_and_add(&stats->chunks, 1);
	__sync_fetch_and_add(&stats->bytes, ret);
	s->last_write_ns = now;
	s->writer_tid = (__u32)bpf_get_current_pid_tgid();
	s->run_delay_ns = run_delay_of_current();
done:
	if (left_full(sk)) {
		if (!s->full_since_ns)
			s->full_since_ns = now;
	} else {
		s->full_since_ns = 0;
	}
}

#endif /* AIPROBE_STREAMS_H */
