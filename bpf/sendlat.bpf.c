// SPDX-License-Identifier: GPL-2.0
/* TCP send latency: how long each send to a TCP socket takes, per process (tgid, cgroup) as a log2
 * histogram, per flow as counters, and each send slower than a threshold as a ring-buffer event.
 *
 * Four ways to find a send's start and end, one per strategy (agent/sendlat.py), best first:
 *   fentry/fexit on tcp_sendmsg; kprobe/kretprobe on tcp_sendmsg; for kernels with neither, the
 *   first tcp:tcp_sendmsg_locked of a call up to sock:sock_send_length (TCP sends only pay); and for
 *   kernels without that tracepoint, the send syscalls' entry (raw sys_enter, which every syscall on
 *   the host pays for) up to sock:sock_send_length. All four end in record_send(). */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "common.h"
#include "sendlat.h"

char LICENSE[] SEC("license") = "GPL";

#define AF_INET 2
#define AF_INET6 10

/* The syscalls that send on a socket (send(2) is sendto on these ABIs). */
#if defined(__TARGET_ARCH_x86)
#define NR_WRITE 1
#define NR_WRITEV 20
#define NR_SENDTO 44
#define NR_SENDMSG 46
#define NR_SENDMMSG 307
#define SYSCALL_NR(regs) ((regs)->orig_ax)
#elif defined(__TARGET_ARCH_arm64)
#define NR_WRITE 64
#define NR_WRITEV 66
#define NR_SENDTO 206
#define NR_SENDMSG 211
#define NR_SENDMMSG 269
#define SYSCALL_NR(regs) ((regs)->syscallno)
#else
#error "sendlat: add this architecture's send syscall numbers"
#endif

/* Set by user space before load. */
const volatile __u64 slow_threshold_ns = 10 * 1000 * 1000;
const volatile __u32 target_tgid = 0;	/* 0: every process */
/* Per-flow counters cost a 4-tuple read and a hash update per send; the agent, whose flow view comes
 * from the flows probe, turns them off. Slow-send events carry the tuple either way. */
const volatile bool count_flows = true;

/* Where a thread's send in progress started. */
struct sendlat_start {
	__u64 start_ns;
	__u64 sk;		/* the socket (kprobe: for the return probe; tcp tracepoints: 0 once closed) */
	long syscall_nr;	/* syscall strategy: the syscall that started it */
};

/* One entry per thread in a send (fentry/kprobe: deleted on return) or that sent once (tracepoints:
 * closed in place, deleted when the thread exits). LRU: a full map evicts rather than drops. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct sendlat_start);
} starts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 10240);
	__type(key, struct sendlat_proc_key);
	__type(value, struct sendlat_proc_stats);
} procs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct sendlat_flow_key);
	__type(value, struct sendlat_flow_stats);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} slow_sends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

BTF_EXPORT(slow_send_event);

/* Initial values for new map entries (never written). */
static struct sendlat_proc_stats zero_proc;
static struct sendlat_flow_stats zero_flow;

static __always_inline bool traced(__u64 pid_tgid)
{
	return !target_tgid || (pid_tgid >> 32) == target_tgid;
}

static __always_inline void count(enum sendlat_counter index)
{
	__u32 key = index;
	__u64 *value = bpf_map_lookup_elem(&counters, &key);

	if (value)
		__sync_fetch_and_add(value, 1);
}

/* Starts thread `tid`'s send now; `start` is its entry, NULL when it has none yet. */
static __always_inline void open_send(struct sendlat_start *start, __u32 tid, struct sock *sk, long syscall_nr)
{
	struct sendlat_start fresh = { .sk = (__u64)sk, .syscall_nr = syscall_nr };

	/* In place when the thread has an entry: an LRU update would allocate a new element. */
	if (start) {
		start->sk = (__u64)sk;
		start->syscall_nr = syscall_nr;
		start->start_ns = bpf_ktime_get_ns();
		return;
	}
	fresh.start_ns = bpf_ktime_get_ns();
	bpf_map_update_elem(&starts, &tid, &fresh, BPF_ANY);
}

static __always_inline void send_begin(__u64 pid_tgid, struct sock *sk, long syscall_nr)
{
	__u32 tid = pid_tgid;

	open_send(bpf_map_lookup_elem(&starts, &tid), tid, sk, syscall_nr);
}

/* `trusted`: sk is a BTF pointer (tp_btf, fexit) read by plain loads; otherwise (kprobe) every
 * read goes through bpf_probe_read_kernel, several times slower. A constant at each call site,
 * so each program keeps only its own branch. */
#define SK_READ(trusted, sk, field) ((trusted) ? (sk)->field : BPF_CORE_READ(sk, field))
#define SK_COPY(trusted, dst, sk, field, size)						\
	do {										\
		if (trusted)								\
			__builtin_memcpy(dst, &(sk)->field, size);			\
		else									\
			bpf_core_read(dst, size, &(sk)->field);				\
	} while (0)

