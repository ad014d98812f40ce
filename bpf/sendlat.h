/* SPDX-License-Identifier: GPL-2.0 */
/* TCP send latency: the structs agent/probes/sendlat/probe.py reads through this object's BTF. */
#ifndef AIPROBE_SENDLAT_H
#define AIPROBE_SENDLAT_H

#include "vmlinux.h"
#include "common.h"
#include "hist.h"

#define TASK_COMM_LEN 16
#define MAX_PROCS 4096		/* (process, cgroup) pairs counted at once */

/* A process in a cgroup (one cgroup per container): the key of `proc_slots`, whose value is the
 * index of its `procs` entry. */
struct sendlat_proc_key {
	__u32 tgid;
	__u32 pad;
	__u64 cgroup_id;
};

/* Why a send failed: the index into sendlat_proc_stats.errors. agent/probes/sendlat/probe.py labels them with these
 * names (errno names as they are, `other` in lower case) and the values in order, read from BTF. */
enum send_error {
	SEND_ERROR_EAGAIN,	/* also EWOULDBLOCK: the socket buffer is full (back-pressure) */
	SEND_ERROR_EPIPE,
	SEND_ERROR_ECONNRESET,
	SEND_ERROR_EINTR,	/* a signal (also the kernel's ERESTART* codes) */
	SEND_ERROR_ETIMEDOUT,
	SEND_ERROR_ENOTCONN,
	SEND_ERROR_OTHER,
	SEND_ERROR_MAX,
};
BTF_EXPORT_ENUM(send_error);

/* Per-process send statistics, one `procs` array entry per (tgid, cgroup id). */
struct sendlat_proc_stats {
	/* Successful sends (returned > 0 bytes): latency.count (timed: all, or 1 in `sample_every` per
	 * thread) plus untimed_sends. */
	struct hist latency;
	__u64 untimed_sends;
	__u64 bytes;		/* bytes they sent */
	__u64 errors[SEND_ERROR_MAX];	/* failed sends, by error */
	/* When the process started (its leader's start_boottime, /proc/PID/stat's start time in ns): with
	 * the pid, its identity, so user space reads no /proc/PID/stat per process and refresh. */
	__u64 start_boottime_ns;
	char comm[TASK_COMM_LEN];	/* the process (thread-group leader) name */
};

/* One TCP connection as seen by one process. Addresses are 16 bytes; IPv4 uses the first 4. */
struct sendlat_flow_key {
	__u32 tgid;
	__u16 family;		/* AF_INET or AF_INET6 */
	__u16 local_port;	/* host byte order */
	__u16 remote_port;	/* host byte order */
	__u16 pad[3];
	__u8 local_addr[16];
	__u8 remote_addr[16];
};

struct sendlat_flow_stats {
	__u64 count;
	__u64 bytes;
	__u64 sum_ns;		/* of the timed sends */
};

/* A send slower than the threshold, sent through the ring buffer. */
struct slow_send_event {
	struct sendlat_flow_key flow;
	__u32 tid;
	__u32 pad;
	__u64 cgroup_id;
	__u64 bytes;
	__u64 duration_ns;
	char comm[TASK_COMM_LEN];
};

/* Indexes of the `counters` array. */
enum sendlat_counter {
	COUNTER_LOST_EVENTS,	/* slow sends the full ring buffer could not take */
	COUNTER_PROCS_FULL,	/* sends not counted: every `procs` entry was taken */
	COUNTER_THREADS_FULL,	/* sends not counted: the hash of threads (threads_by_tid) was full */
	COUNTER_MAX,
};

#endif
