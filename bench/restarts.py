"""Time from a rank's crash to the first training step after it: an in-place restart (spec.restartPolicy.inPlaceLimit:
every pod's agent restarts its workers in the same pods) against a whole-gang restart (every pod deleted and
created again); and from a pod's deletion to the first step after it, where only that pod is replaced (its peers'
ranks wait in place); and from a rank that hangs while alive (spec.restartPolicy.hangSeconds: its agent sees
its heartbeat go stale and ends the round in node 0's store) to the first step after it, in place; measured side
by side in one run.

    .venv/bin/python bench/restarts.py [--nodes 2] [--repeats 3]

On the real control plane (scripts/testbin.sh builds it) with the operator and the try-out kubelet (pods run as
local processes of this checkout, CPU/gloo): the tests' Shakespeare-sized stand-in, a `--nodes`-pod job with a
checkpoint every 10 steps, whose rank 1 exits 1 after step 25 (the reliability faults' `exit_at`, which logs the
time of its exit). Rank 0's progress endpoint is polled every 50 ms; the restart's time runs from the crash to the
first report of a step past the step resumed from. The single-pod kind deletes pod 1 (as a drain or `kubectl delete
pod` does: its ranks and their peers save the step in flight) once rank 0 reports step 25, and its time runs
from that delete. The hang kind's rank 1 sleeps, alive, after step 25 (the faults' `hang_at`, which logs when),
under hangSeconds 10 and a 120 s collective timeout; its time runs from the hang, so it includes hangSeconds.
Also counted: the pods created for the job.

Then what each kind costs the API server, on a `--api-pods`-pod gang of hollow pods (support/hollow.py: the real
kube-scheduler binds them, nothing runs; 0 skips it): the operator's requests through a counting proxy from the
restart's cause until the job is Running again and quiet — in place: rank 0's report of an in-place round (the
hollow progress endpoint says so); single pod: one pod deleted; whole gang: one pod failing with exit 1.

Writes bench/results/restarts.json and its section of docs/benchmarks.md.

    .venv/bin/python bench/restarts.py --resizes 2

measures an elastic gang's resizes instead (spec.elastic; bench/results/resizes.json, its own section): four
try-out nodes with room for one pod each, a 4-pod job (waitSeconds 10, a checkpoint every 20 steps, each step
slowed to 0.08 s so that it trains through both resizes); the gang's start (submission to its first step) beside
a shrink (pod 3's node cordoned and the pod deleted at step 30, to the 2-pod gang's first step: waitSeconds
included) and a growth (the node uncordoned, to the 4-pod gang's first step: the placeholders' start and the
stop at the step in flight included), and the steps each lost.
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
from tests.operator.support.scale import ScaleRig  # noqa: E402
from tests.reliability.gang import FAULTS  # noqa: E402
from tests.support.control_plane import ControlPlane, wait_for  # noqa: E402

CRASH_STEP, STEPS, INTERVAL, HANG_SECONDS = 25, 60, 10, 10
KINDS = {"in place": 2, "single pod": 2, "whole gang": 0, "a rank hangs": 2}  # → spec.restartPolicy.inPlaceLimit


def job_spec(nodes: int, checkpoints: Path, in_place_limit: int, hang: bool) -> dict[str, Any]:
    return {"nodes": nodes, "parallelism": {"data": nodes},
            "model": {"layers": 1, "heads": 2, "embedDim": 32, "blockSize": 16, "vocabSize": 64},
            "training": {"steps": STEPS, "batchSize": 2 * nodes, "warmupSteps": 1, "evalInterval": STEPS,
                         "evalSteps": 1},
            "checkpoint": {"path": str(checkpoints), "interval": INTERVAL},
            # a hung rank is found by its heartbeat, not by its peers' collective timing out
            "runPolicy": {"backoffLimit": 2, "collectiveTimeoutSeconds": 120 if hang else 30},
            "restartPolicy": {"inPlaceLimit": in_place_limit, **({"hangSeconds": HANG_SECONDS} if hang else {})}}


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
    hang = kind == "a rank hangs"
    fault = {} if kind == "single pod" else {
        "PARATRAIN_TEST_FAULT": f"hang_at:1:{CRASH_STEP}" if hang else f"exit_at:1:{CRASH_STEP}:1:1",
        "PYTHONPATH": str(FAULTS), "PARATRAIN_TEST_FAULT_LOG": str(crash_log)}
    cluster = RealCluster(plane, workdir, node=f"bench-{run}", extra_env=fault)
    try:
        namespace = cluster.namespace(f"restarts-{run}")
        cluster.submit(namespace, "bench", job_spec(nodes, workdir / "ckpt", KINDS[kind], hang))
        resumed_at = None
        deadline = time.monotonic() + 300
        while resumed_at is None and time.monotonic() < deadline:
            seen = rank0_report(cluster, namespace)
            if seen and kind == "single pod" and not crash_log.exists() and seen[1].get("step", 0) >= CRASH_STEP:
                crash_log.write_text(f"{time.time()}\n")
                cluster.api.delete("v1/pods", namespace, contract.pod_name("bench", 0, 1))
            elif seen and crash_log.exists():
                attempt, progress = seen
                after_crash = attempt > 0 or progress.get("restartsInPlace", 0) > 0
                if after_crash and progress.get("step", 0) > (progress.get("startStep") or 0):
                    resumed_at = time.time()
            time.sleep(0.05)
        assert resumed_at is not None, f"{kind}: no step after the crash within 300 s"
        crashed_at = float(crash_log.read_text().split()[0])
        status = cluster.wait_phase(namespace, "bench", "Succeeded", 240)
        return {"seconds": round(resumed_at - crashed_at, 2), "pods_created": len(cluster.pod_creations(namespace)),
                "gang_restarts": status["restarts"], "in_place_restarts": status.get("inPlaceRestarts", 0),
                "pod_replacements": status.get("podReplacements", 0)}
    finally:
        cluster.close()


RESIZE_WAIT, ONE_POD = 10, {"cpu": "1", "memory": "4Gi", "pods": "8"}  # a trainer pod requests 1 CPU


def first_step(cluster: RealCluster, namespace: str, attempt: int, timeout: float) -> float:
    """When rank 0 of attempt `attempt` (or a later one) first reports a step past the one it resumed from."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = rank0_report(cluster, namespace)
        if seen and seen[0] >= attempt and seen[1].get("step", 0) > (seen[1].get("startStep") or 0):
            return time.time()
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} trained no step within {timeout} s")


