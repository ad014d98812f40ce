// SPDX-License-Identifier: GPL-2.0
/* Per-flow throughput at tc: ingress (after GRO) and egress (before GSO) on every watched
 * interface, counted as the frames that cross the wire (flows.h). XDP is an opt-in ingress hook
 * for physical NICs (agent/probes/flows/probe.py says why it is not the default). All hooks share one parser and
 * one flow table; the hot path (a known flow) is the slot its sending socket cached (socket_flows), or
 * the one its frames' hash last found (flow_hints), else one hash lookup; then atomic adds. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "common.h"
#include "flows.h"

char LICENSE[] SEC("license") = "GPL";

/* uapi #defines, absent from vmlinux.h */
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8
/* IPv6 extension header numbers (uapi/linux/in6.h) */
#define IPPROTO_HOPOPTS 0
#define IPPROTO_ROUTING 43
#define IPPROTO_FRAGMENT 44
#define IPPROTO_DSTOPTS 60
#define IP_OFFSET 0x1FFF
#define IPV6_FRAG_OFFSET 0xFFF8
#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04

#define MAX_VLAN_TAGS 2
#define VLAN_HLEN 4
#define MAX_IPV6_EXT_HEADERS 6
/* Enough linear bytes for two VLAN tags, IPv6 with extension headers and the ports. */
#define PULL_BYTES 256

enum parse_result {
	PARSE_FLOW,
	PARSE_NOT_IP,
	PARSE_MALFORMED,
	TABLE_FULL, /* parsed, but the flow table had no room: why a frame is unattributed */
};

/* The flow table: each flow's key -> the slot of flow_counts that holds its counters. All three maps
 * are sized by user space (max_flows) before load, the hash preallocated, so a new flow is a freelist
 * pop (without preallocation each insert allocates: about 6x slower per new flow here). Full means
 * inserts fail and are counted; user space expires idle flows and evicts the stalest ones before
 * that happens, giving their slots back through free_slots.
 *
 * Counters sit in an array, not in the hash's values, so that a socket can keep its flow's slot
 * (socket_flows): its egress frames then skip the hash of the 44-byte key and its bucket walk
 * (bench_gateway's nginx load, 10 alternating rounds: flows_egress 280 -> 228 ns per run).
 *
 * One value per flow with atomic adds, not per-CPU values: RSS keeps a flow on one CPU, so the adds
 * are uncontended and cost the same per packet here (3.8x vs 3.9x an empty XDP program), while a
 * per-CPU table makes every read O(flows x possible CPUs) — 115 MB per read for 16k flows on a
 * 128-CPU GPU node. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct flow_key);
	__type(value, __u32);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct flow_counters);
} flow_counts SEC(".maps");

/* Slots user space freed. Slots never used are handed out in order (slots_used) until there are
 * max_flow_slots of them: nothing to fill at start, however large the table. */
struct {
	__uint(type, BPF_MAP_TYPE_STACK);
	__uint(max_entries, 16384);
	__type(value, __u32);
} free_slots SEC(".maps");

/* A lock, not an atomic fetch-and-add: those came with 5.12, and only a new flow's first frame takes it. */
struct slot_allocator {
	struct bpf_spin_lock lock;
	__u32 used;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct slot_allocator);
} slots_used SEC(".maps");

const volatile __u32 max_flow_slots = 16384; /* flow_counts' max_entries, set by user space */

/* Each socket's latest egress flow, as its slot. One word, so a socket sending on several CPUs at
 * once never leaves a torn one; checked against the slot's own key, so a socket whose frames go to
 * several flows (an unconnected UDP socket, a route through another interface) counts each right,
 * through the hash whenever the slot is another flow's. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} socket_flows SEC(".maps");

/* For frames without a sending socket (ingress, forwarded), the latest slot of their skb hash (the
 * NIC's RSS hash; the sender's socket's txhash across a veth), interface and direction: such a frame
 * skips the hash of the 44-byte key, whose bucket and entry are cache misses in a large table
 * (bench_gateway's nginx load, 10 alternating rounds: flows_ingress 262 -> 212 ns per run). A socket's
 * frames look at its storage first: its lines are warm where a hint's are not (egress through hints
 * only read 219 -> 245). A word per entry, checked against the slot's own key as socket_flows is:
 * flows whose hashes collide each count right, through the flow table while they take each other's
 * entry. A fixed 256 KiB, not sized by user space. */
#define FLOW_HINTS 65536

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FLOW_HINTS);
	__type(key, __u32);
	__type(value, __u32);
} flow_hints SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct iface_key);
	__type(value, struct iface_counters);
} unattributed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lost_counters);
} lost SEC(".maps");

