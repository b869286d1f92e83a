"""Drive a local gang from outside, as faults do: start `paratrain run` in the background, find each rank's
process, and check that nothing of the gang is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..trainer.harness import TINY_JOB, layout

FAULTS = Path(__file__).parent / "faults"  # PYTHONPATH entry: PARATRAIN_TEST_FAULT sabotage
STEPS, INTERVAL = 12, 3


def checkpointed(ckpt: Path, data: int = 2, **sets) -> list[str]:
    """A 12-step dp2 job checkpointing every 3 steps into `ckpt`, keeping all of them."""
    sets = {"spec.checkpoint.path": ckpt, "spec.checkpoint.interval": INTERVAL, "spec.checkpoint.keep": 10,
            "spec.training.steps": STEPS, **sets}
    return layout(data=data) + [f"{k}={v}" for k, v in sets.items()]


def fault_env(fault: str) -> dict[str, str]:
    return {"PARATRAIN_TEST_FAULT": fault, "PYTHONPATH": str(FAULTS)}


@dataclass
class BackgroundRun:
    proc: subprocess.Popen
    work: Path

    def last_step(self) -> int:
        events = self.work / "events.jsonl"
        if not events.exists():
            return 0
        steps = [json.loads(line)["step"] for line in events.read_text().splitlines()
                 if line.endswith("}") and '"event": "step"' in line]
        return max(steps, default=0)

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.last_step() < step:
            assert self.proc.poll() is None, f"the job ended before step {step}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
            time.sleep(0.02)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the live ranks: the process that leads its session (a rank's own children share its
        log too)."""
        return {rank: pid for pid, rank in gang_processes(self.work).items() if os.getsid(pid) == pid}

    def stderr(self) -> str:
        return (self.work.parent / "stderr.txt").read_text(errors="replace")

    def kill_all(self) -> None:
        """Test cleanup: whatever the launcher left (each rank leads its own process group)."""
        for pid in gang_processes(self.work):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_run(tmp: Path, overrides: list[str], env: dict[str, str] | None = None) -> BackgroundRun:
    """`paratrain run` as the user types it, in the background (the same command as harness.run_job)."""
    tmp.mkdir(parents=True, exist_ok=True)
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(TINY_JOB))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(job_file), "--metrics-out", str(tmp / "metrics.json"),
           "--workdir", str(tmp / "work"), "--no-progress"]
    for item in overrides:
        cmd += ["--set", item]
    with open(tmp / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp, env={**os.environ, **(env or {})})
    return BackgroundRun(proc, tmp / "work")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def gang_processes(work: Path) -> dict[int, int]:
    """{pid: rank} of the live processes (not zombies) writing to a rank log of the run in `work`
    (logs/rank-N.log as their stdout): the ranks however the launcher started them, and whatever they started."""
    logs = work.resolve() / "logs"
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stdout = Path(os.readlink(f"/proc/{entry}/fd/1"))
        except OSError:
            continue
        if stdout.parent == logs and stdout.name.startswith("rank-") and stdout.suffix == ".log":
            stat = _read(f"/proc/{entry}/stat")
            if stat and stat.rsplit(b")", 1)[-1].split()[0] != b"Z":
                out[int(entry)] = int(stdout.stem.removeprefix("rank-"))
    return out


def processes_left(run: BackgroundRun, pids: dict[int, int]) -> list[str]:
    """What is still running of the gang: rank processes, and processes in any rank's process group."""
    left = [f"rank {rank}'s process {pid}" for pid, rank in gang_processes(run.work).items()]
    for rank, pid in pids.items():
        try:
            os.killpg(pid, 0)  # each rank leads its own session and process group
        except ProcessLookupError:
            continue
        left.append(f"process group of rank {rank} (pgid {pid})")
    return left