def one_resize(plane: ControlPlane, workdir: Path, run: int) -> dict[str, Any]:
    """One elastic gang's start, shrink and growth (the module docstring), in seconds."""
    workdir.mkdir(parents=True)
    slow = {"PARATRAIN_TEST_FAULT": "slow_steps:0.08", "PYTHONPATH": str(FAULTS)}
    cluster = RealCluster(plane, workdir, node=f"resize-{run}-0", capacity=ONE_POD, extra_env=slow)
    try:
        for i in (1, 2, 3):
            cluster.add_node(f"resize-{run}-{i}", ONE_POD)
        namespace = cluster.namespace(f"resizes-{run}")
        spec = job_spec(4, workdir / "ckpt", 2, hang=False)
        spec["training"] |= {"steps": 700, "batchSize": 8, "evalInterval": 700}
        spec["checkpoint"]["interval"] = 20
        spec["elastic"] = {"minNodes": 2, "waitSeconds": RESIZE_WAIT}
        submitted = time.time()
        cluster.submit(namespace, "bench", spec)
        started = first_step(cluster, namespace, 0, 180)
        wait_for(lambda: (rank0_report(cluster, namespace) or (0, {}))[1].get("step", 0) >= 30, 120, "step 30")
        lost = cluster.api.object("v1/pods", namespace, contract.pod_name("bench", 0, 3))["spec"]["nodeName"]
        cluster.cordon(lost)
        lost_at = time.time()
        cluster.api.delete("v1/pods", namespace, contract.pod_name("bench", 0, 3))
        shrunk = first_step(cluster, namespace, 1, 180)
        cluster.cordon(lost, unschedulable=False)
        returned = time.time()
        grown = first_step(cluster, namespace, 2, 180)
        status = cluster.wait_phase(namespace, "bench", "Succeeded", 300)
        shrink, grow = status["resizes"]
        return {"start_seconds": round(started - submitted, 2), "shrink_seconds": round(shrunk - lost_at, 2),
                "grow_seconds": round(grown - returned, 2), "shrink_steps_lost": shrink.get("stepsLost"),
                "grow_steps_lost": grow.get("stepsLost"), "sizes": [(r["fromNodes"], r["toNodes"]) for r in
                                                                    status["resizes"]]}
    finally:
        cluster.close()


