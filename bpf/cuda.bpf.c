// SPDX-License-Identifier: GPL-2.0
/* CUDA driver and runtime uprobes and the scheduler programs that time GPU-driving threads.
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
#include "hist.h"
#include "cuda.h"
#include "cuda_sync.h"

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

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_GPU_CONTEXTS);
	__type(key, struct gpu_context_key);
	__type(value, struct gpu_context);
} contexts SEC(".maps");


/* The kernel-launch uprobes' duty cycle (agent/probes/cuda/probe.py, LaunchProbes), written by user space only,
 * in a section of their own. launch_epoch is bumped each time the uprobes are attached again: a
 * runtime launch whose uretprobe was detached while it ran never closed, and its thread's
 * runtime_depth, left from an older attachment, is stale. launch_counting gates the kernel-launch
 * programs, so the counting window is exactly what user space measures, however long attaching
 * and detaching the uprobes take. */
volatile __u32 launch_epoch SEC(".data.launch_duty") = 0;
volatile __u32 launch_counting SEC(".data.launch_duty") = 1;

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
	p->start_ns = BPF_CORE_READ(task, group_leader, start_time);
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

/* ---- contexts ---- */

static __always_inline struct gpu_context *context_entry(__u32 tgid, __u64 ctx, __s32 device)
{
	struct gpu_context_key key = { .tgid = tgid, .ctx = ctx };
	struct gpu_context fresh = { .device = device };

	return lookup_or_init(&contexts, &key, &fresh);
}

/* `ctx` belongs to `device` (seen at its creation or retain). */
static __always_inline void context_on_device(__u32 tgid, __u64 ctx, __s32 device, bool primary)
{
	struct gpu_context *entry = context_entry(tgid, ctx, device);

	if (entry) {
		entry->device = device;
		entry->primary = primary;
	}
}

/* One name per context: a known primary context is PRIMARY_CTX_TAG | device. */
static __always_inline __u64 canonical_context(__u32 tgid, __u64 ctx)
{
	struct gpu_context_key key = { .tgid = tgid, .ctx = ctx };
	struct gpu_context *entry;

	if (!ctx || (ctx & PRIMARY_CTX_TAG))
		return ctx;
	entry = bpf_map_lookup_elem(&contexts, &key);
	return entry && entry->primary ? PRIMARY_CTX_TAG | (__u32)entry->device : ctx;
}

/* The thread's calls now go to `ctx`. Switching to NULL (no context) and back is no change. */
static __always_inline void make_current(struct caller *c, __u64 ctx)
{
	struct gpu_thread *t = c->thread;

	ctx = canonical_context(t->tgid, ctx);
	t->current_ctx = ctx;
	if (!ctx)
		return;
	if (t->last_ctx && t->last_ctx != ctx)
		__sync_fetch_and_add(&c->process->thread_ctx_changes, 1);
	t->last_ctx = ctx;
}

static __always_inline void push_context(struct caller *c, __u64 ctx)
{
	struct gpu_thread *t = c->thread;
	__u32 depth = t->ctx_depth;

	if (depth < CTX_STACK_DEPTH)
		t->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] = t->current_ctx;
	if (depth < 0xffff)
		t->ctx_depth = depth + 1;
	make_current(c, ctx);
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
	/* Below the remembered stack the context is unknown: NULL, so no change is guessed. */
	make_current(c, depth < CTX_STACK_DEPTH ? t->ctx_stack[depth & (CTX_STACK_DEPTH - 1)] : 0);
}

/* Callers whose thread state is needed (context stack, open calls). */
static __always_inline bool current_thread(struct caller *c)
{
	return current_caller(c) && c->thread;
}

/* The calling thread's state, where it has one (it made a probed call before). */
static __always_inline struct gpu_thread *current_thread_entry(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	return bpf_map_lookup_elem(&threads, &tid);
}

/* CUresult cuCtxSetCurrent(CUcontext ctx): replaces the top of the stack; NULL pops it. */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_set_current, void *cuctx)
{
	struct caller c;

	if (!current_thread(&c))
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

	if (current_thread(&c))
		push_context(&c, (__u64)cuctx);
	return 0;
}

