// SPDX-License-Identifier: GPL-2.0
/* TCP send latency: per process (tgid, cgroup), the successful sends and their bytes, the failed
 * ones by error, a log-linear histogram of how long sends took and one of how long sockets stayed
 * unwritable (first EAGAIN to the next successful send on the socket); per flow, counters; each send
 * slower than a threshold, as a ring-buffer event.
 *
 * Four ways to find a send's start and end, one per strategy (agent/probes/sendlat/probe.py), best first:
 *   fentry/fexit on tcp_sendmsg; kprobe/kretprobe on tcp_sendmsg; for kernels with neither, the
 *   first tcp:tcp_sendmsg_locked of a call up to sock:sock_send_length (TCP sends only pay); and for
 *   kernels without that tracepoint, the send syscalls' entry (raw sys_enter, which every syscall on
 *   the host pays for) up to sock:sock_send_length. All four end in end_send().
 *
 * Cost: this runs on every TCP send of the host, so the hot path is a few loads and atomics around
 * two clock reads; each program makes three helper calls (the current task, its storage, the clock),
 * where the empty programs of `make bench` make none and its clock-only programs one. On the dev box
 * (AMD, SRSO safe RET: every helper call pays a return thunk) a helper call costs ~20 ns and a clock
 * read ~50 ns, so the two clock reads alone double what the empty programs cost. A thread's state
 * lives in task storage (no hash lookup, freed with the thread; per-CPU state would be cheaper but
 * loses a send that blocks and moves to another CPU, the slow ones); where tracing programs cannot use
 * task storage (before 5.12) it lives in a hash by thread id instead, which sendlat_thread_exit empties
 * as threads exit (`threads_by_tid`). The state caches its process's index
 * into the `procs` array (an array lookup is a bounds check), re-reading its cgroup id only when its
 * css_set changes. Counts are exact; the latency histogram times every send, or 1 in `sample_every`
 * per thread when user space sets it (the per-thread counter makes the sample a fixed fraction of
 * each thread's sends).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "common.h"
#include "hist.h"
#include "sendlat.h"
#include "sk_state.h"
#include "sock.h"
#include "streams_programs.h"	/* the stream logic, called from these programs */
#include "syscalls.h"
#include "task.h"

char LICENSE[] SEC("license") = "GPL";

#define PF_KTHREAD 0x00200000	/* include/linux/sched.h: not in BTF */

/* A thread re-reads its cgroup id (20 ns) when its css_set changes (a move to another cgroup) and
 * once in this many sends besides (a freed css_set's address may come back for another set). */
#define CGROUP_RECHECK_SENDS 256
#define NO_PROC MAX_PROCS

/* Set by user space before load. */
const volatile __u64 slow_threshold_ns = 10 * 1000 * 1000;
const volatile __u32 target_tgid = 0;	/* 0: every process */
/* Per-flow counters cost a 4-tuple read and a hash update per send; the agent, whose flow view comes
 * from the flows probe, turns them off. Slow-send events carry the tuple either way. */
const volatile bool count_flows = true;
/* Where tracing programs cannot use task storage, user space makes `threads` a preallocated hash by
 * thread id (and loads sendlat_thread_exit, which deletes a thread's entry when it exits). */
const volatile bool threads_by_tid = false;

/* Set by user space while running: time 1 send in this many per thread (1: every send). */
__u32 sample_every = 1;