static __always_inline void read_flow(struct sendlat_flow_key *flow, struct sock *sk, bool trusted, __u32 tgid)
{
	flow->tgid = tgid;
	flow->family = SK_READ(trusted, sk, __sk_common.skc_family);
	flow->local_port = SK_READ(trusted, sk, __sk_common.skc_num);
	flow->remote_port = bpf_ntohs(SK_READ(trusted, sk, __sk_common.skc_dport));
	if (flow->family == AF_INET) {
		SK_COPY(trusted, flow->local_addr, sk, __sk_common.skc_rcv_saddr, 4);
		SK_COPY(trusted, flow->remote_addr, sk, __sk_common.skc_daddr, 4);
	} else {
		SK_COPY(trusted, flow->local_addr, sk, __sk_common.skc_v6_rcv_saddr, 16);
		SK_COPY(trusted, flow->remote_addr, sk, __sk_common.skc_v6_daddr, 16);
	}
}

/* The entry of `key` in a stats map, created from `zero` on first use. */
static __always_inline void *lookup_or_init(void *map, const void *key, const void *zero, bool *created)
{
	void *value = bpf_map_lookup_elem(map, key);

	*created = false;
	if (value)
		return value;
	*created = !bpf_map_update_elem(map, key, zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, key);
}

static __always_inline struct sendlat_proc_stats *proc_stats_of(__u64 pid_tgid)
{
	struct sendlat_proc_key key = { .tgid = pid_tgid >> 32, .cgroup_id = bpf_get_current_cgroup_id() };
	struct sendlat_proc_stats *stats;
	struct task_struct *leader;
	bool created;

	stats = lookup_or_init(&procs, &key, &zero_proc, &created);
	if (stats && created) {
		/* The process name, not the sending thread's: threads often carry their own names. */
		leader = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), group_leader);
		bpf_core_read_str(stats->comm, sizeof(stats->comm), &leader->comm);
	}
	return stats;
}

static __always_inline void emit_slow_send(struct sendlat_flow_key *flow, struct sendlat_proc_stats *stats, __u64 pid_tgid,
					   __u64 bytes, __u64 duration_ns)
{
	struct slow_send_event *event = bpf_ringbuf_reserve(&slow_sends, sizeof(*event), 0);

	if (!event) {
		count(COUNTER_LOST_EVENTS);
		return;
	}
	event->flow = *flow;
	event->tid = (__u32)pid_tgid;
	event->pad = 0;
	event->cgroup_id = bpf_get_current_cgroup_id();
	event->bytes = bytes;
	event->duration_ns = duration_ns;
	__builtin_memcpy(event->comm, stats->comm, sizeof(event->comm));
	bpf_ringbuf_submit(event, 0);
}

/* One send of `ret` bytes (negative: an error) on `sk` that took `duration_ns`. */
static __always_inline void record_send(struct sock *sk, bool trusted, long ret, __u64 duration_ns, __u64 pid_tgid)
{
	__u64 bytes = ret > 0 ? ret : 0;
	struct sendlat_flow_key flow = {};
	struct sendlat_flow_stats *flow_stats;
	struct sendlat_proc_stats *stats;
	bool created;

	stats = proc_stats_of(pid_tgid);
	if (!stats)
		return;
	hist_add(&stats->latency, duration_ns);
	__sync_fetch_and_add(&stats->bytes, bytes);

	if (!count_flows && duration_ns < slow_threshold_ns)
		return;
	read_flow(&flow, sk, trusted, pid_tgid >> 32);
	if (count_flows) {
		flow_stats = lookup_or_init(&flows, &flow, &zero_flow, &created);
		if (flow_stats) {
			__sync_fetch_and_add(&flow_stats->count, 1);
			__sync_fetch_and_add(&flow_stats->bytes, bytes);
			__sync_fetch_and_add(&flow_stats->sum_ns, duration_ns);
		}
	}
	if (duration_ns >= slow_threshold_ns)
		emit_slow_send(&flow, stats, pid_tgid, bytes, duration_ns);
}

/* --- fentry / kprobe: tcp_sendmsg entry to return --- */

/* sk: fexit's own (trusted) argument, or NULL for the one kprobe saved at entry. */
static __always_inline void send_end(struct sock *sk, long ret)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = pid_tgid;
	struct sendlat_start *start = bpf_map_lookup_elem(&starts, &tid);
	__u64 duration_ns;

	if (!start)
		return;
	duration_ns = bpf_ktime_get_ns() - start->start_ns;
	if (sk)
		record_send(sk, true, ret, duration_ns, pid_tgid);
	else
		record_send((struct sock *)start->sk, false, ret, duration_ns, pid_tgid);
	bpf_map_delete_elem(&starts, &tid);
}

SEC("fentry/tcp_sendmsg")
int BPF_PROG(sendlat_fentry, struct sock *sk)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (traced(pid_tgid))
		send_begin(pid_tgid, sk, 0);
	return 0;
}

SEC("fexit/tcp_sendmsg")
int BPF_PROG(sendlat_fexit, struct sock *sk, struct msghdr *msg, size_t size, int ret)
{
	send_end(sk, ret);
	return 0;
}

