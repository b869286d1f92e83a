"""Two commands timed side by side on a machine whose speed drifts: they run by turns, one time slice each, the
other stopped (SIGSTOP to its whole process tree, SIGCONT for its turn). Run one after the other, minutes apart, a
shared machine's drift (±15% over a minute was seen on the 2-core benchmark machine) falls on one side and not the
other; by turns, both see the same machine. Each side's own timings are then read from its per-step times, whose
median leaves out the few steps a turn boundary cut in two."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Command:
    argv: list[str]
    cwd: Path | None = None
    env: dict[str, str] | None = None


@dataclass
class Finished:
    returncode: int
    output: str  # stdout and stderr together
    active_seconds: float  # the time it ran: the sum of its turns


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                found.setdefault(ppid, []).append(int(entry))
    return found


def _tree(pid: int) -> set[int]:
    """pid and every descendant (a launcher's ranks start sessions of their own: no process group holds them)."""
    children, out, todo = _children(), set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _signal(pids: set[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def stop_tree(pid: int) -> None:
    """SIGSTOP the tree until no new process shows up (one forked between the scan and the signal is caught by the
    next scan; stopped processes fork no more)."""
    stopped: set[int] = set()
    while new := _tree(pid) - stopped:
        _signal(new, signal.SIGSTOP)
        stopped |= new


def run_by_turns(commands: dict[str, Command], logs: Path, slice_seconds: float = 2.0) -> dict[str, Finished]:
    """Run `commands` by turns of `slice_seconds` each until all have exited; their output goes to files in
    `logs` (a stopped process never blocks on a full pipe)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, active = {}, dict.fromkeys(commands, 0.0)
    for name, c in commands.items():
        with open(logs / f"{name}.log", "wb") as out:
            procs[name] = subprocess.Popen(c.argv, cwd=c.cwd, env=c.env, stdout=out, stderr=subprocess.STDOUT)
        stop_tree(procs[name].pid)
    try:
        while any(p.poll() is None for p in procs.values()):
            for name, p in procs.items():
                if p.poll() is not None:
                    continue
                _signal(_tree(p.pid), signal.SIGCONT)
                started = time.perf_counter()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=slice_seconds)
                if p.poll() is None:
                    stop_tree(p.pid)
                active[name] += time.perf_counter() - started
    finally:
        for p in procs.values():  # an interrupted benchmark leaves nothing stopped behind
            if p.poll() is None:
                tree = _tree(p.pid)
                _signal(tree, signal.SIGKILL)
                _signal(tree, signal.SIGCONT)
    return {name: Finished(p.returncode, (logs / f"{name}.log").read_text(errors="replace"), active[name])
            for name, p in procs.items()}
