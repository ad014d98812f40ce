/* SPDX-License-Identifier: GPL-2.0 */
/* Syscalls, per architecture: the numbers of those that send on or read a socket, where a syscall's
 * number and arguments are in its saved registers, the errno values they return, and where a read's
 * bytes landed in user memory. */
#ifndef AIPROBE_SYSCALLS_H
#define AIPROBE_SYSCALLS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "task.h"

/* errno values (uapi asm-generic/errno*.h) and the kernel-internal restart codes (linux/errno.h). */
#define EINTR 4
#define EAGAIN 11
#define EPIPE 32
#define ECONNRESET 104
#define ENOTCONN 107
#define ETIMEDOUT 110
#define ERESTARTSYS 512
#define ERESTART_RESTARTBLOCK 516

/* send(2) is sendto, recv(2) recvfrom on these ABIs. */
#if defined(__TARGET_ARCH_x86)
#define NR_READ 0
#define NR_WRITE 1
#define NR_READV 19
#define NR_WRITEV 20
#define NR_SENDTO 44
#define NR_RECVFROM 45
#define NR_SENDMSG 46
#define NR_RECVMSG 47
#define NR_SENDMMSG 307
#define SYSCALL_NR_REG orig_ax
#define SYSCALL_ARG2_REG si
#elif defined(__TARGET_ARCH_arm64)
#define NR_READ 63
#define NR_WRITE 64
#define NR_READV 65
#define NR_WRITEV 66
#define NR_SENDTO 206
#define NR_RECVFROM 207
#define NR_SENDMSG 211
#define NR_RECVMSG 212
#define NR_SENDMMSG 269
#define SYSCALL_NR_REG syscallno
#define SYSCALL_ARG2_REG regs[1]
#else
#error "syscalls.h: add this architecture's syscall numbers"
#endif

/* Where the bytes a read syscall just returned start in user memory; 0 when unknown. */
/* The number of the syscall `task` is in, and its second argument (`arg2`, where not NULL), from the
 * user registers it entered with. */
static __always_inline long syscall_of(struct task_struct *task, __u64 *arg2)
{
	struct pt_regs *regs;

	if (TASK_PT_REGS) {
		regs = (struct pt_regs *)bpf_task_pt_regs(task);
		if (arg2)
			*arg2 = regs->SYSCALL_ARG2_REG;
		return regs->SYSCALL_NR_REG;
	}
	regs = stack_user_regs(task);
	if (arg2)
		*arg2 = BPF_CORE_READ(regs, SYSCALL_ARG2_REG);
	return BPF_CORE_READ(regs, SYSCALL_NR_REG);
}

static __always_inline __u64 received_buffer(void)
{
	__u64 arg = 0, iov = 0, base = 0;
	long nr = syscall_of(current_task(), &arg);
	struct user_msghdr msg;

	if (nr == NR_READ || nr == NR_RECVFROM)
		return arg;
	if (nr == NR_RECVMSG && !bpf_probe_read_user(&msg, sizeof(msg), (void *)arg))
		iov = (__u64)msg.msg_iov;
	else if (nr == NR_READV)
		iov = arg;
	if (iov)
		bpf_probe_read_user(&base, sizeof(base), (void *)iov);	/* iov_base of the first iovec */
	return base;
}

#endif /* AIPROBE_SYSCALLS_H */