/* CUresult cuCtxPopCurrent(CUcontext *pctx) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_pop_current)
{
	struct caller c;

	if (current_thread(&c))
		pop_context(&c);
	return 0;
}

/* CUresult cuCtxDestroy(CUcontext ctx): destroying the caller's current context pops it. */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_destroy, void *cuctx)
{
	struct caller c;

	if (current_thread(&c) && cuctx && (__u64)cuctx == c.thread->current_ctx)
		pop_context(&c);
	return 0;
}

/* ---- timed driver calls (cold start) ---- */

static __always_inline void call_enter(struct gpu_thread *t, __u32 kind)
{
	if (t->call_depth++ == 0) {
		t->call_kind = kind;
		t->call_start_ns = bpf_ktime_get_ns();
	}
}

/* The thread's timed call returns; true when it was the outermost one. */
static __always_inline bool call_exit(struct gpu_thread *t)
{
	struct gpu_process *p;
	__u32 kind = t->call_kind;

	if (!t->call_depth || --t->call_depth)
		return false;
	p = bpf_map_lookup_elem(&processes, &t->tgid);
	if (p && t->call_start_ns && kind < TIMED_CALLS) {
		__sync_fetch_and_add(&p->call_count[kind], 1);
		__sync_fetch_and_add(&p->call_ns[kind], bpf_ktime_get_ns() - t->call_start_ns);
	}
	t->call_start_ns = 0;
	return true;
}

/* CUresult cuInit(unsigned int flags) */
SEC("uprobe")
int BPF_KPROBE(uprobe_init)
{
	struct caller c;

	if (!current_thread(&c))
		return 0;
	if (!c.process->init_ns)
		c.process->init_ns = bpf_ktime_get_ns();
	call_enter(c.thread, CALL_INIT);
	return 0;
}

/* cuModuleLoad*, cuLibraryLoad* */
SEC("uprobe")
int BPF_KPROBE(uprobe_module_load)
{
	struct caller c;

	if (current_thread(&c))
		call_enter(c.thread, CALL_MODULE_LOAD);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_call_exit)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct gpu_thread *t = bpf_map_lookup_elem(&threads, &tid);

	if (t)
		call_exit(t);
	return 0;
}

/* A context is being made: remember where it will be written and for which device. */
static __always_inline void ctx_made_enter(void *pctx, int device, bool pushed)
{
	struct caller c;

	if (!current_thread(&c))
		return;
	call_enter(c.thread, CALL_CTX_CREATE);
	if (c.thread->call_depth == 1) {
		c.thread->pending_pctx = (__u64)pctx;
		c.thread->pending_ctx_device = device;
		c.thread->pending_ctx_pushed = pushed;
	}
}

/* CUresult cuCtxCreate(_v2)(CUcontext *pctx, unsigned int flags, CUdevice dev) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_create_v2, void *pctx, unsigned int flags, int dev)
{
	ctx_made_enter(pctx, dev, true);
	return 0;
}

/* CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n, unsigned int flags,
 * CUdevice dev) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_create_v3, void *pctx, void *params, int n, unsigned int flags, int dev)
{
	ctx_made_enter(pctx, dev, true);
	return 0;
}

/* CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev) */
SEC("uprobe")
int BPF_KPROBE(uprobe_ctx_create_v4, void *pctx, void *params, unsigned int flags, int dev)
{
	ctx_made_enter(pctx, dev, true);
	return 0;
}

/* CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev): not made current. */
SEC("uprobe")
int BPF_KPROBE(uprobe_primary_ctx_retain, void *pctx, int dev)
{
	ctx_made_enter(pctx, dev, false);
	return 0;
}

/* The context now exists (if the call succeeded): its device is known, a created one is current. */
SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_ctx_made, long rc)
{
	struct caller c;
	struct gpu_thread *t;
	__u64 made = 0;

	if (!current_thread(&c) || !call_exit(c.thread))
		return 0;
	t = c.thread;
	if ((int)rc != 0 || !t->pending_pctx ||
	    bpf_probe_read_user(&made, sizeof(made), (void *)t->pending_pctx) || !made)
		goto done;
	context_on_device(t->tgid, made, t->pending_ctx_device, !t->pending_ctx_pushed);
	if (t->pending_ctx_pushed)
		push_context(&c, made);
done:
	t->pending_pctx = 0;
	return 0;
}

/* ---- allocations: failures by CUresult, and which of them were retried ---- */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);	/* preallocated: uprobes must not allocate (5.10-5.19 warn) */
	__uint(max_entries, MAX_ALLOC_FAILURES);
	__type(key, struct alloc_failure_key);
	__type(value, struct alloc_failure);
} alloc_failures SEC(".maps");

