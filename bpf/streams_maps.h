/* SPDX-License-Identifier: GPL-2.0 */
/* Token streams' kernel state: what each accepted connection's socket storage holds (the response in
 * progress, its HTTP/2 streams), the settings user space writes, the maps, and the endpoint entries. */
#ifndef AIPROBE_STREAMS_MAPS_H
#define AIPROBE_STREAMS_MAPS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "common.h"
#include "hpack.h"
#include "http1.h"
#include "msg.h"
#include "requests.h"
#include "sk_state.h"
#include "streams.h"

#define STREAM_MAX_ENDPOINTS 4096
#define REQUEST_MAX_ENDPOINTS 4096	/* (process, port, protocol, method, status) entries */
#define H2_STREAMS 8		/* HTTP/2 streams timed at once per connection */
#define H2_FRAMES 8		/* streams a write is read for (frames carrying DATA or an end) */

/* Per accepted connection. */
enum stream_phase { STREAM_IDLE, STREAM_REQUEST, STREAM_RESPONSE };
enum stream_write { WRITE_BODY, WRITE_HEADERS, WRITE_LAST_CHUNK };

/* stream_timing.cuda_sync_ns where it was not read: above any time read later, so never a stall's evidence. */
#define SYNCS_UNREAD (~0ULL)

/* The timing of one response: a connection's (HTTP/1.x, TLS, TCP) or an HTTP/2 stream's. */
struct stream_timing {
	__u64 request_ns;	/* last request bytes received */
	__u64 last_write_ns;
	__u64 run_delay_ns;	/* writer's sched_info.run_delay at its last write */
	__u64 cuda_sync_ns;	/* its process's time inside CUDA synchronizations then (cuda_sync_ns()); SYNCS_UNREAD:
				 * not read, as the cuda probe did not run */
	__u32 writer_tid;
	__u32 chunks;		/* 0: no body byte written yet */
	/* The requests part (requests.h): */
	__u64 request_bytes;	/* read for its request */
	__u64 response_bytes;	/* of its body writes */
	__u16 status;		/* read from its first write (HTTP/2: its HEADERS); 0: none yet, or not readable */
	__u8 method;		/* enum http_method, read from its request's first bytes */
	__u8 rpc_status;	/* grpc-status + 1, from its trailers (HEADERS ending the stream); 0: not readable */
};

struct h2_stream {
	__u32 id;		/* 0: free slot */
	__u32 pad;
	struct stream_timing t;
};

/* What a write's frame carries for its HTTP/2 stream (stream_socket.frame_carries). */
enum h2_carries { H2_CARRIES_DATA = 1, H2_CARRIES_END = 2 };

struct stream_socket {
	struct stream_timing t;	/* the connection's response (not HTTP/2) */
	__u64 full_since_ns;	/* the socket found full since; 0: writable */
	__u64 first_read_ns;	/* the connection's first read (TLS: the ClientHello's) */
	struct stream_key key;
	__u8 phase;		/* enum stream_phase */
	__u8 write;		/* enum stream_write: what the send in progress holds (stream_send_begin) */
	__u8 classified;	/* protocol read from the connection's first response */
	__u8 frames;		/* HTTP/2: entries of frame_stream/frame_carries for the send in progress */
	__u8 tls_awaiting;	/* enum tls_version: the server's ServerHello is out, the client's Finished awaited */
	__u8 body;		/* HTTP/1.x: enum http1_body, how the response in progress ends */
	__s64 body_left;	/* BODY_LENGTH: its body's bytes still to write */
	__u32 frame_stream[H2_FRAMES];
	__u8 frame_carries[H2_FRAMES];	/* enum h2_carries */
	struct h2_stream h2[H2_STREAMS];
	struct hpack_table hpack;	/* HTTP/2: the server's encoder's dynamic table */
	__u64 sending;		/* HTTP/2: bytes of the send in progress */
	__u64 walked;		/* HTTP/2: bytes of its frames walked */
};

