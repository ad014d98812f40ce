"""Bottleneck rules: pending -> firing -> resolved, `for` durations, hysteresis, vanished targets."""

from __future__ import annotations

from pathlib import Path

import yaml
from aiprobe.config import RuleConfig
from aiprobe.deltas import Window
from aiprobe.exporters.rules_file import render
from aiprobe.probes.cuda.hooks import time_slicing_signals
from aiprobe.probes.cuda.records import AllocationFailures, CudaContext, CudaGpu
from aiprobe.probes.nvml.records import GpuEngine, GpuEventCount, GpuInfo, GpuProcess
from aiprobe.probes.nvml.signals import failure_signals, memory_pressure_signals, xid_signals
from aiprobe.refresh import SIGNAL_WINDOW_SECONDS
from aiprobe.registry import catalog, fleet_rules, rules
from aiprobe.rules import RuleEngine, Signal, alert_name

DEFAULT_RULES = catalog().rules  # as the probes declare them
RULES = {rule.name: rule for rule in rules()}
RULES_FILE = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "aiprobe-rules.yml"


def engine(**rule: float) -> RuleEngine:
    configured = dict(DEFAULT_RULES)
    configured["network_send_stall"] = RuleConfig(**{"threshold": 0.05, "clear": 0.02, "for_seconds": 10, **rule})
    return RuleEngine(RULES.values(), configured)


def stall(value: float) -> list[Signal]:
    return [Signal("network_send_stall", "app@host", value, {"send_p99_seconds": value})]


def test_pending_then_firing_after_for_then_resolved() -> None:
    rules = engine()
    assert [a.state for a in rules.evaluate(stall(0.3), now=0)] == ["pending"]
    assert rules.evaluate(stall(0.3), now=5) == []
    fired = rules.evaluate(stall(0.4), now=10)
    assert [(a.state, a.value, a.evidence) for a in fired] == [("firing", 0.4, {"send_p99_seconds": 0.4})]
    assert "0.4s" in fired[0].summary
    assert [a.target for a in rules.firing] == ["app@host"]
    resolved = rules.evaluate(stall(0.01), now=20)
    assert [(a.state, a.resolved_at) for a in resolved] == [("resolved", 20)]
    assert rules.firing == [] and len(rules.resolved) == 1


def test_hysteresis_keeps_firing_between_clear_and_threshold() -> None:
    rules = engine(for_seconds=0)
    assert [a.state for a in rules.evaluate(stall(0.06), now=0)] == ["pending", "firing"]
    assert rules.evaluate(stall(0.03), now=1) == []  # below threshold, above clear: still firing
    assert [a.state for a in rules.evaluate(stall(0.019), now=2)] == ["resolved"]
    assert [a.state for a in rules.evaluate(stall(0.03), now=3)] == []  # needs the threshold again


def test_pending_that_clears_becomes_inactive_without_firing() -> None:
    rules = engine()
    rules.evaluate(stall(0.3), now=0)
    assert [a.state for a in rules.evaluate(stall(0.0), now=1)] == ["inactive"]
    assert rules.resolved == []


def test_vanished_target_resolves() -> None:
    rules = engine(for_seconds=0)
    rules.evaluate(stall(0.3), now=0)
    assert [a.state for a in rules.evaluate([], now=1)] == ["resolved"]


def test_rules_that_fire_below_and_disabled_rules() -> None:
    configured = dict(DEFAULT_RULES)
    configured["gpu_idle_with_traffic"] = RuleConfig(threshold=0.1, clear=0.25, for_seconds=0)
    configured["gpu_saturated"] = RuleConfig(enabled=False)
    engine_ = RuleEngine(RULES.values(), configured)
    signals = [Signal("gpu_idle_with_traffic", "gpu0", 0.05), Signal("gpu_saturated", "gpu0", 1.0)]
    assert [(a.rule, a.state) for a in engine_.evaluate(signals, now=0)] == [
        ("gpu_idle_with_traffic", "pending"), ("gpu_idle_with_traffic", "firing")]
    assert engine_.evaluate([Signal("gpu_idle_with_traffic", "gpu0", 0.2)], now=1) == []
    assert [a.state for a in engine_.evaluate([Signal("gpu_idle_with_traffic", "gpu0", 0.3)], now=2)] == ["resolved"]


def test_shipped_rule_file_is_generated_from_the_engines_rules() -> None:
    assert RULES_FILE.read_text() == render(), "regenerate: .venv/bin/python deploy/prometheus/generate_rules.py"


def test_rule_file_thresholds_for_and_severity_are_the_engines() -> None:
    group = yaml.safe_load(render())["groups"][0]
    by_rule = {rule["labels"]["rule"]: rule for rule in group["rules"]}
    assert set(by_rule) == set(RULES) == set(DEFAULT_RULES)
    for name, config in DEFAULT_RULES.items():
        rule = by_rule[name]
        assert rule["alert"] == alert_name(name)
        assert rule["labels"]["severity"] == config.severity
        comparison = rule["expr"].splitlines()[len(RULES[name].query.splitlines()) - 1]  # the query's last line
        assert comparison.endswith(f"{'<' if RULES[name].fires_below else '>'} {config.threshold:g}"), comparison
        assert rule.get("for", "0s") in (f"{config.for_seconds:g}s", f"{config.for_seconds / 60:g}m")