/* What one thread is doing. */
struct sendlat_thread {
	__u64 start_ns;		/* when the timed send in progress started; 0: none */
	__u64 sk;		/* the socket of the send in progress (kprobe: for the return probe;
				 * tcp tracepoints: 0 once it ended) */
	long syscall_nr;	/* syscall strategy: the syscall that started it */
	__u64 cgroup_id;
	__u64 css_set;		/* the task's css_set when cgroup_id was read */
	__u64 plain_prot;	/* tracepoints: sk_prot of a TCP socket found with no upper layer */
	__u32 tgid;
	__u32 proc;		/* index into `procs`; NO_PROC before the first send */
	__u32 recheck_in;	/* sends until the cgroup id is read again */
	__u32 sample_in;	/* sends until the next timed one */
	__u32 unwritable;	/* sockets this thread saw EAGAIN on and not yet a send succeed */
	bool ready;		/* the fields above are set */
	bool ignored;		/* a kernel thread, or not the traced process */
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sendlat_thread);
} threads SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PROCS);
	__type(key, __u32);
	__type(value, struct sendlat_proc_stats);
} procs SEC(".maps");

/* (tgid, cgroup id) -> its index into `procs`. User space frees the entries of exited processes.
 * Preallocated (352 KiB): the kprobe strategy's programs use it, and 5.10-5.19 log a WARNING when a
 * kprobe program uses a hash allocated at run time. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PROCS);
	__type(key, struct sendlat_proc_key);
	__type(value, __u32);
} proc_slots SEC(".maps");

/* The `procs` indexes not in use: user space pushes every one before it attaches (the lowest last), and
 * the zeroed indexes of exited processes after. A stack rather than a counter of the next index: taking
 * from a counter needs a fetch-and-add, an instruction 5.10 refuses. The lowest free index goes first, so
 * the indexes in use stay packed at the start of `procs`, which user space reads by ranges. */
struct {
	__uint(type, BPF_MAP_TYPE_STACK);
	__uint(max_entries, MAX_PROCS);
	__type(value, __u32);
} free_procs SEC(".maps");

/* `procs` index -> how long its sockets stayed unwritable; only processes that saw EAGAIN have one.
 * Allocated at run time (preallocated, 14 MiB): only BTF programs use it, which the WARNING spares. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_PROCS);
	__type(key, __u32);
	__type(value, struct hist);
} unwritable SEC(".maps");

/* Per socket while it is unwritable: since when (its first EAGAIN). */
struct sendlat_socket {
	__u64 unwritable_since_ns;
};

SOCKET_STATE_MAP(sockets, struct sendlat_socket);

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
static struct sendlat_flow_stats zero_flow;
static struct hist zero_hist;
static struct sendlat_thread zero_thread;
static struct sendlat_socket zero_socket;

/* --- the calling thread and its process --- */

/* The calling thread's entry, made on first use: its task storage, or where `threads_by_tid` its
 * entry in the hash, NULL when that is full (counted at a send's end, `ending`: once per send). */
static __always_inline struct sendlat_thread *thread_entry(struct task_struct *task, bool ending)
{
	struct sendlat_thread *thread;
	__u32 tid;

	if (!threads_by_tid)
		return bpf_task_storage_get(&threads, task, NULL, BPF_LOCAL_STORAGE_GET_F_CREATE);
	tid = (__u32)bpf_get_current_pid_tgid();
	thread = lookup_or_init(&threads, &tid, &zero_thread);
	if (!thread && ending)
		counter_inc(&counters, COUNTER_THREADS_FULL);
	return thread;
}

/* The calling thread's state, created on its first send; NULL for threads not measured. */
static __always_inline struct sendlat_thread *current_thread(struct task_struct *task, bool ending)
{
	struct sendlat_thread *thread = thread_entry(task, ending);

	if (!thread)
		return NULL;
	if (!thread->ready) {
		thread->tgid = TASK_READ(task, tgid);
		thread->proc = NO_PROC;
		/* Kernel threads send outside any sendmsg (TLS tx work, sockmap backlog): not measured. */
		thread->ignored = (TASK_READ(task, flags) & PF_KTHREAD) || (target_tgid && thread->tgid != target_tgid);
		thread->ready = true;
	}
	return thread->ignored ? NULL : thread;
}

/* Where `threads` is a hash by thread id: an exiting thread's entry goes with it. */
SEC("raw_tp/sched_process_exit")
int sendlat_thread_exit(void *ctx)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&threads, &tid);
	return 0;
}

