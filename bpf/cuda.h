/* SPDX-License-Identifier: GPL-2.0 */
#ifndef AIPROBE_CUDA_H
#define AIPROBE_CUDA_H

#include "common.h"

/* Live threads that called into libcuda ("GPU-driving threads"), tracked at once. An entry goes
 * when its thread exits, so this bounds concurrent threads, not threads ever seen. */
#define MAX_GPU_THREADS 4096
/* Processes with counts, live or exited but not yet reported (user space deletes an exited
 * process's entry once a read has reported its final values). */
#define MAX_GPU_PROCESSES 2048
/* Contexts remembered below the current one (cuCtxPushCurrent); deeper pushes are counted only. */
#define CTX_STACK_DEPTH 8

/* What one GPU-driving thread is in the middle of, keyed by its host tid in map `threads`: the
 * thread's CUDA context stack, an open synchronize, when it became runnable. No counts live here,
 * so deleting the entry when the thread exits loses nothing. */
struct gpu_thread {
	__u32 tgid;
	__u32 ctx_depth;		/* contexts pushed below the current one */
	__u64 current_ctx;		/* CUcontext on top of the thread's stack, 0 when none */
	__u64 last_ctx;			/* last non-NULL current context: a switch is a change of it */
	__u64 ctx_stack[CTX_STACK_DEPTH];
	__u32 sync_depth;		/* nested synchronize calls in flight (outermost is timed) */
	__u32 _pad;
	__u64 sync_start_ns;
	__u64 enqueued_ns;		/* when it last became runnable; 0 while on a CPU */
};

/* Cumulative counts of one process, keyed by its host tgid in map `processes`. Every thread adds
 * here directly (atomically), so a process's totals only grow, whichever of its threads exit.
 * Folding a thread's own counts in when it exits would be an add plus a delete, and a read between
 * the two would see the thread twice or not at all: a counter going back, which Prometheus takes
 * for a reset. */
struct gpu_process {
	__u64 gpu_threads;		/* threads ever seen calling into libcuda */
	__u64 context_switches;
	__u64 kernel_launches;
	__u64 involuntary_preemptions;	/* GPU-driving threads switched out while still runnable */
	struct hist sync;		/* cuStreamSynchronize / cuCtxSynchronize durations */
	struct hist runqueue;		/* GPU-driving threads: runnable -> on CPU */
	char comm[16];			/* the process's (group leader's) name */
};

#endif /* AIPROBE_CUDA_H */