/* The flows' clock (flow_clock_ns()) as user space's latest read of the table began (FlowsProbe
 * writes it): what an existing flow's frame stamps as its last_seen. Reading a clock per frame cost
 * about 20 of the ~75 ns an existing flow's frame costs at XDP; a read only asks which flows changed
 * since an earlier read began and which idled out, which this answers at the precision of the read
 * interval. */
volatile __u64 flows_clock SEC(".data.clock") = 0;

struct header_cursor {
	void *start;
	void *pos;
	void *end;
};

/* What the counters need beyond the key: TCP flags, and the length of the headers (L2 to the end of
 * the transport header) that every segment of a GSO/GRO skb carries. */
struct frame_info {
	__u32 header_len;
	__u8 tcp_flags;
};

/* Ports and TCP flags. A transport header cut short is malformed: no flow gets made-up ports. */
static __always_inline int parse_ports(struct header_cursor *c, bool egress, struct flow_key *key,
				       struct frame_info *info)
{
	__u16 src, dst;

	info->header_len = c->pos - c->start;
	if (key->protocol == IPPROTO_TCP) {
		struct tcphdr *tcp = c->pos;

		if ((void *)(tcp + 1) > c->end)
			return PARSE_MALFORMED;
		src = tcp->source;
		dst = tcp->dest;
		info->tcp_flags = ((__u8 *)tcp)[13];
		info->header_len += tcp->doff * 4; /* options included: each segment repeats them */
	} else if (key->protocol == IPPROTO_UDP) {
		struct udphdr *udp = c->pos;

		if ((void *)(udp + 1) > c->end)
			return PARSE_MALFORMED;
		src = udp->source;
		dst = udp->dest;
		info->header_len += sizeof(*udp);
	} else {
		return PARSE_FLOW;
	}
	key->local_port = bpf_ntohs(egress ? src : dst);
	key->remote_port = bpf_ntohs(egress ? dst : src);
	return PARSE_FLOW;
}

static __always_inline int parse_ipv4(struct header_cursor *c, bool egress, struct flow_key *key, struct frame_info *info)
{
	struct iphdr *ip = c->pos;

	if ((void *)(ip + 1) > c->end || ip->version != 4 || ip->ihl < 5)
		return PARSE_MALFORMED;
	key->family = 4;
	key->protocol = ip->protocol;
	__builtin_memcpy(key->local_addr, egress ? &ip->saddr : &ip->daddr, 4);
	__builtin_memcpy(key->remote_addr, egress ? &ip->daddr : &ip->saddr, 4);
	c->pos = (void *)ip + ip->ihl * 4;
	if (ip->frag_off & bpf_htons(IP_OFFSET)) {
		info->header_len = c->pos - c->start;
		return PARSE_FLOW; /* a later fragment: the ports are in the first one */
	}
	return parse_ports(c, egress, key, info);
}

static __always_inline int parse_ipv6(struct header_cursor *c, bool egress, struct flow_key *key, struct frame_info *info)
{
	struct ipv6hdr *ip6 = c->pos;
	__u8 next;

	if ((void *)(ip6 + 1) > c->end || ip6->version != 6)
		return PARSE_MALFORMED;
	key->family = 6;
	__builtin_memcpy(key->local_addr, egress ? &ip6->saddr : &ip6->daddr, 16);
	__builtin_memcpy(key->remote_addr, egress ? &ip6->daddr : &ip6->saddr, 16);
	next = ip6->nexthdr;
	c->pos = ip6 + 1;

	/* Walk the extension headers to the transport header; after MAX_IPV6_EXT_HEADERS the flow
	 * is keyed by the last header number seen, without ports. */
#pragma unroll
	for (int i = 0; i < MAX_IPV6_EXT_HEADERS; i++) {
		struct ipv6_opt_hdr *opt = c->pos;

		if (next != IPPROTO_HOPOPTS && next != IPPROTO_ROUTING && next != IPPROTO_DSTOPTS &&
		    next != IPPROTO_FRAGMENT && next != IPPROTO_AH)
			break;
		if ((void *)(opt + 1) > c->end)
			return PARSE_MALFORMED;
		if (next == IPPROTO_FRAGMENT) {
			struct frag_hdr *frag = c->pos;

			if ((void *)(frag + 1) > c->end)
				return PARSE_MALFORMED;
			next = frag->nexthdr;
			c->pos = frag + 1;
			if (frag->frag_off & bpf_htons(IPV6_FRAG_OFFSET)) {
				key->protocol = next;
				info->header_len = c->pos - c->start;
				return PARSE_FLOW; /* a later fragment: no transport header */
			}
		} else {
			/* AH counts its length in 4-byte units minus 2, the others in 8-byte units minus 1. */
			__u32 len = next == IPPROTO_AH ? (opt->hdrlen + 2) * 4 : (opt->hdrlen + 1) * 8;

			next = opt->nexthdr;
			c->pos += len;
		}
	}
	key->protocol = next;
	return parse_ports(c, egress, key, info);
}

