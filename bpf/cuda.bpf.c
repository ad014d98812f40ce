// SPDX-License-Identifier: GPL-2.0
/* CUDA driver uprobes and the scheduler programs that time GPU-driving threads.
 *
 * Both halves live in one object because they share map `threads`: a thread becomes GPU-driving
 * when a uprobe first sees it, and the scheduler programs only act on threads found there. One
 * object means one map without pinning or fd reuse, loaded and freed together. The scheduler
 * programs come in three flavours (tp_btf, raw_tp, tracepoint); user space loads one of them. */
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

/* Initial value of a new entry: a struct too big for the BPF stack. */
static struct gpu_thread zero_thread;

static __always_inline struct gpu_thread *current_gpu_thread(void)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid;
	struct task_struct *task;
	struct gpu_thread *t;

	t = bpf_map_lookup_elem(&threads, &tid);
	if (t)
		return t;
	bpf_map_update_elem(&threads, &tid, &zero_thread, BPF_NOEXIST);
	t = bpf_map_lookup_elem(&threads, &tid);
	if (!t)
		return NULL; /* map full: the thread stays untracked */
	t->tgid = pid_tgid >> 32;
	task = (struct task_struct *)bpf_get_current_task();
	BPF_CORE_READ_STR_INTO(&t->comm, task, group_leader, comm);
	return t;
}

/* The thread's calls now go to `ctx`. Switching to NULL (no context) and back is no switch. */
static __always_inline void make_current(struct gpu_thread *t, __u64 ctx)
{
	t->current_ctx = ctx;
	if (!ctx)
		return;
	if (t->last_ctx && t->last_ctx != ctx)
		t->context_switches++;
	t->last_ctx = ctx;
}

static __always_inline void pop_context(struct gpu_thread *t)
{
	__u32 depth = t->ctx_depth;

	if (!depth) {
		t->current_ctx = 0;
		return;
	}
	t->ctx_depth = --depth;
	/* Below the remembered stack the context is unknown: NULL, so no switch is guessed. */
	make_current(t, depth < CTX_STACK_DEPTH ? t->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] : 0);
}

/* CUresult cuCtxSetCurrent(CUcontext ctx): replaces the top of the stack; NULL pops it. */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_set_current, void *cuctx)
{
	struct gpu_thread *t = current_gpu_thread();

	if (!t)
		return 0;
	if (cuctx)
		make_current(t, (__u64)cuctx);
	else
		pop_context(t);
	return 0;
}

/* CUresult cuCtxPushCurrent(CUcontext ctx) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_push_current, void *cuctx)
{
	struct gpu_thread *t = current_gpu_thread();
	__u32 depth;

	if (!t)
		return 0;
	depth = t->ctx_depth;
	if (depth < CTX_STACK_DEPTH)
		t->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] = t->current_ctx;
	if (depth < 0xffff)
		t->ctx_depth = depth + 1;
	make_current(t, (__u64)cuctx);
	return 0;
}

/* CUresult cuCtxPopCurrent(CUcontext *pctx) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_pop_current)
{
	struct gpu_thread *t = current_gpu_thread();

	if (t)
		pop_context(t);
	return 0;
}

/* cuLaunchKernel, cuLaunchKernelEx and their _ptsz variants. */
SEC("uprobe")
int BPF_KPROBE(uprobe_launch_kernel)
{
	struct gpu_thread *t = current_gpu_thread();

	if (t)
		t->kernel_launches++;
	return 0;
}

/* cuStreamSynchronize(_ptsz), cuCtxSynchronize: only the outermost call is timed, in case the
 * driver implements one through the other. */
SEC("uprobe")
int BPF_KPROBE(uprobe_sync_enter)
{
	struct gpu_thread *t = current_gpu_thread();

	if (t && t->sync_depth++ == 0)
		t->sync_start_ns = bpf_ktime_get_ns();
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_sync_exit)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct gpu_thread *t = bpf_map_lookup_elem(&threads, &tid);

	if (!t || !t->sync_depth || --t->sync_depth)
		return 0;
	if (t->sync_start_ns)
		hist_add(&t->sync, bpf_ktime_get_ns() - t->sync_start_ns);
	t->sync_start_ns = 0;
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

static __always_inline void on_switch(__u32 prev_pid, bool prev_runnable, __u32 next_pid)
{
	__u64 now = bpf_ktime_get_ns();
	struct gpu_thread *t;

	/* Switched out while runnable: preempted (or yielded); it waits on the run queue again. */
	if (prev_runnable && prev_pid && (t = bpf_map_lookup_elem(&threads, &prev_pid))) {
		t->involuntary_preemptions++;
		t->enqueued_ns = now;
	}
	if (next_pid && (t = bpf_map_lookup_elem(&threads, &next_pid)) && t->enqueued_ns) {
		hist_add(&t->runqueue, now - t->enqueued_ns);
		t->enqueued_ns = 0;
	}
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