/* A new `procs` index for (tgid, cgroup_id), named after the process; NO_PROC when all are taken. */
static __noinline __u32 new_proc(struct sendlat_proc_key *key)
{
	struct sendlat_proc_stats *stats;
	struct task_struct *leader;
	__u32 index, *winner;

	if (bpf_map_pop_elem(&free_procs, &index))
		return NO_PROC;
	stats = bpf_map_lookup_elem(&procs, &index);
	if (!stats)
		return NO_PROC;
	/* The process name, not the sending thread's: threads often carry their own names. */
	leader = BPF_CORE_READ((struct task_struct *)bpf_get_current_task(), group_leader);
	bpf_core_read_str(stats->comm, sizeof(stats->comm), &leader->comm);
	stats->start_boottime_ns = BPF_CORE_READ(leader, start_boottime);
	if (!bpf_map_update_elem(&proc_slots, key, &index, BPF_NOEXIST))
		return index;
	/* Another thread of the process got there first: give the index back, take the winner's. */
	bpf_map_push_elem(&free_procs, &index, 0);
	winner = bpf_map_lookup_elem(&proc_slots, key);
	return winner ? *winner : NO_PROC;
}

static __always_inline __u32 proc_index(__u32 tgid, __u64 cgroup_id)
{
	struct sendlat_proc_key key = { .tgid = tgid, .cgroup_id = cgroup_id };
	__u32 *index = bpf_map_lookup_elem(&proc_slots, &key);

	return index ? *index : new_proc(&key);
}

/* The statistics of the thread's process, in its current cgroup. */
static __always_inline struct sendlat_proc_stats *proc_of(struct sendlat_thread *thread, struct task_struct *task)
{
	__u64 css_set = (__u64)TASK_READ(task, cgroups), cgroup_id;
	__u32 index;

	if (thread->recheck_in && css_set == thread->css_set) {
		thread->recheck_in--;
	} else {
		thread->recheck_in = CGROUP_RECHECK_SENDS - 1;
		thread->css_set = css_set;
		cgroup_id = bpf_get_current_cgroup_id();
		if (cgroup_id != thread->cgroup_id || thread->proc == NO_PROC) {
			thread->cgroup_id = cgroup_id;
			thread->proc = proc_index(thread->tgid, cgroup_id);
		}
	}
	index = thread->proc;
	return bpf_map_lookup_elem(&procs, &index);
}

/* Whether the thread's send starting now is one to time (1 in sample_every). */
static __always_inline bool sampled(struct sendlat_thread *thread)
{
	if (thread->sample_in) {
		thread->sample_in--;
		return false;
	}
	thread->sample_in = sample_every - 1;
	return true;
}

static __always_inline void start_send(struct sendlat_thread *thread)
{
	thread->start_ns = sampled(thread) ? bpf_ktime_get_ns() : 0;
}

/* --- recording the end of a send --- */

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

static __always_inline void emit_slow_send(struct sendlat_flow_key *flow, struct sendlat_thread *thread,
					   struct sendlat_proc_stats *stats, __u64 bytes, __u64 duration_ns)
{
	struct slow_send_event *event = bpf_ringbuf_reserve(&slow_sends, sizeof(*event), 0);

	if (!event) {
		counter_inc(&counters, COUNTER_LOST_EVENTS);
		return;
	}
	event->flow = *flow;
	event->tid = (__u32)bpf_get_current_pid_tgid();
	event->pad = 0;
	event->cgroup_id = thread->cgroup_id;
	event->bytes = bytes;
	event->duration_ns = duration_ns;
	__builtin_memcpy(event->comm, stats->comm, sizeof(event->comm));
	bpf_ringbuf_submit(event, 0);
}

