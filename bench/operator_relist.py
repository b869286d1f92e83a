"""The operator's memory while it lists every labelled pod again, with some of them megabytes each (issue 42).

    .venv/bin/python bench/operator_relist.py [--pods 10000] [--oversized 40] [--oversized-bytes 1300000]

On the real control plane (scripts/testbin.sh builds it): `--pods` labelled pods that are never scheduled (no
scheduler serves them) are created, `--oversized` of them with an argument of `--oversized-bytes` '<' characters,
which the API server's JSON escapes to six bytes each (\\u003c): 7.8 MB a pod by default, about as large as etcd
lets a pod be. Their names sort first, so the first page of a paged list holds them all. Then, side by side:
- the operator streaming its lists (its default where the API server can: sendInitialEvents, one pod an event);
- the operator listing page by page (`--paged-lists`: 500 pods a page, each page read within 16 MiB, a page over
  it asked for again at half the size, the next ones at twice the size again);
- one page of 500 pods read and decoded whole, as the operator did before: a process of its own, measured alike.
For each operator: its pods watch's history is expired (the fault proxy answers its resume with 410 Gone), so it
lists everything again; the figure is its peak resident set (VmHWM, reset just before) and the relist's time.

Writes bench/results/operator_relist.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives with the live tests' support code

from doc_section import arguments, write_section  # noqa: E402

from paratrain import contract  # noqa: E402
from tests.operator.support.real_cluster import resource_path  # noqa: E402
from tests.operator.support.scale import ScaleRig, proc_kib  # noqa: E402
from tests.support.control_plane import ControlPlane, wait_for  # noqa: E402

NAMESPACE = "relist"
CHART_LIMIT_MIB = 512  # charts/paratrain/values.yaml: the operator container's memory limit
# One page read and decoded whole, as the operator's LIST once was (its own process, so its peak is its own).
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child's would be this bench's own peak.
OLD_PAGE = """
import json, sys, urllib.request
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.support.control_plane import KubeApi
def hwm():
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
api = KubeApi(Path({kubeconfig!r}))
before = hwm()
url = api.server + "/api/v1/namespaces/{namespace}/pods?labelSelector={label}&limit=500"
request = urllib.request.Request(url, headers=api._headers())
with urllib.request.urlopen(request, context=api.tls, timeout=300) as response:
    body = response.read()
