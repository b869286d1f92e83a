"""One tenant's weight against the shared operator: a 4,096-pod gang and 500 large jobs, measured side by side.

    .venv/bin/python bench/operator_tenants.py [--pods 4096] [--large-jobs 500] [--huge-jobs 100]

On the real control plane (scripts/testbin.sh builds it), with the operator behind the counting proxy and hollow
nodes, as bench/operator_scale.py runs it. Scenarios, in one run:
- small alone: a 1-pod job of another tenant on an idle operator: its CR's creation to its pod's create;
- big gang: a `--pods`-pod gang whose spec weighs 15 KB (4,096 x 15 KB: just under the default maxGangBytes,
  64 MiB): time to all pods created, the operator's CPU seconds and peak memory (VmHWM) over the create; once a
  quarter of it is created, the same small job of another tenant: its CR to its pod's create, beside "alone";
- large jobs: `--large-jobs` suspended jobs near the default maxSpecBytes (64 KiB), then `--huge-jobs` jobs of
  1 MiB of spec (refused, not kept): the operator's memory per job of each kind, and the API requests the refused
  ones cost afterwards.

Writes bench/results/operator_tenants.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives with the live tests' support code

from doc_section import write_section  # noqa: E402

from tests.operator.support.real_cluster import resource_path  # noqa: E402
from tests.operator.support.scale import JOBS, ScaleRig, cpu_seconds, proc_kib  # noqa: E402
from tests.support.control_plane import ControlPlane, wait_for  # noqa: E402

PODS_PER_NODE = 128
SPEC_NOTE_BYTES = 14_000  # per pod of the big gang: 4,096 of them come just under the default maxGangBytes


def first_pod_seconds(rig: ScaleRig, namespace: str, name: str) -> float:
    """Submit a 1-pod job; seconds from its CR's creation to its pod's create answered."""
    mark, began = len(rig.proxy.log), time.monotonic()
    rig.submit(namespace, name, 1)
    [post] = rig.wait_created(namespace, 1, since=mark)
    return round(post[5] - began, 3)


def big_gang(rig: ScaleRig, pods: int) -> dict[str, Any]:
    assert rig.operator and rig.operator.process
    pid = rig.operator.process.pid
    namespace = rig.plane.create_namespace("tenant-big")
    small = rig.plane.create_namespace("tenant-small-busy")
    rss_before, cpu_before = proc_kib(pid, "VmRSS"), cpu_seconds(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here: the create's peak
    mark, began = len(rig.proxy.log), time.monotonic()
    rig.submit(namespace, "gang", pods, pod={"annotations": {"note": "x" * SPEC_NOTE_BYTES}})
    phase = wait_for(lambda: rig.status(namespace, "gang").get("phase"), 60, "the big gang's first pass")
    assert phase != "Failed", rig.status(namespace, "gang")
    rig.wait_created(namespace, pods // 4, since=mark)
    small_busy = first_pod_seconds(rig, small, "small")
    posts = rig.wait_created(namespace, pods, since=mark)
    created = max(r[5] for r in posts) - began
    wait_for(lambda: rig.status(namespace, "gang").get("phase") == "Running", 600, "the big gang Running",
             interval=1)
    return {"pods": pods, "spec_note_bytes": SPEC_NOTE_BYTES, "seconds_to_all_created": round(created, 1),
            "operator_cpu_seconds": round(cpu_seconds(pid) - cpu_before, 1),
            "rss_mib_before": round(rss_before / 1024, 1),
            "peak_rss_mib": round(proc_kib(pid, "VmHWM") / 1024, 1),
            "rss_mib_running": round(proc_kib(pid, "VmRSS") / 1024, 1),
            "small_job_seconds_during": small_busy}


def large_jobs(rig: ScaleRig, count: int, huge: int, window: float) -> dict[str, Any]:
    """`count` suspended jobs near the default maxSpecBytes (56 KB of spec, 40 KB of annotations), then `huge` jobs
    of 1 MiB of spec (etcd takes 1.5 MiB): the operator's memory per job of each kind, and what the refused ones
    cost afterwards (kopf cannot store its handler state for them: a 1 MiB copy in annotations is refused)."""
    assert rig.operator and rig.operator.process
    pid = rig.operator.process.pid
    namespace, big = rig.plane.create_namespace("tenant-large"), rig.plane.create_namespace("tenant-huge")

    def submit(ns: str, name: str, env_values: int, annotations: int) -> int:
        doc = {"apiVersion": JOBS.rsplit("/", 1)[0], "kind": "ParallelTrainJob",
               "metadata": {"name": name, "namespace": ns,
                            "annotations": {f"tenant.example/note-{i}": "y" * 20_000 for i in range(annotations)}},
               "spec": {"nodes": 1, "parallelism": {"data": 1}, "training": {"batchSize": 4},
                        "runPolicy": {"suspend": True},
                        "pod": {"env": [{"name": f"NOTE_{i}", "value": "x" * 28_000} for i in range(env_values)]}}}
        rig.api.must(rig.api.request("POST", resource_path(JOBS, ns), doc))
        return len(json.dumps(doc, separators=(",", ":")))

    def phases(ns: str) -> list[str]:
        return [j.get("status", {}).get("phase") for j in rig.api.must(rig.api.get(resource_path(JOBS, ns)))["items"]]
    rss_before = proc_kib(pid, "VmRSS")
    sizes = [submit(namespace, f"large-{i}", 2, 2) for i in range(count)]
    wait_for(lambda: phases(namespace).count("Suspended") == count, 900, f"{count} large jobs Suspended", interval=2)
    time.sleep(2 * rig.resync_seconds)
    rss_large = proc_kib(pid, "VmRSS")
    # In two rounds: what a round leaves that the next one reuses is the allocator's high-water mark, not jobs kept.
    rounds, huge_sizes = [], []
    for first in (0, huge):
        huge_sizes += [submit(big, f"huge-{i}", 38, 0) for i in range(first, first + huge)]
        wait_for(lambda: phases(big).count("Failed") == first + huge, 900, "the huge jobs Failed", interval=2)
        time.sleep(2 * rig.resync_seconds)
        rounds.append(proc_kib(pid, "VmRSS"))
    mark = len(rig.proxy.log)
    time.sleep(window)
    churn = [r for r in rig.proxy.log[mark:] if f"/namespaces/{big}/" in r[1] and "watch=true" not in r[1]]
    message = rig.status(big, "huge-0")["failure"]["message"]
    return {"jobs": count, "job_bytes": round(sum(sizes) / len(sizes)), "huge_jobs": huge,
            "huge_job_bytes": round(sum(huge_sizes) / len(huge_sizes)),
            "rss_mib_before": round(rss_before / 1024, 1), "rss_mib_large": round(rss_large / 1024, 1),
            "rss_mib_huge_rounds": [round(r / 1024, 1) for r in rounds],
            "kib_per_large_job": round((rss_large - rss_before) / count, 1),
            "requests_per_huge_job_per_minute": round(len(churn) / (2 * huge) / (window / 60), 2),
            "huge_message": message}


def table(r: dict[str, Any]) -> list[str]:
    big, large = r["big_gang"], r["large_jobs"]
    return [
        f"Measured on {r['machine']}, {r['nodes']} hollow nodes, the real control plane (1.37) "
        "(`.venv/bin/python bench/operator_tenants.py`).", "",
        "| scenario | figure |", "|---|---|",
        f"| {big['pods']:,}-pod gang, {big['spec_note_bytes'] // 1000} KB of annotations a pod (the default "
        f"maxGangBytes) | all created in {big['seconds_to_all_created']} s; operator CPU "
        f"{big['operator_cpu_seconds']} s; memory {big['rss_mib_before']} MiB before, peak "
        f"{big['peak_rss_mib']} MiB, {big['rss_mib_running']} MiB once running |",
        f"| another tenant's 1-pod job: CR → its pod created | alone {r['small_alone_seconds']} s; while the "
        f"{big['pods']:,}-pod gang is being created {big['small_job_seconds_during']} s "
        f"({round(big['small_job_seconds_during'] / max(r['small_alone_seconds'], 1e-3), 1)}x) |",
        f"| {large['jobs']} suspended jobs of {large['job_bytes'] // 1000} KB each (56 KB of spec, 40 KB of "
        f"annotations) | operator memory {large['rss_mib_before']} → {large['rss_mib_large']} MiB, "
        f"{large['kib_per_large_job']} KiB per job |",
        f"| then {large['huge_jobs']} jobs of {large['huge_job_bytes'] / 2**20:.2f} MiB (over maxSpecBytes) at once, "
        f"twice | operator memory {large['rss_mib_large']} → {large['rss_mib_huge_rounds'][0]} MiB after the first "
        f"{large['huge_jobs']}, {large['rss_mib_huge_rounds'][1]} MiB after the second; afterwards "
        f"{large['requests_per_huge_job_per_minute']} API requests per job per minute; each Failed: "
        f"{large['huge_message']} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=4096)
    parser.add_argument("--large-jobs", type=int, default=500)
    parser.add_argument("--huge-jobs", type=int, default=100)
    parser.add_argument("--window", type=float, default=60, help="seconds to count what the refused jobs cost")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator_tenants.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="operator-tenants-"))
    plane = ControlPlane(workdir / "plane")
    nodes = -(-(args.pods + 2) // PODS_PER_NODE) + 1
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.python_version()}", "nodes": nodes}
    try:
        rig = ScaleRig(plane, workdir, nodes=nodes, progress=True)
        try:
            rig.start("warm-up", 1)  # the API server's first job compiles the CRD's CEL rules: not counted
            results["small_alone_seconds"] = first_pod_seconds(rig, plane.create_namespace("tenant-small"), "small")
            print(f"small alone: {results['small_alone_seconds']} s", flush=True)
            results["big_gang"] = big_gang(rig, args.pods)
            print(f"big gang: {results['big_gang']}", flush=True)
            results["large_jobs"] = large_jobs(rig, args.large_jobs, args.huge_jobs, args.window)
            print(f"large jobs: {results['large_jobs']}", flush=True)
        finally:
            rig.close()
    finally:
        plane.close()
    shutil.rmtree(workdir)  # kept where the run failed: its logs
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=1) + "\n")
    write_section("operator_tenants", table(results))
    print(f"wrote {out} and docs/benchmarks.md")


if __name__ == "__main__":
    main()