static __always_inline enum send_error send_error_of(long ret)
{
	switch (-ret) {
	case EAGAIN: return SEND_ERROR_EAGAIN;
	case EPIPE: return SEND_ERROR_EPIPE;
	case ECONNRESET: return SEND_ERROR_ECONNRESET;
	case ETIMEDOUT: return SEND_ERROR_ETIMEDOUT;
	case ENOTCONN: return SEND_ERROR_ENOTCONN;
	}
	if (-ret == EINTR || (-ret >= ERESTARTSYS && -ret <= ERESTART_RESTARTBLOCK))
		return SEND_ERROR_EINTR;
	return SEND_ERROR_OTHER;
}

/* `sk`'s state (sk_state.h); where `make`, made if it has none. */
static __always_inline struct sendlat_socket *sendlat_socket_of(struct sock *sk, bool make)
{
	return socket_entry(&sockets, sk, &zero_socket, make);
}

/* Where `sockets` is a hash by socket address: the entry of a socket closed while unwritable goes
 * with it (the address may come back as another socket's). */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(sendlat_socket_close, struct sock *sk, int oldstate, int newstate)
{
	if (newstate == TCP_CLOSE)
		socket_entry_delete(&sockets, sk);
	return 0;
}

/* `sk` is unwritable from now, unless it already was (its entry lives while it is). */
static __always_inline void socket_unwritable(struct sendlat_thread *thread, struct sock *sk)
{
	struct sendlat_socket *socket = sendlat_socket_of(sk, true);

	if (!socket || socket->unwritable_since_ns)
		return;
	socket->unwritable_since_ns = bpf_ktime_get_ns();
	thread->unwritable++;
}

/* A send on `sk` succeeded: if it was unwritable, record for how long. Only threads that found a
 * socket full look (socket storage, 9 ns); a socket closed while unwritable keeps its thread looking. */
static __always_inline void socket_writable(struct sendlat_thread *thread, struct sock *sk)
{
	struct sendlat_socket *socket;
	struct hist *hist;
	__u64 since;

	if (!thread->unwritable)
		return;
	socket = sendlat_socket_of(sk, false);
	if (!socket || !socket->unwritable_since_ns)
		return;
	since = socket->unwritable_since_ns;
	/* Another thread may end the same wait: the one whose delete takes the entry records it (a
	 * compare-and-swap on `since` would do, but 5.10 refuses the instruction). */
	if (socket_entry_delete(&sockets, sk))
		return;
	thread->unwritable--;
	hist = lookup_or_init(&unwritable, &thread->proc, &zero_hist);
	if (hist)
		hist_add(hist, bpf_ktime_get_ns() - since);
}

/* Per-flow counters and the slow-send event of a successful send (the flow key is built only here). */
static __always_inline void record_flow(struct sendlat_thread *thread, struct sendlat_proc_stats *stats,
					struct sock *sk, bool trusted, long ret, __u64 duration_ns, bool slow)
{
	struct sendlat_flow_key flow = {};
	struct sendlat_flow_stats *flow_stats;

	read_flow(&flow, sk, trusted, thread->tgid);
	if (count_flows) {
		flow_stats = lookup_or_init(&flows, &flow, &zero_flow);
		if (flow_stats) {
			__sync_fetch_and_add(&flow_stats->count, 1);
			__sync_fetch_and_add(&flow_stats->bytes, ret);
			__sync_fetch_and_add(&flow_stats->sum_ns, duration_ns);
		}
	}
	if (slow)
		emit_slow_send(&flow, thread, stats, ret, duration_ns);
}

static __always_inline void failed_send(struct sendlat_thread *thread, struct sendlat_proc_stats *stats,
					struct sock *sk, bool trusted, long ret)
{
	enum send_error error = send_error_of(ret);

	if (error < SEND_ERROR_MAX)
		__sync_fetch_and_add(&stats->errors[error], 1);
	/* Socket storage is for BTF programs only; kprobes do without the unwritable time. */
	if (trusted && ret == -EAGAIN)
		socket_unwritable(thread, sk);
}

