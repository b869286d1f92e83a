"""The README's try-out cluster walkthrough, run as written: `test-cluster.sh up --nodes 2` (the test kubelet as a
process), the CRD and the checkpoint claim, the operator as a local process, `examples/shakespeare.yaml` applied
unchanged, a pod deleted after its first checkpoint, the gang restarting and resuming, the job succeeding.

The block's lines run in one bash session, in this checkout, with /tmp/k8s replaced by a temporary directory. Only
the interactive waits change: the `-w` watch becomes "wait until step 200", and each later look waits for what
it shows (the restarted pod's log, the job's end)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ..support import control_plane

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
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


def test_the_readme_walkthrough_trains_restarts_and_resumes_on_the_try_out_cluster(tmp_path):
    control_plane.testbin()  # its binaries, built by `bash scripts/testbin.sh` (the suite's first run builds them)
    script = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT", "JOB=shakespeare", WAITS]
    for line in walkthrough_block().splitlines():
        command = line.split("  #")[0].rstrip().replace("/tmp/k8s", str(tmp_path / "k8s"))
        if "kubectl get ptj shakespeare -w" in command:
            script.append("wait_until 300 step_at_least 200")
            continue
        if command.startswith("kubectl logs shakespeare-1-0"):
            script.append("wait_until 300 logged_resume")
        if command == "kubectl get ptj shakespeare":
            script.append("wait_until 300 succeeded")
        script.append(command)
    assert any("python -m paratrain_operator" in line for line in script)
    proc, context = run_on_a_try_out_cluster(script, tmp_path)
    assert proc.returncode == 0, context
    # The restarted rank 0's log: from the step the deleted pod's ranks were stopped at (after the README's wait for
    # step 250), saved then.
    resumed = re.search(r"resume step=(\d+)\b", proc.stdout)
    assert resumed and 250 <= int(resumed[1]) < 600, context
    final = proc.stdout.strip().splitlines()[-1]  # `kubectl get ptj shakespeare`: its printer columns
    # Restarts 0, and the stop shown beside it: the deleted pod restarted the gang, not counted.
    assert re.search(r"\bSucceeded\b", final) and re.search(r"\b600/600\s+\S+\s+0 \(1 stop\)\s", final), context
    checkpoints = tmp_path / "k8s" / "nodes" / "pvc" / "default" / "paratrain-checkpoints" / "shakespeare"
    assert (checkpoints / "step-00000600").is_dir() and (checkpoints / "step-00000400").is_dir(), context


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


@pytest.mark.parametrize("command", ["test-cluster.sh up /tmp/k8s --nodes 2", "kubectl apply -f examples/shakespeare",
                                     "kubectl delete pod shakespeare-0-1", "python -m paratrain_operator",
                                     "kubectl wait --for condition=established crd/paralleltrainjobs"])
def test_the_walkthrough_block_holds_its_steps(command):
    assert command in walkthrough_block()