def test_a_changed_threshold_changes_the_rule_file() -> None:
    configured = dict(DEFAULT_RULES, gpu_saturated=RuleConfig(threshold=0.9, for_seconds=120, severity="warning"))
    rule = next(r for r in yaml.safe_load(render(configured))["groups"][0]["rules"]
                if r["alert"] == "AiprobeGpuSaturated")
    assert (rule["expr"].strip(), rule["for"], rule["labels"]["severity"]) == \
        ("aiprobe_gpu_utilization_ratio > 0.9", "2m", "warning")


def test_time_sliced_evidence_carries_the_gpus_own_switching() -> None:
    """gpu_time_sliced's evidence: the busy contexts, and what GPM says the switching between them costs."""
    gpu = CudaGpu("0", 2, ["1/0x1", "2/0x2"], [1, 2], 20.0)
    contexts = [CudaContext(pid, "llm", f"0x{pid}", 0, "0", 10, 0, 10.0, True) for pid in (1, 2)]
    info = GpuInfo(0, "GPU-a", "H100", utilization_gpu_ratio=0.9, context_switches_per_second=2000.0,
                   context_switching_ratio=0.04, context_switch_seconds=3e-5,
                   engines=[GpuEngine(0, 2000.0, 0.04, 3e-5)])
    shares = [GpuProcess(1, "llm", 0, "GPU-a", 1 << 30, 0.5, 0.2), GpuProcess(2, "llm", 0, "GPU-a", 1 << 30, 0.3, 0.1),
              GpuProcess(3, "other", 1, "GPU-b", 1 << 30, 0.9, 0.9)]
    [signal] = time_slicing_signals([gpu], contexts, [info], shares)
    assert (signal.target, signal.value) == ("gpu0", 2)
    # Each process's share of the GPU, by NVML's samples (the other GPU's process is not evidence).
    assert signal.evidence["process_shares"] == [
        {"pid": 1, "process": "llm@host", "sm_utilization_ratio": 0.5, "memory_utilization_ratio": 0.2,
         "attribution": "nvml"},
        {"pid": 2, "process": "llm@host", "sm_utilization_ratio": 0.3, "memory_utilization_ratio": 0.1,
         "attribution": "nvml"}]
    assert {k: signal.evidence[k] for k in ("utilization_ratio", "context_switching_ratio",
                                            "context_switch_seconds")} == {
        "utilization_ratio": 0.9, "context_switching_ratio": 0.04, "context_switch_seconds": 3e-5}
    [without_gpm] = time_slicing_signals([gpu], contexts, [GpuInfo(0, "GPU-a", "A100")])
    assert without_gpm.evidence["context_switching_ratio"] is without_gpm.evidence["context_switch_seconds"] is None


ON_GPU0 = [GpuProcess(7, "vllm", 0, "GPU-a", 1 << 30), GpuProcess(8, "other", 1, "GPU-b", 1 << 30)]


def test_an_xid_fires_with_its_meaning_action_and_processes_then_resolves_after_the_window() -> None:
    refresh = Window(SIGNAL_WINDOW_SECONDS)  # the agent's window of recent counts

    def xids(count: int, now: float) -> list[Signal]:
        counts = [GpuEventCount(0, "GPU-a", None, "", None, "xid", 31, count)]
        return xid_signals(counts, ON_GPU0, refresh, now)  # the window is all of a refresh it uses
    rules = RuleEngine(RULES.values(), DEFAULT_RULES)
    fired = rules.evaluate(xids(1, 0), now=0)
    assert [(a.target, a.state) for a in fired] == [("gpu0 xid 31", "pending"), ("gpu0 xid 31", "firing")]
    assert fired[1].evidence == {
        "xid": 31, "meaning": "GPU memory page fault", "action": "restart the application (most likely its own error)",
        "uuid": "GPU-a", "xid_errors": 1,
        "processes": [{"pid": 7, "process": "vllm@host", "used_memory_bytes": 1 << 30}]}
    assert rules.evaluate(xids(1, 5), now=5) == []  # no new Xid, but within the window
    assert [a.state for a in rules.evaluate(xids(2, 8), now=8)] == []  # another: still firing
    assert [a.state for a in rules.evaluate(xids(2, 19), now=19)] == ["resolved"]


