"""The operator at cluster scale: what a gang of 1 to 1,024 pods costs the API server, measured side by side in one run.

    .venv/bin/python bench/operator_scale.py [--sizes 1,64,256,1024] [--steady-finished 200 --steady-running 500]
                                             [--history-pods 10000]

On the real control plane (scripts/testbin.sh builds it): the operator runs as its ServiceAccount behind a counting
proxy that records every request it makes (verb, path, bytes answered, start, end); hollow nodes registered through
the API let the real kube-scheduler bind the pods, and one thread plays their kubelets (Running at once; a deleted
pod goes at once). Nothing trains: the figures are the operator's and the API server's alone.

Scenarios:
- start: a gang of each size, `gang: none`: time from the CR's creation to every pod created; requests per pod;
  most pod POSTs in flight; the aftermath once all pods exist (passes, pod bytes read, job GETs, status PATCHes);
- the same 256-pod start with `--write-concurrency 1` (one create at a time, as before issue 14), with `--qps 0`
  (the client's rate limiter off) and with `gang: kubernetes` (Workload + PodGroup; the scheduler binds the gang
  whole);
- restart: one pod of the running 256-pod gang fails: time to the whole new gang created, and the passes after;
- steady: finished and running 1-pod jobs (rank 0 of each running one reporting progress on a hollow endpoint),
  left alone for a minute: API requests, status writes and progress reads per job per minute, operator CPU and RSS;
- history: 10,000 pods of earlier jobs kept in the cluster, then a relist of them all (the watch's history
  expired) by an operator listing page by page (`--paged-lists`): pages, time, the largest request, the operator's
  memory per cached pod and its peak (the default streamed relist, with oversized pods: bench/operator_relist.py).

Writes bench/results/operator_scale.json, bench/results/operator_scale.png and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives with the live tests' support code

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from doc_section import write_section  # noqa: E402

from paratrain import contract  # noqa: E402
from tests.operator.support.cluster import http  # noqa: E402
from tests.operator.support.real_cluster import resource_path  # noqa: E402
from tests.operator.support.scale import ScaleRig, Start, cpu_seconds, proc_kib  # noqa: E402
from tests.support.control_plane import ControlPlane, wait_for  # noqa: E402

PODS_PER_NODE = 128


def _stand_in_server(latency: float, port: Any) -> None:
    """An API server stand-in (its own process, so its CPU is not the client's): every pod POST is answered 201
    with the pod after `latency` seconds, without using CPU for the wait."""
    import aiohttp.web

    async def create(request: aiohttp.web.Request) -> aiohttp.web.Response:
        obj = await request.json()
        await asyncio.sleep(latency)
        obj["metadata"]["uid"] = obj["metadata"]["name"]
        return aiohttp.web.json_response(obj, status=201)

    async def serve() -> None:
        app = aiohttp.web.Application(client_max_size=16 << 20)
        app.router.add_post("/api/v1/namespaces/{namespace}/pods", create)
        runner = aiohttp.web.AppRunner(app, access_log=None)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
        port.value = runner.addresses[0][1]
        await asyncio.Event().wait()
    asyncio.run(serve())


def client_alone(pods: int, latency: float) -> dict[str, Any]:
    """The operator's own create path (apply.create_gang through kube.Kube, no rate limit) against a stand-in API
    server that answers every pod POST after `latency` seconds: how fast the client creates a gang when the server
    is not the bottleneck, one at a time and 64 in flight, and the CPU the client spends building each pod."""
    import multiprocessing

    import kubernetes

    from paratrain.api import parse_job
    from paratrain_operator import apply, kube, reconcile

    port = multiprocessing.Value("i", 0)
    server = multiprocessing.Process(target=_stand_in_server, args=(latency, port), daemon=True)
    server.start()
    wait_for(lambda: port.value, 30, "the stand-in API server")
    job = parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                     "metadata": {"name": "gang", "namespace": "client", "uid": "u"},
                     "spec": {"nodes": pods, "parallelism": {"data": pods}, "training": {"batchSize": pods}}})
    build = reconcile.GangBuild.of(job, "client", 0, tuple(range(pods)))

    async def timed(concurrency: int) -> float:
        configuration = kubernetes.client.Configuration()
        configuration.host = f"http://127.0.0.1:{port.value}"
        client = kube.connect(kube.Kube(configuration, qps=0))
        saved, apply.WRITE_CONCURRENCY = apply.WRITE_CONCURRENCY, concurrency
        try:
            began = time.monotonic()
            assert len(await apply.create_gang([], tuple(range(pods)), build.pods)) == pods
            return time.monotonic() - began
        finally:
            apply.WRITE_CONCURRENCY = saved
            await client.close()
    try:
        serial, concurrent = asyncio.run(timed(1)), asyncio.run(timed(64))
    finally:
        server.kill()
    began = time.process_time()
    build.pods(tuple(range(pods)))
    render_ms = (time.process_time() - began) / pods * 1000
    return {"pods": pods, "latency_seconds": latency, "serial_seconds": round(serial, 2),
            "concurrent_seconds": round(concurrent, 2), "speedup": round(serial / concurrent, 1),
            "render_ms_per_pod": round(render_ms, 2)}


def restart(rig: ScaleRig, namespace: str, size: int, name: str = "gang") -> dict[str, Any]:
    """Fail one pod of the running gang; time until the next attempt's pods all exist."""
    mark, began = len(rig.proxy.log), time.monotonic()
    rig.hollow.finish(namespace, f"{name}-0-{size // 2}", exit_code=1)
    prefix = f"/api/v1/namespaces/{namespace}/pods"
    posts = rig.wait_created(namespace, size, since=mark)
    done = max(r[5] for r in posts)
    passes = rig.passes(namespace, name)
    wait_for(lambda: rig.status(namespace, name).get("phase") == "Running", 300, "the new gang running")
    rig.quiet(namespace, name)
    deletes = [r for r in rig.proxy.log[mark:] if r[0] == "DELETE" and r[1].startswith(prefix + "/")]
    return {"pods": size, "seconds_to_new_gang_created": round(done - began, 3),
            "old_pods_deleted": len(deletes), "passes_after_new_gang": rig.passes(namespace, name) - passes}


def steady(rig: ScaleRig, finished: int, running: int, window: float) -> dict[str, Any]:
    """`finished` + `running` 1-pod jobs, then a quiet `window` of seconds: what each kind costs."""
    namespace = rig.plane.create_namespace("steady")
    for i in range(finished + running):
        rig.submit(namespace, f"job-{i}", 1)
    wait_for(lambda: sum(p.get("status", {}).get("phase") == "Running" for p in rig.pods(namespace))
             == finished + running, 600, "every steady job's pod running", interval=1)
    for i in range(finished):
        rig.hollow.finish(namespace, f"job-{i}-0-0", 0, json.dumps({"step": 10, "totalSteps": 10}))
    wait_for(lambda: sum(rig.status(namespace, f"job-{i}").get("phase") == "Succeeded" for i in range(finished))
             == finished, 600, "the finished jobs Succeeded", interval=1)
    time.sleep(2 * rig.resync_seconds)  # the last passes of the finish are over
    assert rig.operator and rig.operator.process
    pid, progress = rig.operator.process.pid, rig.hollow.progress
    mark, cpu, reads = len(rig.proxy.log), cpu_seconds(pid), sum(progress.reads.values()) if progress else 0
    time.sleep(window)
    cpu, reads = cpu_seconds(pid) - cpu, (sum(progress.reads.values()) if progress else 0) - reads
    seen = [r for r in rig.proxy.log[mark:] if f"/namespaces/{namespace}/" in r[1] and "watch=true" not in r[1]]

    def per_job_minute(first: int, count: int, method: str | None = None) -> float:
        names = {f"job-{i}" for i in range(first, first + count)}
        hits = sum(_job_of(r[1]) in names and method in (None, r[0]) for r in seen)
        return round(hits / max(count, 1) / (window / 60), 3)
    return {"finished_jobs": finished, "running_jobs": running, "window_seconds": window,
            "requests_per_finished_job_per_minute": per_job_minute(0, finished),
            "requests_per_running_job_per_minute": per_job_minute(finished, running),
            "status_writes_per_running_job_per_minute": per_job_minute(finished, running, "PATCH"),
            "progress_reads_per_running_job_per_minute": round(reads / max(running, 1) / (window / 60), 2),
            "requests_in_window": len(seen), "operator_cpu_percent": round(100 * cpu / window, 1),
            "operator_rss_mib": round(proc_kib(pid, "VmRSS") / 1024, 1)}


def history(rig: ScaleRig, count: int, template_namespace: str) -> dict[str, Any]:
    """`count` pods of earlier jobs kept in the cluster (a copy of a real gang pod each, never scheduled), then the
    pods watch's history expired: the operator lists them all again. Relist time, pages, the largest request,
    memory per cached pod and the relist's peak, beside one unpaged LIST of the same pods (made here)."""
    rig.start_operator(("--paged-lists",))  # pages, as measured here; streamed relists: bench/operator_relist.py
    assert rig.operator and rig.operator.process
    pid = rig.operator.process.pid
    wait_for(lambda: _cached(rig) > 0, 60, "the paged operator's first list", interval=1)
    namespace = rig.plane.create_namespace("history")
    template = rig.pods(template_namespace)[0]
    template["metadata"] = {"labels": template["metadata"]["labels"]}
    template["spec"] = {**template["spec"], "schedulerName": "paratrain-history"}  # no scheduler: never placed
    template["spec"].pop("nodeName", None)
    template.pop("status", None)
    cached_before, rss_before = _cached(rig), proc_kib(pid, "VmRSS")

    def create(i: int) -> None:
        job = f"old-{i // 256}"
        pod = {**template, "metadata": {"name": f"{job}-0-{i % 256}",
                                        "labels": {**template["metadata"]["labels"], contract.LABEL_JOB: job}}}
        rig.api.must(rig.api.request("POST", resource_path("v1/pods", namespace), pod))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(count)))
    wait_for(lambda: _cached(rig) >= cached_before + count, 600, f"{count} more pods cached", interval=1)
    rss_cached = proc_kib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here: the relist's peak
    mark = len(rig.proxy.log)
    # The drop must find the operator's pods watch open: between a stream's end and its reconnect there is none to
    # drop, and the reconnect, from the newest resourceVersion, is not expired (the full run once waited out the
    # operator's 300 s watch timeout so).
    dropped = wait_for(lambda: rig.proxy.drop_watches("v1/pods", expire_history=True), 30,
                       "an open pods watch to drop", interval=0.2)
    lists = wait_for(lambda: _relist(rig.proxy.log[mark:]), 300, "the relist", interval=0.2)
    began = time.monotonic()
    unpaged = rig.api.must(rig.api.get("/api/v1/pods", labelSelector=contract.LABEL_JOB))
    unpaged_seconds = time.monotonic() - began
    return {"pods": count, "cached_pods": _cached(rig), "watches_dropped": dropped, "pages": len(lists),
            "relist_seconds": round(lists[-1][5] - lists[0][4], 2),
            "largest_request_seconds": round(max(r[5] - r[4] for r in lists), 2),
            "largest_request_bytes": max(r[3] for r in lists), "relist_bytes": sum(r[3] for r in lists),
            "unpaged_list_seconds": round(unpaged_seconds, 2),
            "unpaged_list_bytes": len(json.dumps(unpaged, separators=(",", ":"))),
            "rss_mib_before": round(rss_before / 1024, 1), "rss_mib_cached": round(rss_cached / 1024, 1),
            "relist_peak_rss_mib": round(proc_kib(pid, "VmHWM") / 1024, 1)}


