/* SPDX-License-Identifier: GPL-2.0 */
#ifndef AIPROBE_CUDA_H
#define AIPROBE_CUDA_H

#include "vmlinux.h"
#include "hist.h"

/* Live threads that called into libcuda or libcudart ("GPU-driving threads"), tracked at once. An
 * entry goes when its thread exits, so this bounds concurrent threads, not threads ever seen. */
#define MAX_GPU_THREADS 4096
/* Processes with counts, live or exited but not yet reported (user space deletes an exited
 * process's entry once a read has reported its final values). */
#define MAX_GPU_PROCESSES 2048
/* Contexts with launch counts (LRU: a context not launched on for long makes room). */
#define MAX_GPU_CONTEXTS 8192
/* Processes' allocation failures by error, and failures waiting for a retry of their size. */
#define MAX_ALLOC_FAILURES 8192
#define MAX_ALLOC_PENDING 8192
/* A failure followed by a success of the same size this soon, in the same process, was retried. */
#define ALLOC_RETRY_WINDOW_NS 1000000000ULL
/* Contexts remembered below the current one (cuCtxPushCurrent); deeper pushes are counted only. */
#define CTX_STACK_DEPTH 8

/* A device's primary context is known as PRIMARY_CTX_TAG | device, whichever way a thread made it
 * current: cudaSetDevice (its CUcontext value unseen when libcudart reaches the driver through
 * cuGetProcAddress pointers that are not probed), or cuCtxSetCurrent of a value that
 * cuDevicePrimaryCtxRetain returned. User-space pointers never have bit 63 set. */
#define PRIMARY_CTX_TAG (1ULL << 63)
#define UNKNOWN_DEVICE (-1)

enum sync_kind { SYNC_STREAM, SYNC_DEVICE, SYNC_EVENT, SYNC_KINDS };

/* Driver calls timed for the cold-start breakdown (outermost call only). */
enum timed_call { CALL_INIT, CALL_CTX_CREATE, CALL_MODULE_LOAD, TIMED_CALLS };

/* What one GPU-driving thread is in the middle of, keyed by its host tid in map `threads`: the
 * thread's CUDA context stack, open calls, when it became runnable. No counts live here, so
 * deleting the entry when the thread exits loses nothing. */
struct gpu_thread {
	__u32 tgid;
	__u32 ctx_depth;		/* contexts pushed below the current one */
	__u64 current_ctx;		/* CUcontext on top of the thread's stack, 0 when none */
	__u64 last_ctx;			/* last non-NULL current context: a change is a change of it */
	__u64 ctx_stack[CTX_STACK_DEPTH];
	__u32 sync_depth;		/* nested synchronize calls in flight (outermost is timed) */
	__u32 sync_kind;		/* enum sync_kind of the outermost */
	__u64 sync_start_ns;
	__u64 enqueued_ns;		/* when it last became runnable; 0 while on a CPU */
	__u32 runtime_depth;		/* libcudart launches / cudaSetDevice in flight: a driver launch
					 * inside one is the same launch, already counted */
	__s32 pending_device;		/* cudaSetDevice's argument until it returns */
	__u32 runtime_epoch;		/* launch_epoch when runtime_depth was last valid */
	__u32 call_depth;		/* nested timed driver calls in flight (outermost is timed) */
	__u32 call_kind;		/* enum timed_call of the outermost */
	__u64 call_start_ns;
	__u64 pending_pctx;		/* CUcontext * of a cuCtxCreate / cuDevicePrimaryCtxRetain in flight */
	__s32 pending_ctx_device;
	__u32 pending_ctx_pushed;	/* 1: the new context becomes current (cuCtxCreate pushes it) */
	__u32 alloc_depth;		/* nested allocation calls in flight (the outermost is judged) */
	__u64 alloc_size;		/* bytes the outermost asked for */
};

/* Cumulative counts of one process, keyed by its host tgid in map `processes`. Every thread adds
 * here directly (atomically), so a process's totals only grow, whichever of its threads exit.
 * Folding a thread's own counts in when it exits would be an add plus a delete, and a read between
 * the two would see the thread twice or not at all: a counter going back, which Prometheus takes
 * for a reset. */
struct gpu_process {
	__u64 gpu_threads;		/* threads ever seen calling into libcuda / libcudart */
	__u64 thread_ctx_changes;	/* a thread's current context became a different one */
	__u64 kernel_launches;		/* cuLaunch* / cudaLaunch*, each call once */
	__u64 graph_launches;		/* cuGraphLaunch / cudaGraphLaunch */
	__u64 runtime_launches;		/* of both, those counted at libcudart's entry points */
	__u64 involuntary_preemptions;	/* GPU-driving threads switched out while still runnable */
	__u64 sync_count[SYNC_KINDS];
	__u64 sync_ns[SYNC_KINDS];
	struct hist sync;		/* every synchronize's duration */
	struct hist runqueue;		/* GPU-driving threads: runnable -> on CPU */
	/* Cold start, CLOCK_MONOTONIC ns (0: not seen). */
	__u64 start_ns;			/* the process started (its task's start_time) */
	__u64 init_ns;			/* first cuInit entered */
	__u64 first_launch_ns;		/* first kernel or graph launch */
	__u64 call_count[TIMED_CALLS];
	__u64 call_ns[TIMED_CALLS];
	__u64 alloc_calls;		/* allocation calls returned (the CPU budget charges their probes) */
	char comm[16];			/* the process's (group leader's) name */
};

/* A context, per process (a CUcontext value is an address in its process). */
struct gpu_context_key {
	__u32 tgid;
	__u32 _pad;
	__u64 ctx;			/* CUcontext, PRIMARY_CTX_TAG | device, or 0: not known */
};

struct gpu_context {
	__s32 device;			/* CUdevice ordinal in its process; UNKNOWN_DEVICE if created unseen */
	__u32 primary;			/* 1: a device's primary context (threads use it as PRIMARY_CTX_TAG | device) */
	__u64 kernel_launches;
	__u64 graph_launches;
};

/* A process's failed allocations with one CUresult (map `alloc_failures`). */
struct alloc_failure_key {
	__u32 tgid;
	__u32 error;			/* CUresult */
};

struct alloc_failure {
	__u64 failures;			/* calls that returned `error` */
	__u64 bytes;			/* bytes they asked for */
	__u64 retried;			/* of them, followed by a success of the same size within the window */
};

/* Failures of one size in one process waiting for a retry (map `alloc_pending`). */
struct alloc_pending_key {
	__u32 tgid;
	__u32 _pad;
	__u64 size;
};

struct alloc_pending {
	__u64 failures;			/* since the first of this run of failures */
	__u64 last_ns;			/* the last of them */
	__u32 error;			/* its CUresult: a retry is counted under it */
	__u32 _pad;
};

#endif /* AIPROBE_CUDA_H */