/* User space deletes entries long past the window (agent/probes/cuda/probe.py). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_ALLOC_PENDING);
	__type(key, struct alloc_pending_key);
	__type(value, struct alloc_pending);
} alloc_pending SEC(".maps");

static __always_inline void alloc_enter(__u64 size)
{
	struct caller c;

	if (current_thread(&c) && c.thread->alloc_depth++ == 0)
		c.thread->alloc_size = size;
}

/* CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize), cuMemAllocAsync(.., size_t bytesize,
 * CUstream), cuMemAllocManaged(.., size_t bytesize, unsigned int flags), cuMemCreate(
 * CUmemGenericAllocationHandle *handle, size_t size, ..): the size is the second argument of each. */
SEC("uprobe")
int BPF_KPROBE(uprobe_mem_alloc, void *out, __u64 size)
{
	alloc_enter(size);
	return 0;
}

/* CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
 * unsigned int ElementSizeBytes): asks for width x height bytes (the pitch may pad them). */
SEC("uprobe")
int BPF_KPROBE(uprobe_mem_alloc_pitch, void *out, void *pitch, __u64 width, __u64 height)
{
	alloc_enter(width * height);
	return 0;
}

/* A failure of `size`: counted, and waiting for a retry of the same size (a run of failures of one
 * size waits as one, from its last failure). The entry comes before the count, so a read that sees
 * the count sees what waits too. */
static __always_inline void alloc_failed(__u32 tgid, __u64 size, __u32 error, __u64 now)
{
	struct alloc_pending_key pending_key = { .tgid = tgid, .size = size };
	struct alloc_failure_key key = { .tgid = tgid, .error = error };
	struct alloc_failure zero = {}, *failure;
	struct alloc_pending fresh = { .failures = 1, .last_ns = now, .error = error }, *pending;

	pending = bpf_map_lookup_elem(&alloc_pending, &pending_key);
	if (pending && now - pending->last_ns <= ALLOC_RETRY_WINDOW_NS) {
		__sync_fetch_and_add(&pending->failures, 1);
		pending->last_ns = now;
		pending->error = error;
	} else {
		bpf_map_update_elem(&alloc_pending, &pending_key, &fresh, BPF_ANY);
	}
	failure = lookup_or_init(&alloc_failures, &key, &zero);
	if (!failure)
		return;	/* map full: the failure goes uncounted */
	__sync_fetch_and_add(&failure->failures, 1);
	__sync_fetch_and_add(&failure->bytes, size);
}

/* A success of `size`: the failures of that size within the window before it were retried. */
static __always_inline void alloc_succeeded(__u32 tgid, __u64 size, __u64 now)
{
	struct alloc_pending_key pending_key = { .tgid = tgid, .size = size };
	struct alloc_pending *pending = bpf_map_lookup_elem(&alloc_pending, &pending_key);
	struct alloc_failure_key key = { .tgid = tgid };
	struct alloc_failure *failure;

	if (!pending)
		return;
	key.error = pending->error;
	failure = now - pending->last_ns <= ALLOC_RETRY_WINDOW_NS ? bpf_map_lookup_elem(&alloc_failures, &key) : NULL;
	if (failure)
		__sync_fetch_and_add(&failure->retried, pending->failures);
	bpf_map_delete_elem(&alloc_pending, &pending_key);
}

/* An allocation returns its CUresult. */
SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_mem_alloc, long rc)
{
	struct gpu_thread *t = current_thread_entry();
	struct gpu_process *p;
	__u64 now;

	if (!t || !t->alloc_depth || --t->alloc_depth)
		return 0;
	p = bpf_map_lookup_elem(&processes, &t->tgid);
	if (p)
		__sync_fetch_and_add(&p->alloc_calls, 1);
	now = bpf_ktime_get_ns();
	if ((int)rc)
		alloc_failed(t->tgid, t->alloc_size, (__u32)rc, now);
	else
		alloc_succeeded(t->tgid, t->alloc_size, now);
	return 0;
}

/* ---- launches ---- */

/* The context the thread launches into. A runtime thread that never chose a device uses device 0's
 * primary context, as libcudart does. */
static __always_inline __u64 launch_context(struct caller *c, bool runtime)
{
	if (!c->thread)
		return 0;
	if (runtime && !c->thread->current_ctx)
		make_current(c, PRIMARY_CTX_TAG);
	return c->thread->current_ctx;
}