/* Set by user space while running (its own section: sendlat's `.data` stays sendlat's). */
__u32 streams_enabled SEC(".data.streams") = 0;
__u64 stall_threshold_ns SEC(".data.streams") = 250 * 1000 * 1000;
__u32 requests_enabled SEC(".data.streams") = 0;	/* the requests part (with streams_enabled) */
/* While the cuda probe shares map cuda_sync_time (bpf/cuda_sync.h), which it alone writes: else the map is
 * the streams' own and empty, and a write does not look its process up in it. */
__u32 cuda_syncs_shared SEC(".data.streams") = 0;

SOCKET_STATE_MAP(stream_sockets, struct stream_socket);

/* Aggregates by endpoint: a hash map of `value` by `key`, whose entries are made on first use
 * (endpoint_entry()). */
#define ENDPOINT_MAP(name, key_type, value_type, entries)		\
	struct {							\
		__uint(type, BPF_MAP_TYPE_HASH);			\
		__uint(map_flags, BPF_F_NO_PREALLOC);			\
		__uint(max_entries, entries);				\
		__type(key, key_type);					\
		__type(value, value_type);				\
	} name SEC(".maps")

ENDPOINT_MAP(stream_stats, struct stream_key, struct stream_stats, STREAM_MAX_ENDPOINTS);
ENDPOINT_MAP(request_stats, struct request_key, struct request_stats, REQUEST_MAX_ENDPOINTS);

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} stream_stalls SEC(".maps");

/* Per-CPU scratch: the first bytes of a response (too large for the stack) and how its body ends, the
 * frame walk's cursor and the header block walk's, with its copy of the connection's table. */
struct stream_peek {
	char bytes[HTTP1_PEEK_BYTES];
	struct http1_head head;	/* response_body()'s: the framing of the head in `bytes` */
	struct msg_cursor cursor;
	struct msg_cursor block;
	struct hpack_block fields;
	struct hpack_table table;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct stream_peek);
} stream_peek SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, STREAM_COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stream_counters SEC(".maps");

BTF_EXPORT(stream_stall_event);

static struct stream_stats zero_stream_stats;
static struct request_stats zero_request_stats;
static struct stream_socket zero_stream_socket;

/* `sk`'s server state (sk_state.h); where `make`, made if it has none. */
static __always_inline struct stream_socket *stream_socket_of(struct sock *sk, bool make)
{
	return socket_entry(&stream_sockets, sk, &zero_stream_socket, make);
}

static __always_inline void stream_count(enum stream_counter index)
{
	counter_inc(&stream_counters, index);
}

/* The entry of `key` in hash map `map`, made from `zero` on first use; NULL when the map is full
 * (counted in `full`). */
static __always_inline void *endpoint_entry(void *map, const void *key, const void *zero, enum stream_counter full)
{
	void *entry = bpf_map_lookup_elem(map, key);

	if (entry)
		return entry;
	bpf_map_update_elem(map, key, zero, BPF_NOEXIST);
	entry = bpf_map_lookup_elem(map, key);
	if (!entry)
		stream_count(full);
	return entry;
}

/* An entry's name: the current process's (its leader's comm), once. */
static __always_inline void name_entry(char comm[16])
{
	struct task_struct *leader;

	if (comm[0])
		return;
	leader = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), group_leader);
	bpf_core_read_str(comm, 16, &leader->comm);
}

/* The stats of the socket's endpoint, created (named after the current process) on first use. */
static __noinline struct stream_stats *stream_endpoint(struct stream_key *key)
{
	struct stream_stats *stats = endpoint_entry(&stream_stats, key, &zero_stream_stats,
						    STREAM_COUNTER_ENDPOINTS_FULL);

	if (stats)
		name_entry(stats->comm);
	return stats;
}

/* The requests of one (endpoint, method, status), created on first use. */
static __noinline struct request_stats *request_endpoint(struct request_key *key)
{
	struct request_stats *stats = endpoint_entry(&request_stats, key, &zero_request_stats,
						     STREAM_COUNTER_REQUEST_ENDPOINTS_FULL);

	if (stats)
		name_entry(stats->comm);
	return stats;
}

#endif /* AIPROBE_STREAMS_MAPS_H */
