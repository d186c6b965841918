"""Where a process's start-up time goes: the seconds of each phase, logged as one line.

The first phase runs from the moment the kernel created the process (so the interpreter's
own start and the module imports before ``main`` are counted), when that moment can be
read; each later phase runs from the end of the one before.

The line reads ``startup: interpreter 0.41 s, imports 1.62 s, ... (total 9.87 s)`` and
``parse_timeline`` turns it back into a mapping, so tools can tabulate it from a log.
"""

from __future__ import annotations

import os
import re
import time

_PREFIX = "startup: "
_PHASE = re.compile(r"([a-z][a-z0-9 _-]*?) (\d+(?:\.\d+)?) s")


def seconds_since_process_start() -> float | None:
    """Seconds since the kernel created this process (Linux), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # Field 22 of the stat line (20th after the command name): start time in clock ticks
        # since boot, the clock CLOCK_BOOTTIME counts.
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupTimeline:
    """Phases marked in order; ``mark(name)`` closes the phase that ran since the last mark."""

    def __init__(self, first_phase: str | None = "interpreter") -> None:
        self.phases: list[tuple[str, float]] = []
        self._last = time.monotonic()
        since_start = seconds_since_process_start() if first_phase else None
        if since_start is not None:
            self.phases.append((first_phase, since_start))

    def mark(self, phase: str) -> float:
        now = time.monotonic()
        seconds = now - self._last
        self._last = now
        self.phases.append((phase, seconds))
        return seconds

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def as_dict(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for phase, seconds in self.phases:
            merged[phase] = merged.get(phase, 0.0) + seconds
        return merged

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases)
        return f"{_PREFIX}{parts} (total {self.total:.2f} s)"


def parse_timeline(line: str) -> dict[str, float] | None:
    """The phases of a ``summary()`` line found anywhere in ``line``, or None."""
    start = line.find(_PREFIX)
    if start < 0:
        return None
    body = line[start + len(_PREFIX) :].split(" (total ", 1)[0]
    phases: dict[str, float] = {}
    for part in body.split(", "):
        match = _PHASE.fullmatch(part.strip())
        if match is None:
            return None
        phases[match.group(1)] = phases.get(match.group(1), 0.0) + float(match.group(2))
    return phases or None
