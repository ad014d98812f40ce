/* SPDX-License-Identifier: GPL-2.0 */
/* Per-socket state of BTF programs: socket storage (no hash lookup, freed with the socket), or where
 * those programs may not use it (before 5.11) a preallocated hash keyed by the socket's address. User
 * space chooses from a real load (agent/features.py, sk_storage_in_tracing), retypes the maps before
 * loading and sets `sockets_by_address`; the verifier never visits the branch not taken. Hash entries
 * are deleted when the connection closes (TCP_CLOSE): streams_set_state, sendlat_socket_close. */
#ifndef AIPROBE_SK_STATE_H
#define AIPROBE_SK_STATE_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "common.h"

const volatile bool sockets_by_address = false;

/* A map of `value_type` per socket, as socket storage declares it (user space may make it a hash by
 * socket address, with a key of 8 bytes). */
#define SOCKET_STATE_MAP(name, value_type)				\
	struct {							\
		__uint(type, BPF_MAP_TYPE_SK_STORAGE);			\
		__uint(map_flags, BPF_F_NO_PREALLOC);			\
		__type(key, int);					\
		__type(value, value_type);				\
	} name SEC(".maps")

/* `sk`'s entry in `map`; where `make`, made from `zero` (zeroed) if it has none. NULL: none, or the
 * hash is full. */
static __always_inline void *socket_entry(void *map, struct sock *sk, const void *zero, bool make)
{
	__u64 address = (__u64)sk;

	if (!sockets_by_address)
		return bpf_sk_storage_get(map, sk, NULL, make ? BPF_SK_STORAGE_GET_F_CREATE : 0);
	return make ? lookup_or_init(map, &address, zero) : bpf_map_lookup_elem(map, &address);
}

/* `sk`'s entry in `map` deleted; 0 where this call deleted it. */
static __always_inline long socket_entry_delete(void *map, struct sock *sk)
{
	__u64 address = (__u64)sk;

	return sockets_by_address ? bpf_map_delete_elem(map, &address) : bpf_sk_storage_delete(map, sk);
}

#endif /* AIPROBE_SK_STATE_H */