def resize_table(results: dict[str, Any]) -> list[str]:
    rows, median = results["runs"], results["median"]

    def runs(key: str) -> str:
        return ", ".join(str(r[key]) for r in rows)

    beyond = median["shrink_seconds"] - RESIZE_WAIT
    return [f"An elastic gang's resizes, 4 one-pod try-out nodes (`bench/restarts.py --resizes {len(rows)}`, median "
            f"of {len(rows)}; {results['machine']}): seconds to the new gang's first step, beside the gang's own start.",
            "", "| | seconds (median) | runs | steps lost |", "|---|---|---|---|",
            f"| start: 4 pods, submission to the first step | {median['start_seconds']} | {runs('start_seconds')} | |",
            f"| shrink 4 → 2: node lost (cordoned, pod deleted) to the first step | {median['shrink_seconds']} | "
            f"{runs('shrink_seconds')} | {runs('shrink_steps_lost')} |",
            f"| grow 2 → 4: node back (uncordoned) to the first step | {median['grow_seconds']} | "
            f"{runs('grow_seconds')} | {runs('grow_steps_lost')} |",
            "", f"A shrink costs waitSeconds ({RESIZE_WAIT} s here) and then {beyond:.1f} s, "
            f"{beyond / median['start_seconds']:.1f}x the gang's own start; a growth {median['grow_seconds']:.1f} s, "
            f"{median['grow_seconds'] / median['start_seconds']:.1f}x (the placeholders' start, the shrunk gang's "
            "first step and waitSeconds since the shrink where not yet past, the stop at the step in flight, the new "
            "gang's start). Steps lost: 0 where the ranks saved the step in flight (a drained pod's peers do)."]


def resizes(plane: ControlPlane, workdir: Path, repeats: int, out: Path, no_doc: bool) -> None:
    runs = []
    for run in range(repeats):
        runs.append(one_resize(plane, workdir / f"resize-{run}", run))
        print(f"resize: {runs[-1]}", flush=True)
    results = {"machine": f"{platform.machine()}, {platform.python_version()}", "wait_seconds": RESIZE_WAIT,
               "runs": runs, "median": {key: round(statistics.median(r[key] for r in runs), 2)
                                        for key in ("start_seconds", "shrink_seconds", "grow_seconds")}}
    out.write_text(json.dumps(results, indent=1) + "\n")
    if not no_doc:
        write_section("resizes", resize_table(results))
    print("\n".join(resize_table(results)))


