/* SPDX-License-Identifier: GPL-2.0 */
/* The current task and its user registers, on kernels with and without the BTF helpers for them
 * (bpf_get_current_task_btf 5.11, bpf_task_pt_regs 5.15). Each choice is a CO-RE constant, so the
 * verifier never visits the branch the kernel cannot run (an unknown helper there is no error). */
#ifndef AIPROBE_TASK_H
#define AIPROBE_TASK_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

/* Whether the current task is a BTF pointer, read by plain loads, rather than an address read
 * through bpf_probe_read_kernel. */
#define TASK_BTF bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_get_current_task_btf)
#define TASK_READ(task, field) (TASK_BTF ? (task)->field : BPF_CORE_READ(task, field))

/* Where the kernel stack ends (arch/x86/include/asm/page_64_types.h, arch/arm64/include/asm/memory.h:
 * 16 KiB on both, without KASAN); the user registers are saved at its top. Read only where
 * bpf_task_pt_regs is missing (before 5.15), whose x86-64 kernels put no padding above them. */
#define KERNEL_STACK_SIZE 16384

/* Each program takes the current task once and passes it on, as a helper call costs more than its
 * work where returns go through a mitigation thunk (SRSO safe RET: the AMD dev box). */
static __always_inline struct task_struct *current_task(void)
{
	return TASK_BTF ? bpf_get_current_task_btf() : (struct task_struct *)bpf_get_current_task();
}

/* Whether bpf_task_pt_regs gives the user registers as a BTF pointer; else stack_user_regs(). */
#define TASK_PT_REGS bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_task_pt_regs)

/* Where `task` saved the user registers it entered the kernel with: an address to read through
 * bpf_probe_read_kernel (BPF_CORE_READ), as task_pt_regs() finds it. */
static __always_inline struct pt_regs *stack_user_regs(struct task_struct *task)
{
	return (struct pt_regs *)((__u64)TASK_READ(task, stack) + KERNEL_STACK_SIZE) - 1;
}

#endif /* AIPROBE_TASK_H */