/* One launch, counted once: at the runtime's entry point when the call came through libcudart
 * (a driver entry point inside it is the same launch), else at the driver's. */
static __always_inline void count_launch(bool graph, bool runtime)
{
	struct gpu_context *context;
	struct gpu_process *p;
	struct caller c;
	__u64 ctx;

	if (!current_caller(&c))
		return;
	if (c.thread && c.thread->runtime_epoch != launch_epoch) {
		c.thread->runtime_epoch = launch_epoch;
		c.thread->runtime_depth = 0;
	}
	if (c.thread && c.thread->runtime_depth) { /* inside a runtime call that counted it */
		if (runtime)
			c.thread->runtime_depth++; /* its uretprobe pairs with this */
		return;
	}
	p = c.process;
	__sync_fetch_and_add(graph ? &p->graph_launches : &p->kernel_launches, 1);
	if (runtime)
		__sync_fetch_and_add(&p->runtime_launches, 1);
	if (!p->first_launch_ns)
		p->first_launch_ns = bpf_ktime_get_ns();
	ctx = launch_context(&c, runtime);
	context = context_entry((__u32)(bpf_get_current_pid_tgid() >> 32), ctx,
				ctx & PRIMARY_CTX_TAG ? (__s32)(ctx & 0xffff) : UNKNOWN_DEVICE);
	if (context)
		__sync_fetch_and_add(graph ? &context->graph_launches : &context->kernel_launches, 1);
	if (runtime && c.thread)
		c.thread->runtime_depth++;
}

/* cuLaunchKernel(_ptsz), cuLaunchKernelEx(_ptsz), cuLaunchCooperativeKernel(_ptsz) */
SEC("uprobe")
int BPF_KPROBE(uprobe_launch_kernel)
{
	if (launch_counting)
		count_launch(false, false);
	return 0;
}

/* cuGraphLaunch(_ptsz) */
SEC("uprobe")
int BPF_KPROBE(uprobe_graph_launch)
{
	count_launch(true, false);
	return 0;
}

/* cudaLaunchKernel(_ptsz), cudaLaunchKernelExC(_ptsz), cudaLaunchCooperativeKernel(_ptsz) */
SEC("uprobe")
int BPF_KPROBE(uprobe_runtime_launch_kernel)
{
	if (launch_counting)
		count_launch(false, true);
	return 0;
}

/* cudaGraphLaunch(_ptsz) */
SEC("uprobe")
int BPF_KPROBE(uprobe_runtime_graph_launch)
{
	count_launch(true, true);
	return 0;
}

/* A runtime launch (or cudaSetDevice) returns. */
SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_runtime_exit)
{
	struct gpu_thread *t = current_thread_entry();

	if (t && t->runtime_depth)
		t->runtime_depth--;
	return 0;
}

/* cudaError_t cudaSetDevice(int device): the device's primary context becomes the thread's. */
SEC("uprobe")
int BPF_KPROBE(uprobe_runtime_set_device, int device)
{
	struct caller c;

	if (!current_thread(&c))
		return 0;
	c.thread->pending_device = device;
	c.thread->runtime_depth++;
	return 0;
}

/* Applied on return, so a failed call changes nothing. */
SEC("uretprobe")
int BPF_KRETPROBE(uretprobe_runtime_set_device, long rc)
{
	struct caller c;
	__s32 device;

	if (!current_thread(&c))
		return 0;
	if (c.thread->runtime_depth)
		c.thread->runtime_depth--;
	device = c.thread->pending_device;
	if ((int)rc != 0 || device < 0)
		return 0;
	context_on_device(c.thread->tgid, PRIMARY_CTX_TAG | (__u32)device, device, true);
	make_current(&c, PRIMARY_CTX_TAG | (__u32)device);
	return 0;
}

/* ---- synchronizations: only the outermost call is timed, in case one is implemented through
 * another (cuCtxSynchronize through cuStreamSynchronize, the runtime's through the driver's) ---- */

/* Map `cuda_sync_time` keeps the union of each process's synchronizations, for streams: a thread
 * moving in or out must know whether it is the first in or the last out. Where the kernel has
 * atomic fetch instructions (5.12), the count's fetch-and-add tells it. Kernels without them
 * reject any program that holds one, even where it cannot run, so every program that moves a
 * thread in or out comes twice (SYNC_PROGRAMS): the `_locked` ones read and change the count under
 * a lock of the process instead, and user space loads one set (agent/probes/cuda/probe.py). */