def _relist(entries: list[list[Any]]) -> list[list[Any]] | None:
    """The pages of the first pods LIST in `entries`, once the watch that follows it has opened (the list is done)."""
    pages: list[list[Any]] = []
    for entry in entries:
        if entry[0] == "GET" and entry[1].split("?")[0] == "/api/v1/pods":
            if "watch=true" not in entry[1]:
                pages.append(entry)
            elif pages:
                return pages
    return None


def _cached(rig: ScaleRig) -> int:
    """The operator's own count of cached pods (its liveness probe's answer)."""
    assert rig.operator
    body = http(f"http://127.0.0.1:{rig.operator.health_port}/healthz") or "{}"
    return int((json.loads(body).get("pods") or {}).get("cachedPods", 0))


def _job_of(path: str) -> str:
    """The job a request is about: /…/paralleltrainjobs/NAME[/status], or the job's pod (NAME-ATTEMPT-RANK)."""
    parts = path.split("?")[0].split("/")
    if "paralleltrainjobs" in parts and parts.index("paralleltrainjobs") + 1 < len(parts):
        return parts[parts.index("paralleltrainjobs") + 1]
    if "pods" in parts and parts.index("pods") + 1 < len(parts):
        return parts[parts.index("pods") + 1].rsplit("-", 2)[0]
    return ""