/* A TCP sendmsg of `thread` on `sk` returned `ret` (bytes, or -errno); `start_ns` is its start
 * when timed, else 0. */
static __always_inline void end_send(struct sendlat_thread *thread, struct task_struct *task, struct sock *sk,
				     bool trusted, long ret, __u64 start_ns)
{
	struct sendlat_proc_stats *stats = proc_of(thread, task);
	__u64 duration_ns = 0, now;
	bool slow;

	if (!stats) {
		counter_inc(&counters, COUNTER_PROCS_FULL);
		return;
	}
	now = start_ns ? bpf_ktime_get_ns() : 0;	/* one clock read for the send's time and its stream's */
	if (trusted)
		stream_send_end(sk, task, ret, start_ns, now, thread->tgid, thread->cgroup_id);
	if (ret <= 0) {
		if (ret)
			failed_send(thread, stats, sk, trusted, ret);
		return;
	}
	/* A timed send is counted by its histogram: one atomic less on the hot path. */
	if (!start_ns)
		__sync_fetch_and_add(&stats->untimed_sends, 1);
	__sync_fetch_and_add(&stats->bytes, ret);
	if (trusted) {
		socket_writable(thread, sk);
		if (left_full(sk))
			socket_unwritable(thread, sk);
	}
	if (start_ns) {
		duration_ns = now - start_ns;
		hist_add(&stats->latency, duration_ns);
	}
	slow = start_ns && duration_ns >= slow_threshold_ns;
	if (count_flows || slow)
		record_flow(thread, stats, sk, trusted, ret, duration_ns, slow);
}

/* --- fentry / kprobe: tcp_sendmsg entry to return --- */

SEC("fentry/tcp_sendmsg")
int BPF_PROG(sendlat_fentry, struct sock *sk, struct msghdr *msg)
{
	struct sendlat_thread *thread = current_thread(current_task(), false);

	if (thread) {
		stream_send_begin(sk, msg);
		start_send(thread);
	}
	return 0;
}

SEC("fexit/tcp_sendmsg")
int BPF_PROG(sendlat_fexit, struct sock *sk, struct msghdr *msg, size_t size, int ret)
{
	struct task_struct *task = current_task();
	struct sendlat_thread *thread = current_thread(task, true);

	if (thread)
		end_send(thread, task, sk, true, ret, thread->start_ns);
	return 0;
}

SEC("kprobe/tcp_sendmsg")
int BPF_KPROBE(sendlat_kprobe, struct sock *sk)
{
	struct sendlat_thread *thread = current_thread(current_task(), false);

	if (thread) {
		thread->sk = (__u64)sk;
		start_send(thread);
	}
	return 0;
}

SEC("kretprobe/tcp_sendmsg")
int BPF_KRETPROBE(sendlat_kretprobe, int ret)
{
	struct task_struct *task = current_task();
	struct sendlat_thread *thread = current_thread(task, true);

	if (thread)
		end_send(thread, task, (struct sock *)thread->sk, false, ret, thread->start_ns);
	return 0;
}

/* --- tracepoints: the first tcp_sendmsg_locked of a call to the end of the socket's sendmsg ---
 *
 * tcp:tcp_sendmsg_locked fires at each turn of tcp_sendmsg_locked's copy loop (once per skb, again
 * after each wait for buffer space), with the socket locked. The first firing for a thread with no
 * send open on that socket opens one; sock:sock_send_length (the socket's sendmsg returned) closes
 * it and counts it. The timed span misses syscall entry, lock_sock() waits and what precedes the
 * copy loop. Every TCP sendmsg return is counted (by its return value); only those that reached the
 * copy loop are timed.
 *
 * A send opened outside a sendmsg would time the thread's next send from the wrong start. So are
 * not timed: kernel threads (not counted either) and sockets with an upper-layer protocol (kTLS
 * pushes records in close() and at the end of sendfile; espintcp, MPTCP subflows). What is left
 * ends at the thread's next TCP sendmsg end, timed only when it is on the open socket (a sockmap
 * redirect opens on the target and ends on the source: not timed). */

