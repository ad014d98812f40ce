// SPDX-License-Identifier: GPL-2.0
/* CUDA driver uprobes and the scheduler programs that time GPU-driving threads.
 *
 * Both halves live in one object because they share maps `threads` (what each live GPU-driving
 * thread is doing) and `processes` (cumulative counts per process): a thread becomes GPU-driving
 * when a uprobe first sees it, the scheduler programs only act on threads found there, and
 * sched_process_exit removes a thread's entry. One object means shared maps without pinning or fd
 * reuse, loaded and freed together. The scheduler programs come in three flavours (tp_btf, raw_tp,
 * tracepoint); user space loads one of them. */
#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "common.h"
#include "cuda.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_GPU_THREADS);
	__type(key, __u32);
	__type(value, struct gpu_thread);
} threads SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_GPU_PROCESSES);
	__type(key, __u32);
	__type(value, struct gpu_process);
} processes SEC(".maps");

/* Initial values of new entries (a gpu_process is too big for the BPF stack). */
static struct gpu_thread zero_thread;
static struct gpu_process zero_process;

/* The calling thread: its state and its process's counts. */
struct caller {
	struct gpu_thread *thread;
	struct gpu_process *process;
};

static __always_inline struct gpu_process *process_entry(__u32 tgid)
{
	struct gpu_process *p = bpf_map_lookup_elem(&processes, &tgid);
	struct task_struct *task;

	if (p)
		return p;
	bpf_map_update_elem(&processes, &tgid, &zero_process, BPF_NOEXIST);
	p = bpf_map_lookup_elem(&processes, &tgid);
	if (!p)
		return NULL; /* map full: the process stays untracked */
	task = (struct task_struct *)bpf_get_current_task();
	BPF_CORE_READ_STR_INTO(&p->comm, task, group_leader, comm);
	return p;
}

/* Finds the caller's process entry and its own (both made on first use). false: the process is
 * untracked (map `processes` full). c->thread is NULL while map `threads` is full: the process's
 * launches still count, what needs the thread's state (context, open sync) does not. */
static __always_inline bool current_caller(struct caller *c)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid, tgid = pid_tgid >> 32;

	c->process = process_entry(tgid);
	if (!c->process)
		return false;
	c->thread = bpf_map_lookup_elem(&threads, &tid);
	if (c->thread)
		return true;
	bpf_map_update_elem(&threads, &tid, &zero_thread, BPF_NOEXIST);
	c->thread = bpf_map_lookup_elem(&threads, &tid);
	if (c->thread) {
		c->thread->tgid = tgid;
		__sync_fetch_and_add(&c->process->gpu_threads, 1);
	}
	return true;
}

/* The thread's calls now go to `ctx`. Switching to NULL (no context) and back is no switch. */
static __always_inline void make_current(struct caller *c, __u64 ctx)
{
	struct gpu_thread *t = c->thread;

	t->current_ctx = ctx;
	if (!ctx)
		return;
	if (t->last_ctx && t->last_ctx != ctx)
		__sync_fetch_and_add(&c->process->context_switches, 1);
	t->last_ctx = ctx;
}

static __always_inline void pop_context(struct caller *c)
{
	struct gpu_thread *t = c->thread;
	__u32 depth = t->ctx_depth;

	if (!depth) {
		t->current_ctx = 0;
		return;
	}
	t->ctx_depth = --depth;
	/* Below the remembered stack the context is unknown: NULL, so no switch is guessed. */
	make_current(c, depth < CTX_STACK_DEPTH ? t->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] : 0);
}

/* CUresult cuCtxSetCurrent(CUcontext ctx): replaces the top of the stack; NULL pops it. */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_set_current, void *cuctx)
{
	struct caller c;

	if (!current_caller(&c) || !c.thread)
		return 0;
	if (cuctx)
		make_current(&c, (__u64)cuctx);
	else
		pop_context(&c);
	return 0;
}

/* CUresult cuCtxPushCurrent(CUcontext ctx) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_push_current, void *cuctx)
{
	struct caller c;
	__u32 depth;

	if (!current_caller(&c) || !c.thread)
		return 0;
	depth = c.thread->ctx_depth;
	if (depth < CTX_STACK_DEPTH)
		c.thread->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] = c.thread->current_ctx;
	if (depth < 0xffff)
		c.thread->ctx_depth = depth + 1;
	make_current(&c, (__u64)cuctx);
	return 0;
}

/* CUresult cuCtxPopCurrent(CUcontext *pctx) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_pop_current)
{
	struct caller c;

	if (current_caller(&c) && c.thread)
		pop_context(&c);
	return 0;
}

/* cuLaunchKernel, cuLaunchKernelEx and their _ptsz variants. */
SEC("uprobe")
int BPF_KPROBE(uprobe_launch_kernel)
{
	struct caller c;

	if (current_caller(&c))
		__sync_fetch_and_add(&c.process->kernel_launches, 1);
	return 0;
}

