"""The overview's connection set-up row (the connections probe): per listener, how full its accept
queue is, its overflows and its half-open connections; the RTT and retransmits of the connections it
accepted."""

LISTENER = "instance, address, port, process"
LISTENER_LEGEND = "{{process}} {{address}}:{{port}} ({{instance}})"


def panels(kit):
    target = kit.TARGET
    return [
        kit.Panel("Accept queue fill per listener", [
            kit.Target(f"max by ({LISTENER}) ({kit.gauge('aiprobe_listen_queue_length')}"
                       f" / {kit.gauge('aiprobe_listen_queue_capacity')})", LISTENER_LEGEND)],
            unit="percentunit", width=8,
            description="Connections waiting for accept() over the backlog in force: above 100% the queue "
                        "overflows (the kernel holds one more than the backlog)."),
        kit.Panel("Listen overflows per listener", [
            kit.Target(kit.rate("aiprobe_listen_overflows_total", target, LISTENER), LISTENER_LEGEND)],
            unit="ops", width=8,
            description="Connections dropped because the listener's accept queue was full; summed, the host's "
                        "TcpExt ListenOverflows."),
        kit.Panel("Half-open connections per listener", [
            kit.Target(f"sum by ({LISTENER}) ({kit.gauge('aiprobe_listen_half_open_connections')})",
                       LISTENER_LEGEND)],
            width=8,
            description="Requests in SYN_RECV: a pile-up is a SYN flood or clients slow to finish the handshake. "
                        "Accept waits per listener: aiprobe_accept_wait_seconds (fentry and kprobe strategies)."),
        kit.Panel("RTT of accepted connections per listener", [
            kit.Target(kit.quantile(0.5, "aiprobe_tcp_rtt_seconds", target, LISTENER), "p50 " + LISTENER_LEGEND),
            kit.Target(kit.quantile(0.99, "aiprobe_tcp_rtt_seconds", target, LISTENER), "p99 " + LISTENER_LEGEND)],
            unit="s", width=12,
            description="Smoothed RTT (tcp_info) of each listener's established connections, sampled at every "
                        "agent refresh (a long-lived connection counts once per refresh)."),
        kit.Panel("Retransmitted segments per listener", [
            kit.Target(kit.rate("aiprobe_listen_retransmitted_segments_total", target, LISTENER),
                       LISTENER_LEGEND)],
            unit="ops", width=12,
            description="Segments the listener's accepted connections retransmitted (tcp_info); the host's total, "
                        "clients included, is aiprobe_tcp_retransmitted_segments_total."),
    ]