def test_a_lost_gpu_and_memory_errors_fire_then_resolve() -> None:
    rules = RuleEngine(RULES.values(), DEFAULT_RULES)

    def gpus(lost: bool, uncorrected: int, remap_failed: bool) -> list[Signal]:
        return failure_signals([GpuInfo(0, "GPU-a", "H100", lost=lost, last_xid=79 if lost else None),
                                GpuInfo(1, "GPU-b", "A100", lost=False, ecc_uncorrected_volatile=uncorrected,
                                        row_remap_failure=remap_failed)], ON_GPU0)
    assert rules.evaluate(gpus(False, 0, False), now=0) == []
    fired = {(a.rule, a.target): a for a in rules.evaluate(gpus(True, 2, False), now=1) if a.state == "firing"}
    assert set(fired) == {("gpu_lost", "gpu0"), ("gpu_memory_errors", "gpu1")}
    assert fired["gpu_lost", "gpu0"].evidence == {"uuid": "GPU-a", "last_xid": 79, "processes": [
        {"pid": 7, "process": "vllm@host", "used_memory_bytes": 1 << 30}]}
    assert fired["gpu_memory_errors", "gpu1"].evidence["ecc_uncorrected_volatile"] == 2
    # The GPU reset: no uncorrected errors since, but a row remapping failed: still firing.
    assert rules.evaluate(gpus(True, 0, True), now=2) == []
    assert {(a.rule, a.state) for a in rules.evaluate(gpus(False, 0, False), now=3)} == {
        ("gpu_lost", "resolved"), ("gpu_memory_errors", "resolved")}


def test_memory_pressure_fires_while_a_full_gpus_processes_run_out_of_memory_and_resolves() -> None:
    """GPU 0 95% used: nothing while its process allocates; its failures (retried ones too) fire the rule with the
    GPU's processes, their memory and failures; it resolves when the memory falls, and when the failures leave the
    window. GPU 1 is as full, and its process fails only with another error: never."""
    rules, window = RuleEngine(RULES.values(), DEFAULT_RULES), Window(SIGNAL_WINDOW_SECONDS)
    processes = [*ON_GPU0, GpuProcess(9, "sidecar", 0, "GPU-a", 1 << 28)]

    def signals(used_gib: int, failed: int, retried: int, now: float) -> list[Signal]:
        gpus = [GpuInfo(0, "GPU-a", "H100", memory_total_bytes=80 << 30, memory_used_bytes=used_gib << 30),
                GpuInfo(1, "GPU-b", "A100", memory_total_bytes=80 << 30, memory_used_bytes=76 << 30)]
        failures = [AllocationFailures(7, "vllm", "CUDA_ERROR_OUT_OF_MEMORY", failed, failed << 20, retried),
                    AllocationFailures(8, "other", "CUDA_ERROR_INVALID_VALUE", 4, 4 << 20, 0)]
        return memory_pressure_signals(gpus, processes, failures, window, now)
    assert signals(76, 0, 0, now=0) == []  # full, but nothing failed
    fired = rules.evaluate(signals(76, 5, 5, now=1), now=1)
    assert [(a.target, a.state, a.value) for a in fired] == [("gpu0", "pending", 0.95), ("gpu0", "firing", 0.95)]
    assert fired[1].evidence == {
        "uuid": "GPU-a", "memory_used_bytes": 76 << 30, "memory_total_bytes": 80 << 30, "processes": [
            {"pid": 7, "process": "vllm@host", "used_memory_bytes": 1 << 30, "out_of_memory_failures": 5, "retried": 5},
            {"pid": 9, "process": "sidecar@host", "used_memory_bytes": 1 << 28, "out_of_memory_failures": 0,
             "retried": 0}]}
    assert [a.state for a in rules.evaluate(signals(60, 5, 5, now=2), now=2)] == ["resolved"]  # memory fell
    assert [a.state for a in rules.evaluate(signals(76, 8, 5, now=3), now=3)] == ["pending", "firing"]
    assert rules.evaluate(signals(76, 8, 5, now=1 + SIGNAL_WINDOW_SECONDS), now=1 + SIGNAL_WINDOW_SECONDS) == []
    later = 3 + SIGNAL_WINDOW_SECONDS  # no failure since 3 s
    assert [a.state for a in rules.evaluate(signals(76, 8, 5, now=later), now=later)] == ["resolved"]


def test_fleet_rules_have_a_group_of_their_own_outside_the_engine() -> None:
    """Replica skew is judged across nodes: in the rule file only, never among the engine's rules."""
    groups = {group["name"]: group["rules"] for group in yaml.safe_load(render())["groups"]}
    fleet = groups["aiprobe-fleet"]
    assert [rule.get("record") or rule["labels"]["rule"] for rule in fleet] == \
        [rule.record or rule.name for rule in fleet_rules()]
    alerts = {rule["labels"]["rule"]: rule["alert"] for rule in fleet if "alert" in rule}
    assert alerts == {"replica_traffic_skew": "AiprobeReplicaTrafficSkew", "replica_slow": "AiprobeReplicaSlow"}
    assert not set(alerts) & set(RULES) and not set(alerts) & set(DEFAULT_RULES)
