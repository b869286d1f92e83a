"""Time from a rank's crash to the first training step after it: an in-place restart (spec.restartPolicy.inPlaceLimit:
every pod's agent restarts its workers in the same pods) against a whole-gang restart (every pod deleted and
created again), measured side by side in one run.

    .venv/bin/python bench/restarts.py [--nodes 2] [--repeats 3]

On the real control plane (scripts/testbin.sh builds it) with the operator and the try-out kubelet (pods run as
local processes of this checkout, CPU/gloo): the tests' Shakespeare-sized stand-in, a `--nodes`-pod job with a
checkpoint every 10 steps, whose rank 1 exits 1 after step 25 (the reliability faults' `exit_at`, which logs the
time of its exit). Rank 0's progress endpoint is polled every 50 ms; the restart's time runs from the crash to the
first report of a step past the step resumed from. Also counted: the pods created for the job.

Writes bench/results/restarts.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives with the live tests' support code

from doc_section import arguments, write_section  # noqa: E402

from paratrain import contract  # noqa: E402
from tests.operator.support.real_cluster import RealCluster  # noqa: E402
from tests.reliability.gang import FAULTS  # noqa: E402
from tests.support.control_plane import ControlPlane  # noqa: E402

CRASH_STEP, STEPS, INTERVAL = 25, 60, 10
KINDS = {"in place": 2, "whole gang": 0}  # → spec.restartPolicy.inPlaceLimit


def job_spec(nodes: int, checkpoints: Path, in_place_limit: int) -> dict[str, Any]:
    return {"nodes": nodes, "parallelism": {"data": nodes},
            "model": {"layers": 1, "heads": 2, "embedDim": 32, "blockSize": 16, "vocabSize": 64},
            "training": {"steps": STEPS, "batchSize": 2 * nodes, "warmupSteps": 1, "evalInterval": STEPS,
                         "evalSteps": 1},
            "checkpoint": {"path": str(checkpoints), "interval": INTERVAL},
            "runPolicy": {"backoffLimit": 2, "collectiveTimeoutSeconds": 30},
            "restartPolicy": {"inPlaceLimit": in_place_limit}}


def rank0_report(cluster: RealCluster, namespace: str) -> tuple[int, dict[str, Any]] | None:
    """(attempt, progress) of the newest attempt's rank 0, when it answers."""
    pods = [p for p in cluster.pods(namespace) if p["metadata"]["labels"].get(contract.LABEL_NODE_RANK) == "0"
            and (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]
    if not pods:
        return None
    pod = max(pods, key=lambda p: int(p["metadata"]["labels"][contract.LABEL_ATTEMPT]))
    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{contract.PROGRESS_PORT}/progress",
                                    timeout=0.5) as answer:
            return int(pod["metadata"]["labels"][contract.LABEL_ATTEMPT]), json.loads(answer.read())
    except (OSError, ValueError):
        return None


def one_restart(plane: ControlPlane, workdir: Path, kind: str, nodes: int, run: int) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    crash_log = workdir / "crashes.txt"
    fault = {"PARATRAIN_TEST_FAULT": f"exit_at:1:{CRASH_STEP}:1:1", "PYTHONPATH": str(FAULTS),
             "PARATRAIN_TEST_FAULT_LOG": str(crash_log)}
    cluster = RealCluster(plane, workdir, node=f"bench-{run}", extra_env=fault)
    try:
        namespace = cluster.namespace(f"restarts-{run}")
        cluster.submit(namespace, "bench", job_spec(nodes, workdir / "ckpt", KINDS[kind]))
        resumed_at = None
        deadline = time.monotonic() + 300
        while resumed_at is None and time.monotonic() < deadline:
            seen = rank0_report(cluster, namespace)
            if seen and crash_log.exists():
                attempt, progress = seen
                after_crash = attempt > 0 or progress.get("restartsInPlace", 0) > 0
                if after_crash and progress.get("step", 0) > (progress.get("startStep") or 0):
                    resumed_at = time.time()
            time.sleep(0.05)
        assert resumed_at is not None, f"{kind}: no step after the crash within 300 s"
        crashed_at = float(crash_log.read_text().split()[0])
        status = cluster.wait_phase(namespace, "bench", "Succeeded", 240)
        return {"seconds": round(resumed_at - crashed_at, 2), "pods_created": len(cluster.pod_creations(namespace)),
                "gang_restarts": status["restarts"], "in_place_restarts": status.get("inPlaceRestarts", 0)}
    finally:
        cluster.close()


def table(results: dict[str, Any]) -> list[str]:
    rows = results["kinds"]
    gang, in_place = rows["whole gang"]["median_seconds"], rows["in place"]["median_seconds"]
    lines = [f"Crash to the first step after it, {results['nodes']} pods on the try-out cluster (`bench/restarts.py`, "
             f"median of {results['repeats']}; {results['machine']}):", "",
             "| restart | seconds (median) | runs | pods created | gang restarts counted |", "|---|---|---|---|---|"]
    for kind, row in rows.items():
        lines.append(f"| {kind} | {row['median_seconds']} | {', '.join(map(str, row['seconds']))} | "
                     f"{row['pods_created']} | {row['gang_restarts']} |")
    lines += ["", f"In place is {gang / in_place:.1f}x faster than a whole-gang restart here, and creates no pod."]
    return lines


def main() -> None:
    # The try-out kubelet runs the pods' command (`paratrain node`) from PATH: this environment's.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    parser = arguments(__doc__, "restarts")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-restarts-"))
    plane = ControlPlane(workdir / "plane")
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.python_version()}",
                               "nodes": args.nodes, "repeats": args.repeats, "crash_step": CRASH_STEP, "kinds": {}}
    try:
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for repeat in range(args.repeats):  # the kinds alternate, so that a busy spell hits both
            for kind in KINDS:
                run = len(runs["in place"]) + len(runs["whole gang"])
                runs[kind].append(one_restart(plane, workdir / f"run-{run}", kind, args.nodes, run))
                print(f"{kind}: {runs[kind][-1]}", flush=True)
        for kind, rows in runs.items():
            results["kinds"][kind] = {"seconds": [r["seconds"] for r in rows],
                                      "median_seconds": statistics.median(r["seconds"] for r in rows),
                                      "pods_created": rows[-1]["pods_created"],
                                      "gang_restarts": rows[-1]["gang_restarts"]}
    finally:
        plane.close()
    shutil.rmtree(workdir, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_doc:
        write_section("restarts", table(results))
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