static __always_inline int parse_frame(struct header_cursor *c, bool egress, struct flow_key *key, struct frame_info *info)
{
	struct ethhdr *eth = c->pos;
	__u16 proto;

	if ((void *)(eth + 1) > c->end)
		return PARSE_MALFORMED;
	proto = eth->h_proto;
	c->pos = eth + 1;
#pragma unroll
	for (int i = 0; i < MAX_VLAN_TAGS; i++) {
		struct vlan_hdr *vlan = c->pos;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		if ((void *)(vlan + 1) > c->end)
			return PARSE_MALFORMED;
		proto = vlan->h_vlan_encapsulated_proto;
		c->pos = vlan + 1;
	}
	if (proto == bpf_htons(ETH_P_IP))
		return parse_ipv4(c, egress, key, info);
	if (proto == bpf_htons(ETH_P_IPV6))
		return parse_ipv6(c, egress, key, info);
	return PARSE_NOT_IP;
}

/* What one skb (or XDP frame) puts on the wire: packets and bytes, headers counted per segment. */
struct wire {
	__u64 packets;
	__u64 bytes;
};

/* Cold path: frames no flow can hold still count toward their interface's totals. */
static __noinline void count_unattributed(__u32 ifindex, __u32 direction, struct wire *wire, int why)
{
	struct iface_key key = { .ifindex = ifindex, .direction = direction };
	struct iface_counters *counters = bpf_map_lookup_elem(&unattributed, &key);

	if (!counters) {
		struct iface_counters first = {};

		bpf_map_update_elem(&unattributed, &key, &first, BPF_NOEXIST);
		counters = bpf_map_lookup_elem(&unattributed, &key);
		if (!counters) {
			__u32 zero = 0;
			struct lost_counters *lost_here = bpf_map_lookup_elem(&lost, &zero);

			if (lost_here) {
				lost_here->packets += wire->packets;
				lost_here->bytes += wire->bytes;
			}
			return;
		}
	}
	counters->packets += wire->packets;
	counters->bytes += wire->bytes;
	counters->malformed += why == PARSE_MALFORMED;
	counters->insert_failures += why == TABLE_FULL;
}

static __always_inline void count_tcp_flags(struct flow_counters *counters, __u8 flags)
{
	if (flags & TCP_FLAG_SYN)
		__sync_fetch_and_add(&counters->tcp_syn, 1);
	if (flags & TCP_FLAG_FIN)
		__sync_fetch_and_add(&counters->tcp_fin, 1);
	if (flags & TCP_FLAG_RST)
		__sync_fetch_and_add(&counters->tcp_rst, 1);
}

static __always_inline void add_to_flow(struct flow_counters *counters, struct wire *wire, __u8 tcp_flags,
					struct __sk_buff *skb)
{
	__u64 clock;

	__sync_fetch_and_add(&counters->packets, wire->packets);
	__sync_fetch_and_add(&counters->bytes, wire->bytes);
	/* Read after the adds: user space reads again only flows seen since shortly before its previous
	 * read, so a count must never land later than its last_seen says. Never moved back before the
	 * flow's first_seen (a new flow's clock may be older than its first frame). */
	clock = flows_clock;
	if (counters->last_seen_ns < clock)
		counters->last_seen_ns = clock;
	if (tcp_flags) /* once per skb: segmentation copies SYN/RST to no other segment, FIN to the last */
		count_tcp_flags(counters, tcp_flags);
	if (skb && !counters->cgroup_id)
		counters->cgroup_id = bpf_skb_cgroup_id(skb);
}

/* CLOCK_MONOTONIC_COARSE, or CLOCK_MONOTONIC where the kernel lacks the coarse helper (before 5.11);
 * user space writes flows_clock from the same clock (flow_clock() in agent/probes/flows/probe.py). */
static __always_inline __u64 flow_clock_ns(void)
{
	if (bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_ktime_get_coarse_ns))
		return bpf_ktime_get_coarse_ns();
	return bpf_ktime_get_ns();
}

