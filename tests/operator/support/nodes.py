"""Try-out nodes for the test control plane (`scripts/test-cluster.sh up DIR --nodes N` starts this):

    .venv/bin/python -m tests.operator.support.nodes DIR --nodes 2 [--cwd REPO]

registers N nodes (node-0 … node-N-1) and serves each with the test kubelet (kubelet.py): every pod the scheduler
binds to one runs as a local process of this machine, in REPO (the trainer image's working directory, where the
examples' relative data paths lead), and `kubectl logs` reads its output. A PersistentVolumeClaim is bound at once
to a volume of its own, DIR/nodes/pvc/NAMESPACE/CLAIM on this machine, which every pod mounting the claim shares.

A try-out cluster: no images (each pod runs this checkout's `paratrain`), no isolation, no resource limits. Not for
production; kind (docs/kind.md) is a real one. It stops on SIGTERM (`test-cluster.sh down`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ...support.control_plane import KubeApi, register_node
from .kubelet import Kubelet, PodNetwork
from .real_cluster import MERGE_PATCH, NODE_CAPACITY, LogServer, NodeApi

PVC_POLL_SECONDS = 1.0


def bind_claims(api: KubeApi, root: Path) -> None:
    """Bind every pending claim to a hostPath volume made for it (what a provisioner and the binder would do)."""
    claims = api.must(api.get("/api/v1/persistentvolumeclaims"))["items"]
    for claim in claims:
        meta, spec = claim["metadata"], claim["spec"]
        if spec.get("volumeName"):
            continue
        ns, name = meta["namespace"], meta["name"]
        volume = f"pvc-{meta['uid']}"
        path = root / "pvc" / ns / name
        path.mkdir(parents=True, exist_ok=True)
        size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
        modes = spec.get("accessModes") or ["ReadWriteOnce"]
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
            "spec": {"capacity": {"storage": size}, "accessModes": modes, "hostPath": {"path": str(path)},
                     "persistentVolumeReclaimPolicy": "Retain",
                     "claimRef": {"namespace": ns, "name": name, "uid": meta["uid"]}}}
        created = api.create("/api/v1/persistentvolumes", body)
        if created.status not in (201, 409):
            api.must(created)
        api.must(api.request("PATCH", f"/api/v1/persistentvolumes/{volume}/status", {"status": {"phase": "Bound"}},
                             content_type=MERGE_PATCH))
        claim_path = f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}"
        # The annotation is how the scheduler tells a claim the binder has finished with from one it is binding.
        api.must(api.request("PATCH", claim_path, {
            "metadata": {"annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
            "spec": {"volumeName": volume}}, content_type=MERGE_PATCH))
        api.must(api.request("PATCH", claim_path + "/status", {
            "status": {"phase": "Bound", "accessModes": modes, "capacity": {"storage": size}}},
            content_type=MERGE_PATCH))


async def serve(directory: Path, nodes: int, cwd: Path) -> None:
    api = KubeApi(directory / "kubeconfig")
    loop = asyncio.get_running_loop()
    root = directory / "nodes"
    kubelets, node_apis, log_servers = [], [], []
    network = PodNetwork()
    for i in range(nodes):
        name = f"node-{i}"
        node_api = NodeApi(api, name, loop)
        logs = LogServer(node_api.pod_logs, directory / "pki")
        if api.get(f"/api/v1/nodes/{name}").ok:  # left by an earlier run
            api.request("DELETE", f"/api/v1/nodes/{name}")
        register_node(api, name, {"kubernetes.io/hostname": name}, NODE_CAPACITY, kubelet_port=logs.port)
        kubelets.append(Kubelet(node_api, root, node_name=name, default_cwd=cwd, network=network))
        node_apis.append(node_api)
        log_servers.append(logs)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    runs = [asyncio.create_task(k.run()) for k in kubelets]
    print(f"nodes: {', '.join(k.node_name for k in kubelets)} up; pods run in {cwd}", flush=True)
    while not stop.is_set():
        await asyncio.to_thread(bind_claims, api, root)
        try:
            await asyncio.wait_for(stop.wait(), PVC_POLL_SECONDS)
        except TimeoutError:
            pass
    for kubelet in kubelets:
        await kubelet.stop()
    for run in runs:
        run.cancel()
    for node_api, logs in zip(node_apis, log_servers, strict=True):
        node_api.stop()
        logs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="the test cluster's directory (test-cluster.sh up DIR)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cwd", type=Path, default=Path.cwd(), help="where pods run (default: here)")
    args = parser.parse_args()
    # Pods run `paratrain` (their image's entrypoint): this environment's, as an activated shell would find it.
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    asyncio.run(serve(args.directory.resolve(), args.nodes, args.cwd.resolve()))


if __name__ == "__main__":
    main()
