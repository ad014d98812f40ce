/* SPDX-License-Identifier: GPL-2.0 */
#ifndef AIPROBE_FEATURES_H
#define AIPROBE_FEATURES_H

#include "vmlinux.h"

/* Sent through the ring buffer by the uprobe feature program (the loader's own tests read it). */
struct feature_event {
	__u32 pid;
	__u32 tid;
	__u64 hits;
};

#endif
