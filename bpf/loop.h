/* SPDX-License-Identifier: GPL-2.0 */
/* Loops whose turns the verifier should not walk one by one: bpf_loop (5.17), or, in an object built
 * with -DBOUNDED_LOOPS for kernels without it, a bounded loop it walks turn by turn (5.3+). A kernel
 * without bpf_loop rejects the whole object that holds a call to it (its callback is a BPF_PSEUDO_FUNC
 * load, refused even in dead code), so the choice is per object: the Makefile builds both, user space
 * opens the one the kernel's helpers allow (agent/probes/sendlat/loops.py). */
#ifndef AIPROBE_LOOP_H
#define AIPROBE_LOOP_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#ifdef BOUNDED_LOOPS
/* `bpf_loop` bound, bounded-loop bound: the verifier walks every turn of the bounded object's loops
 * (each with what it calls), so some walk fewer turns there. */
#define LOOP_BOUND(looped, bounded) (bounded)
/* Up to `turns` calls of `callback(turn, ctx)` (a `long` function), until one returns nonzero. */
#define LOOP(turns, callback, ctx)					\
	({								\
		for (__u32 __turn = 0; __turn < (turns); __turn++)	\
			if (callback(__turn, ctx))			\
				break;					\
	})
#else
#define LOOP_BOUND(looped, bounded) (looped)
#define LOOP(turns, callback, ctx) bpf_loop(turns, callback, ctx, 0)
#endif

#endif /* AIPROBE_LOOP_H */
