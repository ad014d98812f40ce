/* SPDX-License-Identifier: GPL-2.0 */
/* TLS: a write that starts with a TLS record is encrypted, from the handshake on. */
#ifndef AIPROBE_TLS_H
#define AIPROBE_TLS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

#define TLS_HANDSHAKE 0x16
#define TLS_APPLICATION_DATA 0x17

/* The header of a TLS record (its content type, then major version 3): a handshake or application data. */
static __always_inline bool is_tls_record(const char *bytes, __u32 len)
{
	return (len >= 3 && bytes[0] == TLS_HANDSHAKE && bytes[1] == 0x03) ||
	       (len >= 3 && bytes[0] == TLS_APPLICATION_DATA && bytes[1] == 0x03);
}

#endif /* AIPROBE_TLS_H */
