"""The overview's requests row (the requests part of sendlat): per endpoint (listening port and process),
requests per second by status class, the shares answered 5xx and 429, and the request duration's p50 and
p99, from `http_server_request_duration_seconds` (OpenTelemetry's names, docs/requests.md)."""

ENDPOINT = "instance, server_port, process"
ENDPOINT_LEGEND = "{{process}} :{{server_port}} ({{instance}})"
DURATION = "http_server_request_duration_seconds"
REQUESTS = DURATION + "_count"


def share(kit, statuses: str) -> str:
    """The share of each endpoint's requests answered with `statuses`, 0 while none is."""
    total = kit.rate(REQUESTS, kit.WORKLOAD, ENDPOINT)
    answered = kit.rate(REQUESTS, f'{kit.WORKLOAD},http_response_status_code=~"{statuses}"', ENDPOINT)
    return f"({answered} or 0 * {total})\n/ {total}"


def panels(kit):
    by_class = (f'label_replace(label_replace(rate({REQUESTS}{{{kit.WORKLOAD}}}[{kit.RATE}]), "status_class", '
                f'"${{1}}xx", "http_response_status_code", "([1-5])..")'
                f', "status_class", "unknown", "http_response_status_code", "")')
    return [
        kit.Panel("Requests per second by status class", [
            kit.Target(f"sum by ({ENDPOINT}, status_class) ({by_class})", "{{status_class}} " + ENDPOINT_LEGEND)],
            unit="reqps", width=8,
            description="HTTP responses per second per listening port and process; `unknown`: a status the probe "
                        "could not read (an HTTP/2 dynamic-table index, docs/requests.md). gRPC calls are "
                        "rpc_server_duration_seconds."),
        kit.Panel("Shares answered 5xx and 429", [
            kit.Target(share(kit, "5.."), "5xx " + ENDPOINT_LEGEND),
            kit.Target(share(kit, "429"), "429 " + ENDPOINT_LEGEND)],
            unit="percentunit", width=8,
            description="The http_server_errors rule fires above 0.1% 5xx, http_throttled above 1% 429 (the "
                        "sign of a token or request rate limit)."),
        kit.Panel("Request duration p50 / p99", [
            kit.Target(kit.quantile(0.5, DURATION, kit.WORKLOAD, ENDPOINT), "p50 " + ENDPOINT_LEGEND),
            kit.Target(kit.quantile(0.99, DURATION, kit.WORKLOAD, ENDPOINT), "p99 " + ENDPOINT_LEGEND)],
            unit="s", width=8,
            description="The request's last read to the response's last write, from the histogram's buckets."),
    ]