/* A process's lock is held while its entry exists: of the threads creating it, one succeeds. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);	/* preallocated: uprobes must not allocate (5.10-5.19 warn) */
	__uint(max_entries, CUDA_SYNC_PROCESSES);	/* held by one running program per CPU at most */
	__type(key, __u32);	/* host tgid */
	__type(value, __u8);
} sync_locks SEC(".maps");

/* The holder runs a few instructions with preemption off, so a waiter spins briefly. Only a holder
 * interrupted for longer makes it give up: its thread's move then leaves the union shorter. */
#define SYNC_LOCK_TRIES 256

static __always_inline bool sync_lock(__u32 tgid)
{
	__u8 held = 1;

	for (int i = 0; i < SYNC_LOCK_TRIES; i++)
		if (!bpf_map_update_elem(&sync_locks, &tgid, &held, BPF_NOEXIST))
			return true;
	return false;
}

/* A thread of `tgid` enters its outermost synchronization: the process is inside one from now on,
 * unless another of its threads already was. */
static __always_inline void process_sync_enter(__u32 tgid, __u64 now, bool locked)
{
	struct cuda_sync_time fresh = {}, *sync = lookup_or_init(&cuda_sync_time, &tgid, &fresh);
	bool held;

	if (!sync)
		return;	/* map full: the process's syncs are not seen by streams */
	if (!locked) {
		if (__sync_fetch_and_add(&sync->inside, 1) == 0)
			sync->since_ns = now;
		return;
	}
	/* The count changes atomically either way, so it stays exact; a thread that could not take
	 * the lock leaves since_ns alone (its own time may go uncounted). */
	held = sync_lock(tgid);
	if (held && !sync->inside)
		sync->since_ns = now;
	__sync_fetch_and_add(&sync->inside, 1);
	if (held)
		bpf_map_delete_elem(&sync_locks, &tgid);
}

/* The last one out closes the interval, adding it to the total. */
static __always_inline void close_sync_interval(struct cuda_sync_time *sync, __u64 now)
{
	__u64 since = sync->since_ns;

	sync->since_ns = 0;
	if (since && since < now)
		__sync_fetch_and_add(&sync->total_ns, now - since);
}

/* ... and leaves it (returned, or the thread exited inside it). With fetch atomics, a thread
 * entering between the count's drop and the read of since_ns shortens that one interval. */
static __always_inline void process_sync_exit(__u32 tgid, __u64 now, bool locked)
{
	struct cuda_sync_time *sync = bpf_map_lookup_elem(&cuda_sync_time, &tgid);
	bool held;

	if (!sync || !sync->inside)
		return;
	if (!locked) {
		if (__sync_fetch_and_add(&sync->inside, -1) == 1)
			close_sync_interval(sync, now);
		return;
	}
	held = sync_lock(tgid);
	if (held && sync->inside == 1)
		close_sync_interval(sync, now);
	__sync_fetch_and_add(&sync->inside, -1);	/* not held: an interval it ends goes uncounted */
	if (held)
		bpf_map_delete_elem(&sync_locks, &tgid);
}

static __always_inline int sync_enter(__u32 kind, bool locked)
{
	struct caller c;

	if (current_thread(&c) && c.thread->sync_depth++ == 0) {
		c.thread->sync_kind = kind;
		c.thread->sync_start_ns = bpf_ktime_get_ns();
		process_sync_enter(c.thread->tgid, c.thread->sync_start_ns, locked);
	}
	return 0;
}

