/* SPDX-License-Identifier: GPL-2.0 */
/* TCP send latency: the structs agent/sendlat.py reads through this object's BTF. */
#ifndef AIPROBE_SENDLAT_H
#define AIPROBE_SENDLAT_H

#define TASK_COMM_LEN 16

/* Per-process send statistics, keyed by (tgid, cgroup id): one cgroup per container. */
struct sendlat_proc_key {
	__u32 tgid;
	__u32 pad;
	__u64 cgroup_id;
};

struct sendlat_proc_stats {
	struct hist latency;	/* count and sum_ns of sends live here */
	__u64 bytes;
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
	__u64 sum_ns;
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
	COUNTER_MAX,
};

#endif
