/* SPDX-License-Identifier: GPL-2.0 */
#ifndef AIPROBE_CUDA_H
#define AIPROBE_CUDA_H

#include "common.h"

/* Threads that ever called into libcuda ("GPU-driving threads"), tracked at once. */
#define MAX_GPU_THREADS 4096
/* Contexts remembered below the current one (cuCtxPushCurrent); deeper pushes are counted only. */
#define CTX_STACK_DEPTH 8

/* One GPU-driving thread, keyed by its host tid in map `threads`. The uprobes write the CUDA
 * fields from the thread itself; the scheduler programs write the run-queue fields. User space
 * sums threads into processes by `tgid`. */
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
	__u64 context_switches;
	__u64 kernel_launches;
	__u64 involuntary_preemptions;	/* switched out while still runnable */
	struct hist sync;		/* cuStreamSynchronize / cuCtxSynchronize durations */
	struct hist runqueue;		/* runnable -> on CPU */
	char comm[16];			/* the process's (group leader's) name */
};

#endif /* AIPROBE_CUDA_H */