/* A slot for a new flow: one user space freed, else the next never used. */
static __always_inline bool take_slot(__u32 *index)
{
	__u32 zero = 0, used;
	struct slot_allocator *allocator;

	if (!bpf_map_pop_elem(&free_slots, index))
		return true;
	allocator = bpf_map_lookup_elem(&slots_used, &zero);
	if (!allocator)
		return false;
	bpf_spin_lock(&allocator->lock);
	used = allocator->used;
	if (used < max_flow_slots)
		allocator->used = used + 1;
	bpf_spin_unlock(&allocator->lock);
	*index = used;
	return used < max_flow_slots;
}

/* Cold path: a flow the table lacks gets a zeroed slot and its key is inserted with BPF_NOEXIST; a
 * CPU that lost the race to insert it gives its slot back and takes the winner's, so two CPUs that
 * see a flow's first packets at once both count exactly. The slot gets its key only once the flow is
 * in the table: a cache (a socket's, a hint) never matches a slot given back. False: the table is full. */
static __noinline bool new_flow(struct flow_key *key, __u32 *index)
{
	struct flow_counters *counters;
	__u32 *found;
	__u64 now;

	if (!take_slot(index))
		return false;
	counters = bpf_map_lookup_elem(&flow_counts, index);
	if (!counters)
		return false;
	now = flow_clock_ns();
	*counters = (struct flow_counters){ .first_seen_ns = now, .last_seen_ns = now };
	if (!bpf_map_update_elem(&flows, key, index, BPF_NOEXIST)) {
		counters->key = *key;
		return true;
	}
	bpf_map_push_elem(&free_slots, index, 0);
	found = bpf_map_lookup_elem(&flows, key);
	if (!found)
		return false;
	*index = *found;
	return true;
}

static __always_inline bool same_flow(const struct flow_key *a, const struct flow_key *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;
	__u32 differ = 0;

#pragma unroll
	for (int i = 0; i < sizeof(*a) / sizeof(__u32); i++)
		differ |= x[i] ^ y[i];
	return !differ;
}

/* The counters in a cached slot (a hint's, a socket's) if they are the frame's flow's. */
static __always_inline struct flow_counters *cached_counters(__u32 *cached, struct flow_key *key)
{
	struct flow_counters *counters;

	if (!cached)
		return NULL;
	counters = bpf_map_lookup_elem(&flow_counts, cached);
	return counters && same_flow(&counters->key, key) ? counters : NULL;
}

/* Parsed flow -> counters: through the slot the frame's hint or socket cached (`cached`, NULL where it
 * has neither), else the flow table, which then refills the cache. */
static __always_inline void count_flow(struct flow_key *key, struct wire *wire, __u8 tcp_flags,
				       struct __sk_buff *skb, __u32 *cached)
{
	struct flow_counters *counters = cached_counters(cached, key);
	__u32 *found, index;

	if (!counters) {
		found = bpf_map_lookup_elem(&flows, key);
		if (found)
			index = *found;
		else if (!new_flow(key, &index))
			goto full;
		counters = bpf_map_lookup_elem(&flow_counts, &index);
		if (!counters)
			goto full;
		if (cached)
			*cached = index;
	}
	add_to_flow(counters, wire, tcp_flags, skb);
	return;
full:
	count_unattributed(key->ifindex, key->direction, wire, TABLE_FULL);
}

/* The frame's socket's cache of its flow: NULL where it has no full socket (forwarded frames, a
 * SYN-ACK's request socket, a time-wait socket's) or the socket storage could not be made. */
static __always_inline __u32 *socket_cache(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;

	if (!sk)
		return NULL;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return NULL;
	return bpf_sk_storage_get(&socket_flows, sk, NULL, BPF_SK_STORAGE_GET_F_CREATE);
}

/* The frame's entry of flow_hints: NULL where it has no hash. */
static __always_inline __u32 *hint_of(struct __sk_buff *skb, bool egress)
{
	__u32 hash = skb->hash, index;

	if (!hash)
		return NULL;
	index = (hash ^ (skb->ifindex << 1 | egress)) & (FLOW_HINTS - 1);
	return bpf_map_lookup_elem(&flow_hints, &index);
}

/* The frame's length over all its buffers. Single-buffer frames (every frame before XDP multi-buffer,
 * 5.18) lie between data and data_end. */
static __always_inline __u64 xdp_frame_len(struct xdp_md *ctx, struct header_cursor *c)
{
	if (bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_xdp_get_buff_len))
		return bpf_xdp_get_buff_len(ctx);
	return c->end - c->start;
}

