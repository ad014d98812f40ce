/* SPDX-License-Identifier: GPL-2.0 */
/* Requests (RED metrics): the types agent/probes/sendlat/requests.py reads through the object's BTF.
 * Each response the streams logic times (streams_programs.h) is counted when it ends, per (process,
 * cgroup, listening port, protocol, method, status code): its duration, its request's and its own bytes. */
#ifndef AIPROBE_REQUESTS_H
#define AIPROBE_REQUESTS_H

#include "vmlinux.h"
#include "common.h"
#include "hist.h"

/* A request's method (label values: each name without its prefix; OTHER is OpenTelemetry's "_OTHER":
 * not one of these, or not readable). */
enum http_method {
	HTTP_METHOD_OTHER,
	HTTP_METHOD_GET,
	HTTP_METHOD_POST,
	HTTP_METHOD_PUT,
	HTTP_METHOD_DELETE,
	HTTP_METHOD_HEAD,
	HTTP_METHOD_PATCH,
	HTTP_METHOD_OPTIONS,
	HTTP_METHOD_CONNECT,
	HTTP_METHOD_TRACE,
	HTTP_METHOD_MAX,
};
BTF_EXPORT_ENUM(http_method);

struct request_key {
	__u32 tgid;
	__u16 port;		/* local (listening) port, host order */
	__u16 status;		/* the response's status code (200-599: a final one); 0: not readable */
	__u8 protocol;		/* enum stream_protocol */
	__u8 method;		/* enum http_method */
	__u8 rpc_status;	/* gRPC: the trailers' grpc-status + 1; 0: not readable (or not gRPC) */
	__u8 pad[5];
	__u64 cgroup_id;
};

struct request_stats {
	struct hist duration;		/* request received -> the response's last write */
	__u64 durations_unknown;	/* responses whose last write precedes their request: not in duration */
	__u64 request_bytes;		/* bytes read for the requests (headers included) */
	__u64 response_bytes;		/* bytes of the responses' body writes (a headers-only write excluded) */
	char comm[16];
};

/* The client side: requests the host sent on connections it opened (client_programs.h), per (process,
 * cgroup, server address and port, method, status code). */
struct client_key {
	__u32 tgid;
	__u16 port;		/* the server's (remote) port, host order */
	__u16 status;		/* the response's status code (200-599); 0: not readable */
	__u16 family;		/* AF_INET, AF_INET6 */
	__u8 method;		/* enum http_method */
	__u8 pad[5];
	__u8 addr[16];		/* the server's address (AF_INET: its first 4 bytes) */
	__u64 cgroup_id;
};

struct client_stats {
	struct hist duration;	/* the request's first send -> its response's last read */
	struct hist ttfb;	/* the request's first send -> its response's first read */
	char comm[16];
};

/* A client request whose response's end the kernel cannot see (bpf/client_programs.h): the agent counts
 * it once its response has had no read for a while, unless the kernel counts it first (the next request,
 * the close). Whichever deletes the entry counts the request. */
struct client_pending_key {
	__u64 sock;		/* the socket's address */
	__u64 request_ns;	/* the request's first send */
};

struct client_pending {
	struct client_key key;
	__u64 request_ns;	/* its first send */
	__u64 first_read_ns;	/* its response's first read */
	__u64 last_read_ns;	/* its response's last read */
	char comm[16];		/* the sender's name, where the first read was its own */
};

#endif /* AIPROBE_REQUESTS_H */
