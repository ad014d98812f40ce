/* SPDX-License-Identifier: GPL-2.0 */
/* Token streams: the types agent/probes/sendlat/streams.py reads through the object's BTF (the aggregate per
 * endpoint, the stall event, the counters), and the enums that index them. The stream logic is in
 * streams_programs.h, its state and maps in streams_maps.h. */
#ifndef AIPROBE_STREAMS_H
#define AIPROBE_STREAMS_H

#include "vmlinux.h"
#include "common.h"
#include "hist.h"

/* The enums whose names are label values (agent/streams.py reads them from BTF, in value order, each
 * in lower case without its prefix; the _MAX count is none): */
enum stream_protocol {
	STREAM_PROTOCOL_TCP,	/* unreadable or not recognised */
	STREAM_PROTOCOL_HTTP,
	STREAM_PROTOCOL_SSE,
	STREAM_PROTOCOL_HTTP2,
	STREAM_PROTOCOL_GRPC,
	STREAM_PROTOCOL_TLS,
	STREAM_PROTOCOL_MAX,
};
BTF_EXPORT_ENUM(stream_protocol);

enum stall_cause {
	STALL_SERVER,		/* none of the others: the application was slow to produce */
	STALL_NETWORK,		/* the socket was full (EAGAIN, a partial or a blocked send) */
	STALL_CPU,		/* the writing thread waited runnable for a CPU */
	STALL_GPU,		/* the process was inside a CUDA synchronization (map cuda_sync_time) */
	STALL_CAUSE_MAX,
};
BTF_EXPORT_ENUM(stall_cause);

/* The TLS version a ServerHello negotiates (label values "1.0" .. "1.3": '_' reads '.'); none: not known. */
enum tls_version {
	TLS_VERSION_NONE,
	TLS_VERSION_1_0,
	TLS_VERSION_1_1,
	TLS_VERSION_1_2,
	TLS_VERSION_1_3,
	TLS_VERSION_MAX,
};
BTF_EXPORT_ENUM(tls_version);

/* The aggregate's key: a process in a cgroup serving one listening port with one protocol. An entry
 * whose tls_version is not none counts that version's TLS handshakes (`handshake` only). */
struct stream_key {
	__u32 tgid;
	__u16 port;		/* local (listening) port, host order */
	__u8 protocol;		/* enum stream_protocol */
	__u8 tls_version;	/* enum tls_version */
	__u64 cgroup_id;
};

struct stream_stats {
	struct hist ttfb;	/* request received -> first body byte written */
	struct hist gap;	/* between successive writes of a response */
	struct hist duration;	/* request received -> last write, of ended responses */
	struct hist handshake;	/* TLS: the ClientHello's read -> the read of the client's Finished */
	__u64 durations_unknown;	/* ended responses whose last write precedes their request: not in duration */
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
	__u32 stream_id;	/* HTTP/2 stream; 0: the connection's response */
	/* Evidence, each within the gap: */
	__u64 unwritable_ns;	/* the socket was full (since an EAGAIN or a partial send) */
	__u64 blocked_send_ns;	/* the ending send itself blocked (timed sends only) */
	__u64 runqueue_ns;	/* the writing thread waited runnable (same thread as the last write) */
	__u64 cuda_sync_ns;	/* a thread of the process was inside a CUDA synchronization */
	char comm[16];
};

/* Indexes of `stream_counters`. */
enum stream_counter {
	STREAM_COUNTER_LOST_STALLS,
	STREAM_COUNTER_ENDPOINTS_FULL,
	STREAM_COUNTER_H2_UNTIMED,	/* HTTP/2 streams beyond H2_STREAMS on a connection */
	STREAM_COUNTER_REQUEST_ENDPOINTS_FULL,	/* responses not counted: map request_stats was full */
	STREAM_COUNTER_CLIENT_ENDPOINTS_FULL,	/* client requests not counted: map client_stats was full */
	STREAM_COUNTER_MAX,
};
BTF_EXPORT_ENUM(stream_counter);

#endif /* AIPROBE_STREAMS_H */
