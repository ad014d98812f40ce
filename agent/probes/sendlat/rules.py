"""The send path's bottleneck rules (send latency's, the streams part's and the requests part's): what each means, its
PromQL and its default thresholds (`[rules.<name>]` overrides them)."""

from __future__ import annotations

from ...config import RuleConfig
from ...rules import RuleSpec, p99

# Blocking senders wait in the send; asynchronous servers (uvicorn, vLLM's API server) never do:
# their sockets stay unwritable instead. The agent takes the larger of the two p99s.
NETWORK_SEND_STALL = RuleSpec(
    False, "sends block or sockets stay unwritable {value:.3g}s (p99) in {target}: full socket buffers "
    "(slow clients, backpressure or congestion)",
    p99("aiprobe_tcp_sendmsg_duration_seconds"),
    "sends of {{ $labels.process }} in {{ $labels.container }} block or stay unwritable",
    "Full socket buffers: slow clients, backpressure or congestion.",
    guard="or\n" + p99("aiprobe_tcp_socket_unwritable_seconds") + " > %(threshold)s",
    name="network_send_stall",
    # p99 of tcp_sendmsg over the last interval, seconds
    default=RuleConfig(threshold=0.05, clear=0.02, for_seconds=10, severity="warning"),
)


TOKEN_STREAMS_STALLING = RuleSpec(
    False, "token streams of {target} stalled {value:.0f} times in the last 10 s (the evidence names the "
    "cause: network, cpu, gpu or server)",
    "sum by (instance, process, container, cause) (increase(aiprobe_stream_stalls_total[1m]))",
    "token streams of {{ $labels.process }} stall (cause: {{ $labels.cause }})",
    "Gaps between writes of streamed responses above stream_stall_threshold_ms. The cause label says "
    "why: network (the socket was full), cpu (the writer waited for a CPU), gpu (the process was inside "
    "a CUDA synchronization), server (the application was slow to produce).",
    name="token_streams_stalling",
    # stalls (gaps between writes above stream_stall_threshold_ms) of one process's responses in the window
    default=RuleConfig(threshold=0.0, clear=0.0, for_seconds=0, severity="warning"),
)


def _share_rule(name: str, statuses: str, answered: str, meaning: str, default: RuleConfig) -> RuleSpec:
    """A rule on the share of a server's (process, listening port) requests answered with `statuses`: the
    agent's over the last 10 s, the rule file's over 5 minutes."""
    by = "instance, server_port, process, container"
    total = "http_server_request_duration_seconds_count"
    return RuleSpec(
        False, f"{{target}} answered {{value:.2%}} of its requests in the last 10 s {answered} (the evidence has "
        "the status counts)",
        f'sum by ({by}) (rate({total}{{http_response_status_code=~"{statuses}"}}[5m]))\n'
        f"/\nsum by ({by}) (rate({total}[5m]))",
        f"{{{{ $labels.process }}}} on port {{{{ $labels.server_port }}}} answers more than %(threshold_percent)s of "
        f"its requests {answered}",
        meaning, name=name, default=default)


# share of the requests of one server (process, port) answered 5xx in the window
HTTP_SERVER_ERRORS = _share_rule(
    "http_server_errors", "5..", "with server errors (5xx)",
    "Server errors (HTTP status 5xx) above the service's error budget: the server fails, or sheds load with 503s.",
    RuleConfig(threshold=0.001, clear=0.0005, for_seconds=0, severity="warning"))
# share of the requests of one server (process, port) answered 429 in the window
HTTP_THROTTLED = _share_rule(
    "http_throttled", "429", "with 429 (throttled)",
    "Requests refused with 429 Too Many Requests: a rate limit (tokens, requests) is reached; clients retry and "
    "wait.", RuleConfig(threshold=0.01, clear=0.005, for_seconds=0, severity="warning"))
