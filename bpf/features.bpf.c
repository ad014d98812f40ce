// SPDX-License-Identifier: GPL-2.0
/* One tiny program per kernel feature. `aiprobe check` loads and attaches each one alone, so the
 * capability matrix comes from real attempts rather than from kernel versions. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "common.h"
#include "features.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} hits SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} events SEC(".maps");

BTF_EXPORT(feature_event);

/* Read-only config, set by user space before load (tests exercise .rodata through it). */
const volatile __u64 hit_increment = 1;

static __always_inline __u64 hit(void)
{
	__u32 zero = 0;
	__u64 *count = bpf_map_lookup_elem(&hits, &zero);

	if (!count)
		return 0;
	/* A plain atomic add, its result unused: a fetching atomic (5.12+) fails the whole object on
	 * 5.10. The read after it sees this hit (and perhaps another CPU's). */
	__sync_fetch_and_add(count, hit_increment);
	return *count;
}

SEC("fentry/tcp_sendmsg")
int BPF_PROG(probe_fentry) { hit(); return 0; }

/* A trampoline on the connections probe's function: Debian's kernels give tcp_v4_syn_recv_sock a
 * seventh argument, more than x86 trampolines took before 6.6. */
SEC("fexit/tcp_v4_syn_recv_sock")
int BPF_PROG(probe_syn_recv_fexit) { hit(); return 0; }

SEC("kprobe/tcp_sendmsg")
int BPF_KPROBE(probe_kprobe) { hit(); return 0; }

SEC("tp_btf/sched_switch")
int BPF_PROG(probe_tp_btf) { hit(); return 0; }

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(probe_tcp_send_tp) { hit(); return 0; }

/* sock:sock_send_length came with sock:sock_recv_length (6.3): one probe answers for both. */
SEC("tp_btf/sock_send_length")
int BPF_PROG(probe_sock_length_tp) { hit(); return 0; }

SEC("raw_tp/sched_switch")
int probe_raw_tp(void *ctx) { hit(); return 0; }

/* Socket storage from a BTF program (5.11): where sendlat's stream logic and its unwritable time keep
 * their per-socket state. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} sockets SEC(".maps");

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(probe_sk_storage_tracing, struct sock *sk)
{
	if (bpf_sk_storage_get(&sockets, sk, NULL, 0))
		hit();
	return 0;
}

SEC("tracepoint/sched/sched_switch")
int probe_tracepoint(void *ctx) { hit(); return 0; }

SEC("uprobe")
int BPF_KPROBE(probe_uprobe)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct feature_event *event = bpf_ringbuf_reserve(&events, sizeof(*event), 0);

	if (!event)
		return 0;
	event->pid = pid_tgid >> 32;
	event->tid = (__u32)pid_tgid;
	event->hits = hit();
	bpf_ringbuf_submit(event, 0);
	return 0;
}

SEC("xdp")
int probe_xdp(struct xdp_md *ctx) { hit(); return XDP_PASS; }

SEC("tc")
int probe_tc(struct __sk_buff *skb) { hit(); return TC_ACT_UNSPEC; }