SEC("kprobe/tcp_sendmsg")
int BPF_KPROBE(sendlat_kprobe, struct sock *sk)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();

	if (traced(pid_tgid))
		send_begin(pid_tgid, sk, 0);
	return 0;
}

SEC("kretprobe/tcp_sendmsg")
int BPF_KRETPROBE(sendlat_kretprobe, int ret)
{
	send_end(NULL, ret);
	return 0;
}

/* --- tracepoints: the first tcp_sendmsg_locked of a call to the end of the socket's sendmsg ---
 *
 * tcp:tcp_sendmsg_locked fires at each turn of tcp_sendmsg_locked's copy loop (once per skb, again
 * after each wait for buffer space), with the socket locked. The first firing for a thread with no
 * send open on that socket opens one; sock:sock_send_length (the socket's sendmsg returned) closes
 * it. The span misses syscall entry, lock_sock() waits and what precedes the copy loop; sends that
 * never reach the loop (0 bytes, errors before copying, TCP Fast Open's SYN data) are not counted.
 *
 * A send opened outside a sendmsg would time the thread's next send from the wrong start. So are
 * skipped: kernel threads (TLS tx work, sockmap backlog) and sockets with an upper-layer protocol
 * (kTLS pushes records in close() and at the end of sendfile; espintcp, MPTCP subflows): those
 * are not measured. What is left ends at the thread's next TCP sendmsg end, recorded only when it
 * is on the open socket (a sockmap redirect opens on the target and ends on the source: dropped);
 * a thread that exits takes its entry with it. */

#define PF_KTHREAD 0x00200000	/* include/linux/sched.h: not in BTF */

static __always_inline bool sends_only_in_sendmsg(struct sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);

	return tp && !tp->inet_conn.icsk_ulp_ops && !(bpf_get_current_task_btf()->flags & PF_KTHREAD);
}

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(sendlat_tcp_send_start, struct sock *sk)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = pid_tgid;
	struct sendlat_start *start;

	if (!traced(pid_tgid))
		return 0;
	start = bpf_map_lookup_elem(&starts, &tid);
	/* A later turn of the copy loop of the send already open. */
	if (start && start->sk == (__u64)sk)
		return 0;
	if (sends_only_in_sendmsg(sk))
		open_send(start, tid, sk, 0);
	return 0;
}

/* At sock:sock_send_length: the sending thread's start entry when `sk` is a TCP socket, else NULL. */
static __always_inline struct sendlat_start *tcp_send_ended(struct sock *sk, __u64 *pid_tgid)
{
	__u32 tid;

	if (sk->sk_protocol != IPPROTO_TCP || sk->sk_type != SOCK_STREAM)
		return NULL;
	*pid_tgid = bpf_get_current_pid_tgid();
	tid = *pid_tgid;
	return bpf_map_lookup_elem(&starts, &tid);
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_tcp_send_end, struct sock *sk, int ret, int flags)
{
	__u64 pid_tgid, open_sk;
	struct sendlat_start *start = tcp_send_ended(sk, &pid_tgid);

	if (!start || !start->sk)
		return 0;
	open_sk = start->sk;
	start->sk = 0;	/* closed either way: a send open on another socket never ends here */
	if (open_sk == (__u64)sk)
		record_send(sk, true, ret, bpf_ktime_get_ns() - start->start_ns, pid_tgid);
	return 0;
}

/* --- syscall: send syscall entry to the end of the socket's sendmsg --- */

static __always_inline bool is_send_syscall(long id)
{
	return id == NR_WRITE || id == NR_WRITEV || id == NR_SENDTO || id == NR_SENDMSG || id == NR_SENDMMSG;
}

SEC("tp_btf/sys_enter")
int BPF_PROG(sendlat_sys_enter, struct pt_regs *regs, long id)
{
	__u64 pid_tgid;

	if (!is_send_syscall(id))
		return 0;
	pid_tgid = bpf_get_current_pid_tgid();
	if (traced(pid_tgid))
		send_begin(pid_tgid, NULL, id);
	return 0;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_sock_send_length, struct sock *sk, int ret, int flags)
{
	__u64 pid_tgid, now;
	struct sendlat_start *start = tcp_send_ended(sk, &pid_tgid);
	struct pt_regs *regs;

	if (!start)
		return 0;
	/* The entry may be left from an earlier syscall (a write to a file never reaches here); a
	 * send from elsewhere (sendfile, io_uring) is not one we timed from its start. */
	regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
	if (SYSCALL_NR(regs) != start->syscall_nr)
		return 0;
	now = bpf_ktime_get_ns();
	record_send(sk, true, ret, now - start->start_ns, pid_tgid);
	/* sendmmsg sends several messages in one syscall: time the next one from here. */
	start->start_ns = now;
	return 0;
}

/* Threads that exit take their start entry with them, so the map tracks live threads only (both
 * tracepoint strategies). */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(sendlat_thread_exit)
{
	__u32 tid = bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&starts, &tid);
	return 0;
}
