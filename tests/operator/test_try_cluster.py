"""The README's try-out cluster walkthrough, run as written: `test-cluster.sh up --nodes 2` (the test kubelet as a
process), the CRD and the checkpoint claim, the operator as a local process, `examples/shakespeare-long.yaml`
applied, a pod deleted past step 1000, the gang restarting and resuming, the job succeeding.

The block's lines run in one bash session, in this checkout, with /tmp/k8s replaced by a temporary directory, and a
reader's pause of a few seconds between commands. Only the reader's own act changes: the `-w` watch is watched for
ten seconds, then stopped (Ctrl-C). Every wait is the README's own, so a line that runs too early for a reader
(a log read before its pod exists, a status read before it says so) fails here too."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ..support import control_plane

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
READER_PAUSE = 3  # seconds between two commands: reading the last one's output, typing the next
WAITS = r'''
wait_until() {  # SECONDS COMMAND...: run COMMAND every second until it succeeds
  local deadline=$((SECONDS + $1))
  shift
  until "$@" > /dev/null 2>&1; do
    if (( SECONDS >= deadline )); then echo "timed out waiting for: $*" >&2; return 1; fi
    sleep 1
  done
}
step_at_least() { (( $(kubectl get ptj "$JOB" -o jsonpath='{.status.progress.step}' || echo 0) >= $1 )); }
logged_resume() { kubectl logs "$JOB-1-0" | grep -q resume; }
succeeded() { [[ "$(kubectl get ptj "$JOB" -o jsonpath='{.status.phase}')" == Succeeded ]]; }
'''


def walkthrough_block() -> str:
    [block] = [b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if "test-cluster.sh up /tmp/k8s --nodes" in b]
    return block


def walkthrough_commands(k8s: Path) -> list[str]:
    """The block's commands, comments dropped, /tmp/k8s moved; a command written over several lines (`until …`
    then `do …; done`) is one."""
    commands: list[str] = []
    for line in walkthrough_block().splitlines():
        line = line.split("  #")[0].rstrip().replace("/tmp/k8s", str(k8s))
        if commands and commands[-1].startswith("until ") and not commands[-1].endswith("done"):
            commands[-1] += "\n" + line
        elif line:
            commands.append(line)
    return commands


def test_the_readme_walkthrough_at_a_readers_pace_shows_the_stop_the_resume_and_success(tmp_path):
    control_plane.testbin()  # its binaries, built by `bash scripts/testbin.sh` (the suite's first run builds them)
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for command in walkthrough_commands(tmp_path / "k8s"):
        if command.endswith(" -w"):
            command = f"timeout 10 {command} || true"  # the reader watches, then Ctrl-C
        script += [command, f"sleep {READER_PAUSE}"]
        if command.startswith("kubectl apply -f examples/"):
            script.append('echo "applied at $SECONDS s"')
        if "=Succeeded" in command:
            script.append('echo "succeeded at $SECONDS s"')
    assert any("python -m paratrain_operator" in line for line in script)
    proc, context = run_on_a_try_out_cluster(script, tmp_path)
    assert proc.returncode == 0, context
    out = proc.stdout
    assert "examples/shakespeare-long.yaml: valid" in out, context
    # `kubectl describe`'s Events: the deleted pod named (a stop nobody gave a reason for), then the new gang's
    # resume step, past the README's wait for step 1000.
    assert re.search(r"PodDeleted\s+.*pod shakespeare-long-0-1 was deleted before it finished", out), context
    resumed = re.search(r"TrainingResumed\s+.*attempt 1's ranks resumed from step (\d+)", out)
    assert resumed and 1000 <= int(resumed[1]) < 3000, context
    final = out.strip().splitlines()[-1]  # `kubectl get ptj shakespeare-long`: its printer columns
    # Restarts 0, and the stop shown beside it: the deleted pod restarted the gang, not counted.
    assert re.search(r"\bSucceeded\b", final) and re.search(r"\b3000/3000\s+\S+\s+0 \(1 stop\)\s", final), context
    applied, succeeded = (int(re.search(rf"{what} at (\d+) s", out)[1]) for what in ("applied", "succeeded"))
    print(f"the try-out job took {succeeded - applied} s from kubectl apply to Succeeded, a reader's pauses included")
    checkpoints = tmp_path / "k8s" / "nodes" / "pvc" / "default" / "paratrain-checkpoints" / "shakespeare-long"
    assert (checkpoints / "step-00003000").is_dir() and (checkpoints / "step-00002500").is_dir(), context


def test_the_try_out_job_is_the_laptop_job_made_longer():
    """examples/shakespeare-long.yaml differs from examples/shakespeare.yaml only in its name, length, evaluation
    and checkpoint spacing and checkpoint path: what the README says of it stays true."""
    short, long = (yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
                   for name in ("shakespeare", "shakespeare-long"))
    for job in (short, long):
        job["metadata"].pop("name")
        job["spec"]["training"].pop("steps"), job["spec"]["training"].pop("evalInterval")
        job["spec"].pop("checkpoint")
    assert short == long


def run_on_a_try_out_cluster(script: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The script's lines in one bash session, in this checkout; then the cluster and the operator stopped,
    whatever happened. Returns the run and what to show when it failed (its output, the operator's log)."""
    try:
        proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "test-cluster.sh"), "down", str(tmp_path / "k8s")],
                       capture_output=True, timeout=120)
        subprocess.run(["pkill", "-f", f"paratrain_operator.*{tmp_path}"], capture_output=True)
    operator_log = tmp_path / "k8s" / "operator.log"
    return proc, proc.stdout + proc.stderr + (operator_log.read_text(errors="replace")[-3000:]
                                              if operator_log.exists() else "")