def plot(starts: list[Start], out: Path) -> None:
    sizes = [s.pods for s in starts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [s.seconds_to_all_created for s in starts], "o-", label="CR → all pods created")
    left.plot(sizes, [s.seconds_to_running for s in starts], "s--", label="CR → phase Running")
    left.set(xscale="log", xlabel="gang size (pods)", ylabel="seconds", title="Start time")
    left.legend()
    right.plot(sizes, [s.requests_per_pod for s in starts], "o-", label="operator requests per pod")
    right.plot(sizes, [s.aftermath_passes for s in starts], "s--", label="passes after the last create")
    right.set(xscale="log", xlabel="gang size (pods)", ylabel="count", title="API cost")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,64,256,1024")
    parser.add_argument("--steady-finished", type=int, default=200)
    parser.add_argument("--steady-running", type=int, default=500)
    parser.add_argument("--steady-window", type=float, default=60)
    parser.add_argument("--history-pods", type=int, default=10_000,
                        help="pods of earlier jobs kept in the cluster, then relisted (0: skip)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "operator_scale.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    plane = ControlPlane(workdir / "plane")
    try:
        run(plane, workdir, sizes, args)
    finally:
        plane.close()
    shutil.rmtree(workdir)  # kept where the run failed: its logs


def run(plane: ControlPlane, workdir: Path, sizes: list[int], args: argparse.Namespace) -> None:
    # Room for every scenario's pods at once (each start's gang keeps running), the restart's and the steady jobs'.
    total = sum(sizes) + (4 * 256 if 256 in sizes else 0) + args.steady_finished + args.steady_running
    nodes = -(-total // PODS_PER_NODE) + 1
    rig = ScaleRig(plane, workdir, nodes=nodes, progress=True)
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.python_version()}", "nodes": nodes}
    if 256 in sizes:  # before the control plane's load: the client alone
        results["client_alone_256"] = client_alone(256, latency=0.02)
        print(f"client alone: {results['client_alone_256']}", flush=True)
    try:
        rig.start("warm-up", 1)  # the API server's first job compiles the CRD's CEL rules (about 2 s): not counted
        starts = []
        for size in sizes:
            starts.append(rig.start(f"start-{size}", size))
            print(f"start {size}: {starts[-1]}", flush=True)
        results["start"] = [s.row() for s in starts]
        if 256 in sizes:
            results["restart"] = restart(rig, "start-256", 256)
            print(f"restart 256: {results['restart']}", flush=True)
            results["native_gang_256"] = rig.start("native-256", 256, scheduling={"gang": "kubernetes"}).row()
            print(f"native gang 256: {results['native_gang_256']}", flush=True)
            rig.start_operator(("--write-concurrency", "1"))
            results["serial_256"] = rig.start("serial-256", 256).row()
            print(f"serial 256: {results['serial_256']}", flush=True)
            rig.start_operator(("--qps", "0"))  # the client's own rate limiter off: what concurrency alone buys
            results["unlimited_256"] = rig.start("unlimited-256", 256).row()
            print(f"unlimited 256: {results['unlimited_256']}", flush=True)
            rig.start_operator()
            concurrent = next(s for s in starts if s.pods == 256)
            serial_seconds = results["serial_256"]["seconds_to_all_created"]
            results["creation_speedup_256"] = round(serial_seconds / concurrent.seconds_to_all_created, 2)
            results["creation_speedup_256_unlimited"] = round(
                serial_seconds / results["unlimited_256"]["seconds_to_all_created"], 2)
        results["steady"] = steady(rig, args.steady_finished, args.steady_running, args.steady_window)
        print(f"steady: {results['steady']}", flush=True)
        if args.history_pods:
            results["history"] = history(rig, args.history_pods, f"start-{max(sizes)}")
            print(f"history: {results['history']}", flush=True)
    finally:
        rig.close()
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(starts, out.with_suffix(".png"))
    write_section("operator_scale", table(results))
    print(f"wrote {out}, {out.with_suffix('.png')} and docs/benchmarks.md")


def table(r: dict[str, Any]) -> list[str]:
    lines = [f"Measured on {r['machine']}, {r['nodes']} hollow nodes, the real control plane (1.37) "
             "(`.venv/bin/python bench/operator_scale.py`). Plot: `bench/results/operator_scale.png`.", "",
             "| gang | CR → all pods created | CR → Running | requests / pod | pod POSTs in flight (max) | "
             "mean pod POST | passes after creation | pod bytes read after | status PATCHes after | "
             "watch bytes / gang bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(f"{s['pods']} pods", s) for s in r["start"]]
    rows += [(f"{r[k]['pods']} pods, {label}", r[k]) for k, label in
             (("native_gang_256", "`gang: kubernetes`"), ("serial_256", "`--write-concurrency 1`"),
              ("unlimited_256", "`--qps 0` (no client rate limit)")) if k in r]
    for label, s in rows:
        lines.append(f"| {label} | {s['seconds_to_all_created']:.2f} s | {s['seconds_to_running']:.2f} s | "
                     f"{s['requests_per_pod']} | {s['max_pod_posts_in_flight']} | "
                     f"{s.get('pod_post_seconds', 0) * 1000:.0f} ms | {s['aftermath_passes']} | "
                     f"{s['aftermath_pod_bytes_read']:,} | {s['aftermath_status_patches']} | "
                     f"{s['watch_bytes'] / max(s['gang_bytes'], 1):.1f} |")
    if "creation_speedup_256" in r:
        lines += ["", f"Concurrent creation of 256 pods is {r['creation_speedup_256']}x faster than one at a time "
                  "(same run)."]
    if "creation_speedup_256_unlimited" in r:
        serial, free = r["serial_256"], r["unlimited_256"]
        cores = free["cores_while_creating"]
        used = ", ".join(f"{name} {value:.2f}" for name, value in sorted(cores.items(), key=lambda kv: -kv[1]))
        lines += ["", f"With the client's rate limiter off, {r['creation_speedup_256_unlimited']}x. Where the time "
                  f"goes: one create takes the API server {serial['pod_post_seconds'] * 1000:.0f} ms alone and "
                  f"{free['pod_post_seconds'] * 1000:.0f} ms on average with up to "
                  f"{free['max_pod_posts_in_flight']} in flight. Cores used from the CR to the last create: {used} "
                  f"(in all {sum(cores.values()):.2f} of the machine's {os.cpu_count()}): the creates wait for CPU "
                  "that the API server shares with etcd, the operator, the counting proxy and the hollow kubelets "
                  "on this machine, not in the operator's client."]
    if "client_alone_256" in r:
        c = r["client_alone_256"]
        lines += ["", f"The operator's client alone (`apply.create_gang` through `kube.Kube`, no rate limit) against a "
                  f"stand-in server answering each pod POST after {c['latency_seconds'] * 1000:.0f} ms without "
                  f"using CPU: {c['pods']} pods in {c['serial_seconds']} s one at a time, {c['concurrent_seconds']} s "
                  f"with 64 in flight: {c['speedup']}x. With the server out of the way, the client's own CPU is "
                  f"the floor: building a pod takes {c['render_ms_per_pod']} ms (jinja2, then YAML parsed back, two "
                  "thirds of it), plus the request's encoding and aiohttp."]
    if "restart" in r:
        x = r["restart"]
        lines += ["", f"Restart of the {x['pods']}-pod gang (one pod fails): new gang created in "
                  f"{x['seconds_to_new_gang_created']:.2f} s, {x['old_pods_deleted']} old pods deleted, "
                  f"{x['passes_after_new_gang']} passes after it."]
    s = r["steady"]
    lines += ["", f"Steady state, {s['finished_jobs']} finished + {s['running_jobs']} running jobs over "
              f"{s['window_seconds']:.0f} s, every running job's rank 0 reporting progress (a hollow endpoint, "
              f"step +10 a second): {s['requests_per_finished_job_per_minute']} API requests per finished job per "
              f"minute; per running job {s['requests_per_running_job_per_minute']} API requests, of them "
              f"{s['status_writes_per_running_job_per_minute']} status writes (progress at most every 30 s), and "
              f"{s['progress_reads_per_running_job_per_minute']} progress reads (HTTP to the pod, every 10 s "
              f"resync). Operator CPU {s['operator_cpu_percent']}% of a core, RSS {s['operator_rss_mib']} MiB."]
    if "history" in r:
        h = r["history"]
        lines += ["", f"History: {h['pods']:,} pods of earlier jobs kept in the cluster (copies of a real gang pod), "
                  f"then the pods watch's history expired. The relist (`--paged-lists`; the default streams it, see "
                  f"the relist section): {h['pages']} pages of at most 500 pods in "
                  f"{h['relist_seconds']:.2f} s ({h['relist_bytes'] / 2**20:.0f} MiB); its largest request took "
                  f"{h['largest_request_seconds']:.2f} s for {h['largest_request_bytes'] / 2**20:.1f} MiB, where one "
                  f"unpaged LIST of the same pods (as before) takes {h['unpaged_list_seconds']:.2f} s for "
                  f"{h['unpaged_list_bytes'] / 2**20:.0f} MiB in one answer, against the client's 30 s timeout. "
                  f"Operator RSS {h['rss_mib_before']} MiB before them, {h['rss_mib_cached']} MiB with "
                  f"{h['cached_pods']:,} pods cached, peak during the relist {h['relist_peak_rss_mib']} MiB (the "
                  "chart's limit: 512 MiB)."]
    return lines


if __name__ == "__main__":
    main()