static __always_inline int sync_exit(bool locked)
{
	struct gpu_thread *t = current_thread_entry();
	struct gpu_process *p;
	__u32 kind;
	__u64 ns, now;

	if (!t || !t->sync_depth || --t->sync_depth)
		return 0;
	now = bpf_ktime_get_ns();
	process_sync_exit(t->tgid, now, locked);
	p = bpf_map_lookup_elem(&processes, &t->tgid);
	kind = t->sync_kind;
	if (p && t->sync_start_ns && kind < SYNC_KINDS) {
		ns = now - t->sync_start_ns;
		hist_add(&p->sync, ns);
		__sync_fetch_and_add(&p->sync_count[kind], 1);
		__sync_fetch_and_add(&p->sync_ns[kind], ns);
	}
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

/* These run on every wakeup and context switch of the host: the thread lookup comes first, and
 * the clock is read only for a GPU-driving thread. */
static __always_inline struct gpu_thread *gpu_thread_of(__u32 pid)
{
	return pid ? bpf_map_lookup_elem(&threads, &pid) : NULL;
}

/* Runnable -> waiting on a run queue from now. */
static __always_inline void on_wakeup(__u32 pid)
{
	struct gpu_thread *t = gpu_thread_of(pid);

	if (t)
		t->enqueued_ns = bpf_ktime_get_ns();
}

static __always_inline struct gpu_process *process_of(struct gpu_thread *t)
{
	return bpf_map_lookup_elem(&processes, &t->tgid);
}

/* A GPU-driving thread switched out while runnable: preempted (or yielded); it waits on the run
 * queue again. */
static __always_inline void on_preempted(struct gpu_thread *t)
{
	struct gpu_process *p = process_of(t);

	if (p)
		__sync_fetch_and_add(&p->involuntary_preemptions, 1);
	t->enqueued_ns = bpf_ktime_get_ns();
}

static __always_inline void on_switched_in(__u32 pid)
{
	struct gpu_thread *t = gpu_thread_of(pid);
	struct gpu_process *p;

	if (!t || !t->enqueued_ns)
		return;
	if ((p = process_of(t)))
		hist_add(&p->runqueue, bpf_ktime_get_ns() - t->enqueued_ns);
	t->enqueued_ns = 0;
}

/* sched_process_exit fires in every exiting task: a GPU-driving thread's state goes with it (its
 * counts live in its process's entry), so `threads` holds live threads only. */
static __always_inline int on_exit(bool locked)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct gpu_thread *t = bpf_map_lookup_elem(&threads, &tid);

	if (!t)
		return 0;
	if (t->sync_depth)	/* exits inside a synchronization: its process is out of it */
		process_sync_exit(t->tgid, bpf_ktime_get_ns(), locked);
	bpf_map_delete_elem(&threads, &tid);
	return 0;
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
	struct gpu_thread *t = gpu_thread_of(BPF_CORE_READ(prev, pid));

	if (t && task_runnable(prev))
		on_preempted(t);
	on_switched_in(BPF_CORE_READ(next, pid));
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
	struct gpu_thread *t = gpu_thread_of(ctx->prev_pid);

	if (t && (ctx->prev_state & TP_SLEEP_STATES) == 0)
		on_preempted(t);
	on_switched_in(ctx->next_pid);
	return 0;
}

/* The programs that move a thread into or out of its process's synchronizations, with atomic fetch
 * instructions and as NAME_locked without (see process_sync_enter):
 * - uprobe_sync_stream: cuStreamSynchronize(_ptsz), cudaStreamSynchronize(_ptsz)
 * - uprobe_sync_device: cuCtxSynchronize, cudaDeviceSynchronize
 * - uprobe_sync_event: cuEventSynchronize, cudaEventSynchronize
 * - uretprobe_sync_exit: their returns
 * - *_sched_process_exit: a thread exiting, in the scheduler side's three flavours */
#define SYNC_PROGRAMS(suffix, locked)								\
SEC("uprobe") int BPF_KPROBE(uprobe_sync_stream##suffix) { return sync_enter(SYNC_STREAM, locked); }	\
SEC("uprobe") int BPF_KPROBE(uprobe_sync_device##suffix) { return sync_enter(SYNC_DEVICE, locked); }	\
SEC("uprobe") int BPF_KPROBE(uprobe_sync_event##suffix) { return sync_enter(SYNC_EVENT, locked); }	\
SEC("uretprobe") int BPF_KRETPROBE(uretprobe_sync_exit##suffix) { return sync_exit(locked); }		\
SEC("tp_btf/sched_process_exit") int BPF_PROG(tp_btf_sched_process_exit##suffix) { return on_exit(locked); } \
SEC("raw_tp/sched_process_exit") int BPF_PROG(raw_tp_sched_process_exit##suffix) { return on_exit(locked); } \
SEC("tracepoint/sched/sched_process_exit") int tracepoint_sched_process_exit##suffix(void *ctx)	\
{											\
	return on_exit(locked);								\
}

SYNC_PROGRAMS(, false)
SYNC_PROGRAMS(_locked, true)