def test_an_own_program_trains_restarts_as_a_gang_and_resumes(tmp_path):
    """examples/own-script.yaml (spec.entrypoint: a plain DDP script) as it is, on the try-out cluster: Step and
    Loss reported through paratrain.progress; a pod deleted after step 100 stops the gang, whose ranks save the
    step in flight (the script's SIGTERM handling); the gang restarts uncounted and the script resumes there."""
    control_plane.testbin()
    k8s = tmp_path / "k8s"
    walkthrough = [line.split("  #")[0].rstrip().replace("/tmp/k8s", str(k8s))
                   for line in walkthrough_block().splitlines()]
    setup = [line for line in walkthrough if line.startswith(("bash scripts/test-cluster.sh up", "eval ",
                                                              "kubectl apply -f manifests", "until kubectl wait",
                                                              ".venv/bin/python -m paratrain_operator"))]
    assert len(setup) == 5, setup
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT", "JOB=own-script", WAITS,
              *setup, "kubectl apply -f examples/own-script.yaml", "wait_until 300 step_at_least 100",
              "kubectl delete pod own-script-0-1", "wait_until 300 logged_resume", "kubectl logs own-script-1-0",
              "wait_until 300 succeeded", "kubectl get ptj own-script"]
    proc, context = run_on_a_try_out_cluster(script, tmp_path)
    assert proc.returncode == 0, context
    resumed = re.search(r"resume step=(\d+) ", proc.stdout)  # the step the stopped ranks saved
    assert resumed and 100 <= int(resumed[1]) < 300, context
    final = proc.stdout.strip().splitlines()[-1]
    # Restarts 0: the deleted pod is a stop, and the script saves the step in flight on SIGTERM.
    assert re.search(r"\bSucceeded\b", final) and re.search(r"\b300/300\s+\S+\s+0 \(1 stop\)\s", final), context
    checkpoint = k8s / "nodes" / "pvc" / "default" / "paratrain-checkpoints" / "own-script" / "latest.pt"
    assert checkpoint.is_file(), context


@pytest.mark.parametrize("command", ["test-cluster.sh up /tmp/k8s --nodes 2",
                                     "kubectl apply -f examples/shakespeare-long.yaml",
                                     "kubectl delete pod shakespeare-long-0-1", "python -m paratrain_operator",
                                     "kubectl wait --for condition=established crd/paralleltrainjobs"])
def test_the_walkthrough_block_holds_its_steps(command):
    assert command in walkthrough_block()