def api_costs(plane: ControlPlane, workdir: Path, pods: int) -> dict[str, Any]:
    """The operator's API requests for one restart of each kind of a `pods`-pod gang of hollow pods."""
    workdir.mkdir(parents=True)
    rig = ScaleRig(plane, workdir, nodes=-(-3 * pods // 128) + 1, progress=True)
    costs: dict[str, Any] = {}
    try:
        for kind in ("in place", "single pod", "whole gang"):  # a hang costs what an in-place round does
            limit = KINDS[kind]
            namespace = "api-" + kind.replace(" ", "-")
            rig.start(namespace, pods, restartPolicy={"inPlaceLimit": limit})
            mark, began = len(rig.proxy.log), time.monotonic()
            if kind == "in place":
                rank0 = next(p for p in rig.pods(namespace) if p["metadata"]["name"] == "gang-0-0")
                rig.hollow.progress.said[rank0["status"]["podIP"]] = {  # the new round's rank 0, resumed
                    "restartsInPlace": 1, "startStep": 0,
                    "lastFailure": {"rank": pods // 2, "nodeRank": pods // 2, "exitCode": 1}}
                done = lambda s: s.get("inPlaceRestarts") == 1  # noqa: E731
            elif kind == "single pod":
                rig.api.must(rig.api.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/gang-0-{pods // 2}"))
                done = lambda s: s.get("podReplacements") == 1 and s.get("phase") == "Running"  # noqa: E731
            else:
                rig.hollow.finish(namespace, f"gang-0-{pods // 2}", exit_code=1)
                done = lambda s: s.get("attempt") == 1 and s.get("phase") == "Running"  # noqa: E731
            wait_for(lambda: done(rig.status(namespace, "gang")), 300, f"{kind}: the job Running again")
            seconds = round(time.monotonic() - began, 2)
            rig.quiet(namespace, "gang")
            mine = [r for r in rig.proxy.log[mark:] if f"/namespaces/{namespace}/" in r[1]]
            pod_path = f"/api/v1/namespaces/{namespace}/pods"
            costs[kind] = {"requests": len(mine), "seconds_to_running": seconds,
                           "pod_creates": sum(r[0] == "POST" and r[1].split("?")[0] == pod_path for r in mine),
                           "pod_deletes": sum(r[0] == "DELETE" and r[1].startswith(pod_path + "/") for r in mine),
                           "status_writes": sum(r[0] == "PATCH" and r[1].split("?")[0].endswith("/status")
                                                for r in mine),
                           "events": sum(r[0] in ("POST", "PATCH") and "/events" in r[1] for r in mine)}
            print(f"{kind} at {pods} hollow pods: {costs[kind]}", flush=True)
    finally:
        rig.close()
    return costs


def table(results: dict[str, Any]) -> list[str]:
    rows = results["kinds"]
    gang, in_place = rows["whole gang"]["median_seconds"], rows["in place"]["median_seconds"]
    single = rows["single pod"]["median_seconds"]
    lines = [f"Crash (single pod: deletion) to the first step after it, {results['nodes']} pods on the try-out cluster "
             f"(`bench/restarts.py`, median of {results['repeats']}; {results['machine']}):", "",
             "| restart | seconds (median) | runs | pods created | gang restarts counted |", "|---|---|---|---|---|"]
    for kind, row in rows.items():
        lines.append(f"| {kind} | {row['median_seconds']} | {', '.join(map(str, row['seconds']))} | "
                     f"{row['pods_created']} | {row['gang_restarts']} |")
    lines += ["", f"In place is {gang / in_place:.1f}x faster than a whole-gang restart here, and creates no pod; a "
              f"single-pod replacement {gang / single:.1f}x, creating one pod."]
    if hung := rows.get("a rank hangs"):
        lines += ["", f"A rank hung while alive is restarted in place {hung['median_seconds'] - HANG_SECONDS:.2f} s "
                  f"after restartPolicy.hangSeconds ({HANG_SECONDS} s) ran out (the agent's one-second look, the "
                  "stacks' second, the new round's start); without hangSeconds it "
                  "would wait for the collective timeout (120 s here, 600 s by default) and restart the whole gang."]
    if costs := results.get("api_costs"):
        lines += ["", f"The operator's API requests for one restart of a {results['api_pods']}-pod gang of hollow pods "
                  "(from the cause until the job is Running again and the operator quiet; the real kube-scheduler "
                  "binds, nothing runs; seconds: until the status shows it, for in place the operator's next read "
                  "of rank 0's progress, every 10 s resync):", "",
                  "| restart | API requests | pod creates | pod deletes | status writes | events | seconds |",
                  "|---|---|---|---|---|---|---|"]
        for kind, row in costs.items():
            lines.append(f"| {kind} | {row['requests']} | {row['pod_creates']} | {row['pod_deletes']} | "
                         f"{row['status_writes']} | {row['events']} | {row['seconds_to_running']} |")
    return lines


def main() -> None:
    # The try-out kubelet runs the pods' command (`paratrain node`) from PATH: this environment's.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    parser = arguments(__doc__, "restarts")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--api-pods", type=int, default=256, help="the hollow gang's size for API costs (0: skip)")
    parser.add_argument("--resizes", type=int, default=0, help="measure an elastic gang's resizes this many times "
                        "instead (bench/results/resizes.json)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-restarts-"))
    plane = ControlPlane(workdir / "plane")
    if args.resizes:
        try:
            out = args.out if args.out.name != "restarts.json" else args.out.with_name("resizes.json")
            resizes(plane, workdir, args.resizes, out, args.no_doc)
        finally:
            plane.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.python_version()}",
                               "nodes": args.nodes, "repeats": args.repeats, "crash_step": CRASH_STEP, "kinds": {}}
    try:
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for repeat in range(args.repeats):  # the kinds alternate, so that a busy spell hits both
            for kind in KINDS:
                run = sum(len(r) for r in runs.values())
                runs[kind].append(one_restart(plane, workdir / f"run-{run}", kind, args.nodes, run))
                print(f"{kind}: {runs[kind][-1]}", flush=True)
        for kind, rows in runs.items():
            results["kinds"][kind] = {"seconds": [r["seconds"] for r in rows],
                                      "median_seconds": statistics.median(r["seconds"] for r in rows),
                                      "pods_created": rows[-1]["pods_created"],
                                      "gang_restarts": rows[-1]["gang_restarts"],
                                      "pod_replacements": rows[-1]["pod_replacements"]}
        if args.api_pods:
            results["api_pods"] = args.api_pods
            results["api_costs"] = api_costs(plane, workdir / "api", args.api_pods)
    finally:
        plane.close()
    shutil.rmtree(workdir, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_doc:
        write_section("restarts", table(results))
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