page = json.loads(body)
print(json.dumps({{"bytes": len(body), "pods": len(page["items"]), "baseline_kib": before, "peak_kib": hwm()}}))
"""


def pod(name: str, job: str, rank: int, arg_bytes: int = 0) -> dict[str, Any]:
    args = ["<" * arg_bytes] if arg_bytes else ["--steps", "100"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {contract.LABEL_JOB: job, contract.LABEL_ATTEMPT: "0",
                                                  contract.LABEL_NODE_RANK: str(rank)}},
            "spec": {"schedulerName": "paratrain-relist", "containers": [
                {"name": "trainer", "image": "paratrain-trainer:bench", "args": args}]}}


def populate(rig: ScaleRig, pods: int, oversized: int, oversized_bytes: int) -> None:
    rig.plane.create_namespace(NAMESPACE)
    # "a-…" sorts before "old-…": the oversized pods come first in a list, all on its first page.
    specs = [pod(f"a-huge-0-{i}", "a-huge", i, oversized_bytes) for i in range(oversized)]
    specs += [pod(f"old-{i // 256}-0-{i % 256}", f"old-{i // 256}", i % 256) for i in range(pods - oversized)]

    def create(body: dict[str, Any]) -> None:
        rig.api.must(rig.api.request("POST", resource_path("v1/pods", NAMESPACE), body))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(create, specs))


def listed_lines(rig: ScaleRig) -> list[str]:
    return re.findall(r"pods \(all namespaces\): listed \d+ labelled pods \((?:streamed|paged)\)",
                      rig.log.read_text(errors="replace"))


def relist(rig: ScaleRig, paged: bool, expected: int) -> dict[str, Any]:
    """Start the operator (streaming or paged), let it list once, then expire its pods watch: the second list's
    peak RSS and time."""
    rig.start_operator(("--paged-lists",) if paged else ())
    assert rig.operator and rig.operator.process
    pid = rig.operator.process.pid
    first = len(listed_lines(rig))
    wait_for(lambda: len(listed_lines(rig)) > first, 600, "the operator's first list", interval=0.2)
    line = listed_lines(rig)[-1]
    assert f"listed {expected} " in line or int(re.search(r"listed (\d+)", line)[1]) >= expected, line
    time.sleep(2)
    rss_listed = proc_kib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here: the relist's peak
    mark, requests, began = len(listed_lines(rig)), len(rig.proxy.log), time.monotonic()
    rig.proxy.drop_watches("v1/pods", expire_history=True)
    wait_for(lambda: len(listed_lines(rig)) > mark, 600, "the relist", interval=0.05)
    seconds = time.monotonic() - began
    pages = [r for r in rig.proxy.log[requests:]
             if r[0] == "GET" and r[1].startswith("/api/v1/pods?") and "limit=" in r[1]]
    return {"mode": "paged" if paged else "streamed", "relist_seconds": round(seconds, 2),
            "rss_mib_listed": round(rss_listed / 1024, 1), "relist_peak_rss_mib": round(proc_kib(pid, "VmHWM") / 1024, 1),
            "page_requests": len(pages), "largest_answer_mib": round(max((r[3] for r in pages), default=0) / 2**20, 1)}


def old_page(rig: ScaleRig) -> dict[str, Any]:
    script = OLD_PAGE.format(root=str(ROOT), kubeconfig=str(rig.plane.kubeconfig), namespace=NAMESPACE,
                             label=contract.LABEL_JOB)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {"page_mib": round(found["bytes"] / 2**20, 1), "pods": found["pods"],
            "peak_rss_mib": round(found["peak_kib"] / 1024, 1),
            "peak_over_baseline_mib": round((found["peak_kib"] - found["baseline_kib"]) / 1024, 1)}


def main() -> None:
    parser = arguments(__doc__, "operator_relist")
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--oversized", type=int, default=40)
    parser.add_argument("--oversized-bytes", type=int, default=1_300_000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="operator-relist-"))
    plane = ControlPlane(workdir / "plane")
    try:
        rig = ScaleRig(plane, workdir, nodes=1)
        try:
            began = time.monotonic()
            populate(rig, args.pods, args.oversized, args.oversized_bytes)
            print(f"{args.pods} pods created in {time.monotonic() - began:.0f} s", flush=True)
            results: dict[str, Any] = {"machine": f"{platform.machine()}, {platform.python_version()}",
                                       "pods": args.pods, "oversized": args.oversized,
                                       "oversized_bytes": args.oversized_bytes}
            results["streamed"] = relist(rig, paged=False, expected=args.pods)
            print(results["streamed"], flush=True)
            results["paged"] = relist(rig, paged=True, expected=args.pods)
            print(results["paged"], flush=True)
            results["old_page"] = old_page(rig)
            print(results["old_page"], flush=True)
        finally:
            rig.close()
    finally:
        plane.close()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_doc:
        write_section("operator_relist", table(results))
    shutil.rmtree(workdir)  # kept where the run failed: its logs
    print(f"wrote {args.out}" + ("" if args.no_doc else " and docs/benchmarks.md"))


def table(r: dict[str, Any]) -> list[str]:
    s, p, o = r["streamed"], r["paged"], r["old_page"]
    escaped = r["oversized_bytes"] * 6 / 1e6
    return [f"Measured on {r['machine']}, the real control plane (1.37) (`.venv/bin/python bench/operator_relist.py`): "
            f"{r['pods']:,} labelled pods, {r['oversized']} of them with {r['oversized_bytes'] / 1e6:.1f} MB of '<' "
            f"in an argument ({escaped:.1f} MB each as the API server's JSON escapes it), then the operator's pods "
            "watch expired, so it lists them all again. The chart's memory limit is "
            f"{CHART_LIMIT_MIB} MiB.", "",
            "| relist | peak RSS during it | RSS before it | time | list requests | largest answer |",
            "|---|---|---|---|---|---|",
            f"| streamed (sendInitialEvents, the default) | **{s['relist_peak_rss_mib']} MiB** | "
            f"{s['rss_mib_listed']} MiB | {s['relist_seconds']} s | 1 watch | one pod an event |",
            f"| paged (`--paged-lists`, 16 MiB a page at most) | **{p['relist_peak_rss_mib']} MiB** | "
            f"{p['rss_mib_listed']} MiB | {p['relist_seconds']} s | {p['page_requests']} pages | "
            f"{p['largest_answer_mib']} MiB sent by the API server, read until the bound |",
            f"| one page of {o['pods']} pods read whole, as before (a process of its own) | "
            f"**{o['peak_rss_mib']} MiB** ({o['peak_over_baseline_mib']} MiB over its start) | | | 1 | "
            f"{o['page_mib']} MiB |", "",
            f"Ratios: the page read whole peaks at {o['peak_over_baseline_mib'] / max(s['relist_peak_rss_mib'] - s['rss_mib_listed'], 1):.0f}x "
            "the streamed relist's growth over its resting RSS; before, every start, failover and expired watch read "
            "such pages, 20 in a row."]


if __name__ == "__main__":
    main()
