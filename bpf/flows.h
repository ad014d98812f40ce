/* SPDX-License-Identifier: GPL-2.0 */
#ifndef AIPROBE_FLOWS_H
#define AIPROBE_FLOWS_H

#include "vmlinux.h"
#include "common.h"

/* flow_key.direction: ingress is counted at tc ingress (or XDP where opted in), egress at tc egress.
 * agent/flows.py reads the names from BTF: the label values, in lower case without the prefix. */
enum flow_direction {
	FLOW_INGRESS = 0,
	FLOW_EGRESS = 1,
};
BTF_EXPORT_ENUM(flow_direction);

/* One flow per interface and direction. "local" is this host's side: the destination of an
 * ingress frame, the source of an egress one. IPv4 addresses fill the first 4 bytes of the
 * 16-byte fields. Ports are host byte order, 0 where the protocol has none (or for non-first
 * fragments). Every byte is an explicit field: the key is hashed whole, padding included. */
struct flow_key {
	__u32 ifindex;
	__u8 direction;
	__u8 family; /* 4 or 6 */
	__u8 protocol; /* IPPROTO_* of the transport header */
	__u8 pad;
	__u16 local_port;
	__u16 remote_port;
	__u8 local_addr[16];
	__u8 remote_addr[16];
};

/* One per flow, updated with atomic adds; first_seen / last_seen are CLOCK_MONOTONIC (coarse; precise
 * where the kernel lacks bpf_ktime_get_coarse_ns, before 5.11):
 * first_seen the flow's first frame, last_seen no earlier than the start of the table read before its
 * latest frame (flows_clock), nor than its first_seen.
 * Counts are what crosses the wire: a GSO/GRO skb (one skb, many segments) counts as its gso_segs
 * packets, and each segment carries its own copy of the headers the parser read (Ethernet, VLAN,
 * IP, TCP/UDP), so bytes = skb->len + (segments - 1) * header length. Without the FCS, preamble and
 * inter-frame gap, as every interface counter. Tunnelled GSO (VXLAN, GRE) adds the outer headers
 * per segment only: the inner ones are not parsed. */
struct flow_counters {
	__u64 packets; /* wire frames (TCP/UDP segments), not skbs */
	__u64 bytes; /* their L2 frame lengths (Ethernet header included, FCS not) */
	__u64 first_seen_ns;
	__u64 last_seen_ns;
	__u64 cgroup_id; /* egress only: the sending socket's cgroup v2 id, 0 if none */
	__u32 tcp_syn;
	__u32 tcp_fin;
	__u32 tcp_rst;
	__u32 pad;
	/* Whose counters these are (their slot in flow_counts is found by this key in flows): a slot cached
	 * by a socket or a hint counts a frame only where this is the frame's key. Zeroed (family 0: no
	 * frame's) while the slot is free. */
	struct flow_key key;
};

/* Per interface and direction: frames that are in no flow, so interface totals stay exact. */
struct iface_key {
	__u32 ifindex;
	__u32 direction;
};

struct iface_counters {
	__u64 packets; /* wire frames in no flow: not IP, malformed, or the flow table was full */
	__u64 bytes; /* their L2 lengths, as flow_counters.bytes */
	__u64 malformed; /* truncated or inconsistent headers */
	__u64 insert_failures; /* a new flow found the flow table full */
};

/* Frames counted nowhere: the unattributed table itself was full (more interfaces and directions
 * than it holds). Non-zero means the interface totals are short by these. */
struct lost_counters {
	__u64 packets;
	__u64 bytes;
};

#endif
