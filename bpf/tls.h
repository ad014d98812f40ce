/* SPDX-License-Identifier: GPL-2.0 */
/* TLS: a write that starts with a TLS record is encrypted, from the handshake on; a server's first
 * write, its ServerHello, says the version. */
#ifndef AIPROBE_TLS_H
#define AIPROBE_TLS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "streams.h"

#define TLS_HANDSHAKE 0x16
#define TLS_APPLICATION_DATA 0x17
#define TLS_SERVER_HELLO 2
#define TLS_RECORD_HEADER 5
#define TLS_SESSION_ID_AT 43	/* record header 5, handshake header 4, legacy_version 2, random 32 */
#define TLS_SUITES_1_3 0x13	/* the first byte of every TLS 1.3 cipher suite */
/* The first 8 bytes of the random of a HelloRetryRequest (a ServerHello asking for another ClientHello),
 * read as a little-endian __u64. */
#define TLS_HRR_RANDOM_START 0x11619ae574ad21cfULL

/* The header of a TLS record (its content type, then major version 3): a handshake or application data. */
static __always_inline bool is_tls_record(const char *bytes, __u32 len)
{
	return (len >= 3 && bytes[0] == TLS_HANDSHAKE && bytes[1] == 0x03) ||
	       (len >= 3 && bytes[0] == TLS_APPLICATION_DATA && bytes[1] == 0x03);
}

/* The version of the ServerHello `bytes` start with: TLS 1.3 where its cipher suite is one of 1.3's
 * (its legacy_version says 1.2 there), else its legacy_version; none when it is no ServerHello, a
 * HelloRetryRequest (another ClientHello follows, not the client's Finished), or cut short. */
static __always_inline __u8 server_hello_version(const char *bytes, __u32 len)
{
	__u64 random_start;
	__u32 suite_at;

	if (len < TLS_SESSION_ID_AT + 1 || bytes[0] != TLS_HANDSHAKE || bytes[1] != 0x03 ||
	    bytes[TLS_RECORD_HEADER] != TLS_SERVER_HELLO || bytes[9] != 0x03)
		return TLS_VERSION_NONE;
	__builtin_memcpy(&random_start, bytes + 11, sizeof(random_start));
	if (random_start == TLS_HRR_RANDOM_START)
		return TLS_VERSION_NONE;
	suite_at = TLS_SESSION_ID_AT + 1 + (__u8)bytes[TLS_SESSION_ID_AT];
	if (suite_at + 2 > len)
		return TLS_VERSION_NONE;
	if (bytes[suite_at] == TLS_SUITES_1_3)
		return TLS_VERSION_1_3;
	switch (bytes[10]) {
	case 0x01: return TLS_VERSION_1_0;
	case 0x02: return TLS_VERSION_1_1;
	case 0x03: return TLS_VERSION_1_2;
	default: return TLS_VERSION_NONE;
	}
}

#endif /* AIPROBE_TLS_H */
