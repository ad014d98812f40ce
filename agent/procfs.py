"""Small parsers of /proc files that more than one probe reads."""

from __future__ import annotations

from pathlib import Path


def start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat field 22): with the
    pid, the process's identity (a reused pid starts later). None when it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])  # fields after "(comm)" start at field 3


class StartTimes:
    """Each pid's start_ticks, remembered: a process whose final counts are read after it exited keeps
    the identity it had while it ran. A read's round (up to keep_only) reads each pid's stat once,
    however many of its entries the read decodes (a server with 1,000 listening ports has as many)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._known: dict[int, int] = {}
        self._read_this_round: set[int] = set()

    def of(self, pid: int) -> int:
        if pid not in self._read_this_round:
            self._read_this_round.add(pid)
            start = start_ticks(pid, self._proc)
            if start is not None:
                self._known[pid] = start
        return self._known.get(pid, 0)

    def keep_only(self, pids: set[int]) -> None:
        """Ends the round: forgets the pids not in `pids`."""
        self._known = {pid: start for pid, start in self._known.items() if pid in pids}
        self._read_this_round.clear()