/* cuStreamSynchronize(_ptsz), cuCtxSynchronize: only the outermost call is timed, in case the
 * driver implements one through the other. */
SEC("uprobe")
int BPF_KPROBE(uprobe_sync_enter)
{
	struct caller c;

	if (current_caller(&c) && c.thread && c.thread->sync_depth++ == 0)
		c.thread->sync_start_ns = bpf_ktime_get_ns();
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_sync_exit)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct gpu_thread *t = bpf_map_lookup_elem(&threads, &tid);
	struct gpu_process *p;

	if (!t || !t->sync_depth || --t->sync_depth)
		return 0;
	p = bpf_map_lookup_elem(&processes, &t->tgid);
	if (p && t->sync_start_ns)
		hist_add(&p->sync, bpf_ktime_get_ns() - t->sync_start_ns);
	t->sync_start_ns = 0;
	return 0;
}

/* Benchmark baseline (benchmarks/bench_cuda.py): the same uprobe trap, no work at all. */
SEC("uprobe")
int uprobe_empty(void *ctx)
{
	return 0;
}

/* ---- scheduler side: run-queue delay and involuntary preemptions of GPU-driving threads ---- */

/* Runnable -> waiting on a run queue from now. */
static __always_inline void on_wakeup(__u32 pid)
{
	struct gpu_thread *t = bpf_map_lookup_elem(&threads, &pid);

	if (t)
		t->enqueued_ns = bpf_ktime_get_ns();
}

static __always_inline struct gpu_process *process_of(struct gpu_thread *t)
{
	return bpf_map_lookup_elem(&processes, &t->tgid);
}

static __always_inline void on_switch(__u32 prev_pid, bool prev_runnable, __u32 next_pid)
{
	__u64 now = bpf_ktime_get_ns();
	struct gpu_process *p;
	struct gpu_thread *t;

	/* Switched out while runnable: preempted (or yielded); it waits on the run queue again. */
	if (prev_runnable && prev_pid && (t = bpf_map_lookup_elem(&threads, &prev_pid))) {
		if ((p = process_of(t)))
			__sync_fetch_and_add(&p->involuntary_preemptions, 1);
		t->enqueued_ns = now;
	}
	if (next_pid && (t = bpf_map_lookup_elem(&threads, &next_pid)) && t->enqueued_ns) {
		if ((p = process_of(t)))
			hist_add(&p->runqueue, now - t->enqueued_ns);
		t->enqueued_ns = 0;
	}
}

/* sched_process_exit fires in every exiting task: a GPU-driving thread's state goes with it (its
 * counts live in its process's entry), so `threads` holds live threads only. */
static __always_inline void on_exit(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&threads, &tid);
}

/* Kernels before 5.14 call task_struct::__state `state`. */
struct task_struct___pre514 {
	long state;
} __attribute__((preserve_access_index));

static __always_inline bool task_runnable(struct task_struct *task)
{
	if (bpf_core_field_exists(task->__state))
		return BPF_CORE_READ(task, __state) == 0;
	return BPF_CORE_READ((struct task_struct___pre514 *)task, state) == 0;
}

static __always_inline void switch_tasks(struct task_struct *prev, struct task_struct *next)
{
	on_switch(BPF_CORE_READ(prev, pid), task_runnable(prev), BPF_CORE_READ(next, pid));
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(tp_btf_sched_wakeup, struct task_struct *task)
{
	on_wakeup(BPF_CORE_READ(task, pid));
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(tp_btf_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	switch_tasks(prev, next);
	return 0;
}

SEC("raw_tp/sched_wakeup")
int BPF_PROG(raw_tp_sched_wakeup, struct task_struct *task)
{
	on_wakeup(BPF_CORE_READ(task, pid));
	return 0;
}

SEC("raw_tp/sched_switch")
int BPF_PROG(raw_tp_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	switch_tasks(prev, next);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(tp_btf_sched_process_exit)
{
	on_exit();
	return 0;
}

SEC("raw_tp/sched_process_exit")
int BPF_PROG(raw_tp_sched_process_exit)
{
	on_exit();
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int tracepoint_sched_process_exit(void *ctx)
{
	on_exit();
	return 0;
}

SEC("tracepoint/sched/sched_wakeup")
int tracepoint_sched_wakeup(struct trace_event_raw_sched_wakeup_template *ctx)
{
	on_wakeup(ctx->pid);
	return 0;
}

/* The tracepoint reports a preempted task as TASK_REPORT_MAX (0x100 and up) and a runnable one
 * as 0; the low byte holds the sleeping states. */
#define TP_SLEEP_STATES 0xff

SEC("tracepoint/sched/sched_switch")
int tracepoint_sched_switch(struct trace_event_raw_sched_switch *ctx)
{
	on_switch(ctx->prev_pid, (ctx->prev_state & TP_SLEEP_STATES) == 0, ctx->next_pid);
	return 0;
}