/* Whether `sk` has an upper-layer protocol. Reading icsk_ulp_ops takes a helper call (30 ns here;
 * bpf_rdonly_cast would be free, but libbpf 1.1, Debian 12's, cannot leave a kfunc unresolved and 6.1
 * has none). So each thread remembers the protocol ops (sk_prot) of the last socket it found without
 * one: kTLS and espintcp give the socket their own ops when they attach, so a socket on the
 * remembered ops has none. (MPTCP subflows keep TCP's ops, but MPTCP does not send through
 * tcp_sendmsg_locked, and their sends never end here.) */
static __always_inline bool has_upper_layer(struct sendlat_thread *thread, struct sock *sk)
{
	__u64 prot = (__u64)sk->__sk_common.skc_prot;
	struct tcp_sock *tp;

	if (prot == thread->plain_prot)
		return false;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp || tp->inet_conn.icsk_ulp_ops)
		return true;
	thread->plain_prot = prot;
	return false;
}

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(sendlat_tcp_send_start, struct sock *sk, struct msghdr *msg)
{
	struct sendlat_thread *thread = current_thread(current_task(), false);

	/* A later turn of the copy loop of the send already open. */
	if (!thread || thread->sk == (__u64)sk || has_upper_layer(thread, sk))
		return 0;
	thread->sk = (__u64)sk;
	stream_send_begin(sk, msg);
	start_send(thread);
	return 0;
}

static __always_inline bool is_tcp(struct sock *sk)
{
	return sk->sk_protocol == IPPROTO_TCP && sk->sk_type == SOCK_STREAM;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_tcp_send_end, struct sock *sk, int ret, int flags)
{
	struct sendlat_thread *thread;
	struct task_struct *task;
	__u64 start_ns;

	if (!is_tcp(sk) || !(thread = current_thread(task = current_task(), true)))
		return 0;
	start_ns = thread->sk == (__u64)sk ? thread->start_ns : 0;
	thread->sk = 0;	/* closed either way: a send open on another socket never ends here */
	end_send(thread, task, sk, true, ret, start_ns);
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
	struct sendlat_thread *thread;

	if (!is_send_syscall(id) || !(thread = current_thread(current_task(), false)))
		return 0;
	thread->syscall_nr = id;
	start_send(thread);
	return 0;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_sock_send_length, struct sock *sk, int ret, int flags)
{
	struct sendlat_thread *thread;
	struct task_struct *task;
	__u64 start_ns;

	if (!is_tcp(sk) || !(thread = current_thread(task = current_task(), true)))
		return 0;
	/* Timed only from its own syscall's entry: the start may be left from an earlier syscall (a
	 * write to a file never reaches here), and a send from elsewhere (sendfile, io_uring) was
	 * not timed from its start. */
	start_ns = syscall_of(task, NULL) == thread->syscall_nr ? thread->start_ns : 0;
	end_send(thread, task, sk, true, ret, start_ns);
	/* sendmmsg sends several messages in one syscall: time the next one from here. */
	if (start_ns)
		thread->start_ns = bpf_ktime_get_ns();
	return 0;
}

/* --- reference for `make bench`: empty programs on the tracepoint strategy's hooks (and on the
 * receive hook of its streams and requests, for bench_gateway's floor) --- */

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(sendlat_empty_start)
{
	return 0;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_empty_end)
{
	return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(sendlat_empty_recv)
{
	return 0;
}

/* --- reference for `make bench`: the least any exact timing does, one clock read on each hook --- */

__u64 clock_sink;

SEC("tp_btf/tcp_sendmsg_locked")
int BPF_PROG(sendlat_clock_start)
{
	clock_sink = bpf_ktime_get_ns();
	return 0;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(sendlat_clock_end)
{
	clock_sink = bpf_ktime_get_ns() - clock_sink;
	return 0;
}
