"""The supervisor: a background loop that raises is logged once per distinct error, counted and run
again after a back-off; one that keeps failing, or a collector failing refresh after refresh, is down."""

from __future__ import annotations

import logging
import threading

import pytest
from aiprobe import supervisor
from aiprobe.supervisor import Supervisor
from helpers import wait_until


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "FIRST_BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(supervisor, "MAX_BACKOFF_SECONDS", 0.05)


def test_a_loop_that_raises_is_run_again_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    sup, stop, runs = Supervisor(), threading.Event(), []

    def loop() -> None:
        runs.append(1)
        if len(runs) <= 3:
            raise OSError(24, "Too many open files")
        stop.wait()

    with caplog.at_level(logging.WARNING, "aiprobe.supervisor"):
        thread = sup.start_thread("scan", loop, stop)
        assert wait_until(lambda: len(runs) == 4, timeout=5)
        part = sup.parts["scan"]
        assert (part.restarts, part.errors, part.down_since) == (3, 3, None)
        assert sup.down(longer_than=0) == []
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert len([r for r in caplog.records if "Too many open files" in r.getMessage()]) == 1


def test_a_loop_that_keeps_failing_is_down_until_stopped() -> None:
    sup, stop = Supervisor(), threading.Event()

    def loop() -> None:
        raise RuntimeError("broken")

    thread = sup.start_thread("pusher", loop, stop)
    assert wait_until(lambda: sup.parts["pusher"].restarts >= 3, timeout=5)
    assert wait_until(lambda: sup.down(longer_than=0) == ["pusher"], timeout=5)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_collector_is_down_after_consecutive_failures_and_up_after_one_success() -> None:
    sup = Supervisor()
    for _ in range(supervisor.FAILED_REFRESHES_DOWN - 1):
        sup.collected("flows", KeyError("eth9"))
    assert sup.down(longer_than=-1) == []
    sup.collected("flows", KeyError("eth9"))
    assert sup.down(longer_than=-1) == ["flows"]
    assert sup.parts["flows"].errors == supervisor.FAILED_REFRESHES_DOWN
    sup.collected("flows", None)
    assert sup.down(longer_than=-1) == []
