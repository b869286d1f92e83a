"""Host memory and reads per phase of a run (build, resume, save), each rank its own: at 8B a rank that
builds, saves or loads the whole fp32 state in host memory needs tens of GB more than its share, and that is
where a node runs out, so each phase's peak resident set and bytes read are measured, not estimated.

Linux keeps one peak per process (VmHWM, which getrusage's ru_maxrss also reads); writing 5 to /proc/self/clear_refs
sets it back to the resident set of the moment, so a phase's peak is VmHWM at its end after a reset at its start.
The peak before each reset is kept, so `peak_rss_bytes` is still the process's peak over the whole run. Where the
kernel refuses the reset or keeps no I/O counts (no procfs, no task I/O accounting), phases are not
measured and `peak_rss_bytes` falls back to ru_maxrss."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc/self")
_peak_before_resets = 0  # the largest VmHWM a reset has wiped, in bytes


def _status_bytes(key: str) -> int:
    for line in (PROC / "status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def _bytes_read() -> int:
    """Bytes this process has read by read(2) and its kin, page cache hits included (/proc/self/io's rchar): what
    a checkpoint load asks of the filesystem, whether or not the disk served it."""
    for line in (PROC / "io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def _reset_peak() -> bool:
    global _peak_before_resets
    try:
        before = _status_bytes("VmHWM")
        _bytes_read()  # a kernel without task I/O accounting has no /proc/self/io: then no phase is measured
        (PROC / "clear_refs").write_text("5")
    except (OSError, KeyError):
        return False
    _peak_before_resets = max(_peak_before_resets, before)
    return True


def peak_rss_bytes() -> int:
    """The process's peak resident set over its life so far, resets by `HostPhases` included."""
    try:
        now = _status_bytes("VmHWM")
    except (OSError, KeyError):
        now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(_peak_before_resets, now)


@dataclass
class PhaseFigures:
    start_rss: int  # resident at the phase's start, bytes
    peak_rss: int  # the phase's peak resident set (its start included), bytes
    bytes_read: int

    def merge(self, other: PhaseFigures) -> PhaseFigures:
        """Two runs of one phase (every save): the larger peak, the reads added."""
        worst = max(self, other, key=lambda f: f.peak_rss - f.start_rss)
        return PhaseFigures(worst.start_rss, worst.peak_rss, self.bytes_read + other.bytes_read)


@dataclass
class HostPhases:
    """This rank's figures by phase name; a phase run more than once keeps its largest rise."""
    figures: dict[str, PhaseFigures] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not _reset_peak():
            yield
            return
        start_rss, start_read = _status_bytes("VmRSS"), _bytes_read()
        try:
            yield
        finally:
            done = PhaseFigures(start_rss, _status_bytes("VmHWM"), _bytes_read() - start_read)
            self.figures[name] = self.figures[name].merge(done) if name in self.figures else done

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {name: {"startRssBytes": f.start_rss, "peakRssBytes": f.peak_rss, "bytesRead": f.bytes_read}
                for name, f in self.figures.items()}