/* User space loads it with BPF_F_XDP_HAS_FRAGS where the kernel has XDP multi-buffer
 * (agent/probes/flows/probe.py): the program accepts multi-buffer frames, so the kernel lets it
 * attach where the MTU exceeds a page (9000, usual on GPU clusters). Not SEC("xdp.frags"), which
 * libbpf loads with that flag on every kernel and one without multi-buffer refuses. Headers are in
 * the first buffer. XDP runs before GRO, so every frame is one wire packet. */
SEC("xdp")
int flows_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	struct header_cursor c = { data, data, (void *)(long)ctx->data_end };
	struct wire wire = { 1, xdp_frame_len(ctx, &c) };
	struct flow_key key = {};
	struct frame_info info = {};
	int parsed = parse_frame(&c, false, &key, &info);

	if (parsed == PARSE_FLOW) {
		key.ifindex = ctx->ingress_ifindex;
		key.direction = FLOW_INGRESS;
		count_flow(&key, &wire, info.tcp_flags, NULL, NULL);
	} else {
		count_unattributed(ctx->ingress_ifindex, FLOW_INGRESS, &wire, parsed);
	}
	return XDP_PASS;
}

static __always_inline int parse_skb(struct __sk_buff *skb, bool egress, struct flow_key *key,
				     struct frame_info *info)
{
	void *data = (void *)(long)skb->data;
	struct header_cursor c = { data, data, (void *)(long)skb->data_end };

	return parse_frame(&c, egress, key, info);
}

/* The segments of a GSO/GRO skb: gso_segs where the stack set it, else derived from gso_size (a
 * virtio/tap "dodgy" GSO skb leaves gso_segs to be computed later); a plain skb is one frame. */
static __always_inline __u32 skb_segments(struct __sk_buff *skb, __u32 header_len)
{
	__u32 gso_size = skb->gso_size, segs = skb->gso_segs;

	if (!gso_size)
		return 1;
	if (!segs && skb->len > header_len)
		segs = (skb->len - header_len + gso_size - 1) / gso_size;
	return segs ? segs : 1;
}

/* tc sees skbs with the Ethernet header in both directions (ingress pushes it back for tc). */
static __always_inline int count_skb(struct __sk_buff *skb, bool egress)
{
	__u32 direction = egress ? FLOW_EGRESS : FLOW_INGRESS;
	struct flow_key key = {};
	struct frame_info info = {};
	struct wire wire;
	__u32 vlan_tag, *cached;
	int parsed = parse_skb(skb, egress, &key, &info);

	/* Headers beyond the linear part are not malformed: pull them in once and look again. */
	if (parsed == PARSE_MALFORMED && skb->len > skb->data_end - skb->data &&
	    !bpf_skb_pull_data(skb, skb->len < PULL_BYTES ? skb->len : PULL_BYTES)) {
		__builtin_memset(&key, 0, sizeof(key));
		__builtin_memset(&info, 0, sizeof(info));
		parsed = parse_skb(skb, egress, &key, &info);
	}
	if (parsed != PARSE_FLOW)
		info.header_len = 0; /* unknown headers: the segments' bytes are the skb's */
	/* A VLAN tag the stack moved out of the frame (ingress untagging, egress tag offload) is on
	 * the wire, in every segment. */
	vlan_tag = skb->vlan_present ? VLAN_HLEN : 0;
	wire.packets = skb_segments(skb, info.header_len);
	wire.bytes = skb->len + vlan_tag + (wire.packets - 1) * (info.header_len + vlan_tag);
	if (parsed == PARSE_FLOW) {
		key.ifindex = skb->ifindex;
		key.direction = direction;
		cached = egress ? socket_cache(skb) : NULL;
		if (!cached)
			cached = hint_of(skb, egress);
		count_flow(&key, &wire, info.tcp_flags, egress ? skb : NULL, cached);
	} else {
		count_unattributed(skb->ifindex, direction, &wire, parsed);
	}
	return TC_ACT_UNSPEC; /* TCX_NEXT / continue: later programs and filters still run */
}

SEC("tc")
int flows_ingress(struct __sk_buff *skb)
{
	return count_skb(skb, false);
}

SEC("tc")
int flows_egress(struct __sk_buff *skb)
{
	return count_skb(skb, true);
}

/* Baselines for benchmarks/bench_flows.py: the same hooks doing nothing. */
SEC("xdp")
int flows_xdp_empty(struct xdp_md *ctx) { return XDP_PASS; }

SEC("tc")
int flows_tc_empty(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
