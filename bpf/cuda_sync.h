/* SPDX-License-Identifier: GPL-2.0 */
/* Per process, the time its threads spent inside CUDA synchronizations: written by the cuda probe's
 * synchronize uprobes (bpf/cuda.bpf.c), read by the stream logic (bpf/streams_programs.h, in sendlat's object)
 * to tell a stall spent waiting for the GPU. Both objects declare map `cuda_sync_time` from here; the
 * loader makes the second one loaded reuse the first one's map (agent/loader.py, SHARED_MAPS), so
 * either may load first and each runs alone with a map of its own. */
#ifndef AIPROBE_CUDA_SYNC_H
#define AIPROBE_CUDA_SYNC_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#define CUDA_SYNC_PROCESSES 2048	/* as MAX_GPU_PROCESSES: user space deletes exited processes' entries */

/* The union of the process's threads' synchronizations: time during which at least one was inside.
 * `inside` counts the threads inside now; the interval it opened (0 -> 1) started at `since_ns`, and
 * is added to `total_ns` when it closes (1 -> 0). How a thread knows it opened or closed one:
 * bpf/cuda.bpf.c, process_sync_enter. */
struct cuda_sync_time {
	__u64 total_ns;
	__u64 since_ns;		/* 0: no thread inside */
	__u32 inside;
	__u32 pad;
};

/* Preallocated: the cuda probe's uprobes write it, and a kprobe, uprobe or tracepoint program using a
 * hash that allocates makes kernels 5.10-5.19 warn (a run-time allocation in a trace program). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CUDA_SYNC_PROCESSES);
	__type(key, __u32);	/* host tgid */
	__type(value, struct cuda_sync_time);
} cuda_sync_time SEC(".maps");

/* Time the process `tgid` has spent inside synchronizations until `now`, the open interval included. */
static __always_inline __u64 cuda_sync_ns(__u32 tgid, __u64 now)
{
	struct cuda_sync_time *sync = bpf_map_lookup_elem(&cuda_sync_time, &tgid);
	__u64 since;

	if (!sync)
		return 0;
	since = sync->since_ns;
	return sync->total_ns + (sync->inside && since && since < now ? now - since : 0);
}

#endif /* AIPROBE_CUDA_SYNC_H */
