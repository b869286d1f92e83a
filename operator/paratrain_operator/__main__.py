"""`python -m paratrain_operator`: run the operator (what the Helm chart's Deployment runs).

    python -m paratrain_operator                      # every namespace
    python -m paratrain_operator --namespace team-a   # only these (repeatable)
    python -m paratrain_operator --leader-elect       # one of several replicas: acts only while it holds the Lease

Liveness is served at --liveness (default http://0.0.0.0:8080/healthz), Prometheus metrics at
http://0.0.0.0:--metrics-port/metrics (default 9090; 0 turns them off). Credentials: the pod's service account
in a cluster, else $KUBECONFIG / ~/.kube/config. The RBAC it needs is in `paratrain_operator.rbac`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import urllib.parse
from pathlib import Path

from .kube import DEFAULT_BURST, DEFAULT_QPS

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_namespace() -> str:
    """The namespace this pod runs in (its service account's), else $POD_NAMESPACE, else `default`."""
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return os.environ.get("POD_NAMESPACE", "default")


async def stand_by(args: argparse.Namespace) -> None:
    """Wait for the Lease, answering liveness meanwhile (a standby is healthy); returns once this replica leads.
    The API client lives on this loop only: kopf's loop gets its own."""
    import aiohttp.web

    from . import kube, leader

    url = urllib.parse.urlsplit(args.liveness)
    app = aiohttp.web.Application()
    app.router.add_get(url.path or "/", lambda _: aiohttp.web.json_response({"standby": True}))
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, url.hostname, url.port or 80).start()
    # The Lease's own client: no rate limit (one request every 2 s), connections of its own. Its session belongs
    # to this loop; kopf's loop opens another on the first renewal.
    lease_api = kube.Kube.from_environment(qps=0)
    try:
        leader.elector = leader.Elector(lease_api, args.lease_namespace or own_namespace(), args.lease_name,
                                        lease_seconds=args.lease_seconds,
                                        renew_deadline=args.lease_seconds * 0.7,
                                        retry_seconds=min(2.0, args.lease_seconds / 5))
        await leader.elector.acquire()
    finally:
        await lease_api.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain_operator", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="serve only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("PARATRAIN_METRICS_PORT", "9090")))
    parser.add_argument("--resync-seconds", type=float,
                        default=float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10")),
                        help="how often each job is reconciled and its progress polled without any event")
    parser.add_argument("--progress-seconds", type=float,
                        default=float(os.environ.get("PARATRAIN_PROGRESS_SECONDS", "30")),
                        help="at most one status write a job for training progress alone in this many seconds "
                             "(rank 0 is still read every resync; phase and condition changes are written at once)")
    parser.add_argument("--qps", type=float, default=float(os.environ.get("PARATRAIN_QPS", DEFAULT_QPS)),
                        help="API requests a second, on average (client-side rate limit; 0: none)")
    parser.add_argument("--burst", type=int, default=int(os.environ.get("PARATRAIN_BURST", DEFAULT_BURST)),
                        help="API requests at once above --qps")
    parser.add_argument("--write-concurrency", type=int,
                        default=int(os.environ.get("PARATRAIN_WRITE_CONCURRENCY", "64")),
                        help="pod creates or deletes in flight at once for one job (they start at 1 and double)")
    parser.add_argument("--leader-elect", action="store_true",
                        help="run as one of several replicas: act only while holding a coordination.k8s.io Lease")
    parser.add_argument("--lease-name", default="paratrain-operator", help="the Lease's name")
    parser.add_argument("--lease-namespace", default="",
                        help="the Lease's namespace (default: the operator's own)")
    parser.add_argument("--lease-seconds", type=float, default=10.0,
                        help="how long a Lease not renewed stays held: a standby takes over about this long after "
                             "the leader stops renewing")
    parser.add_argument("--platform", metavar="FILE", default=os.environ.get("PARATRAIN_PLATFORM", ""),
                        help="the platform's choices for every job: host access jobs may ask for, the gangs' "
                             "NetworkPolicy (paratrain.api.platform; the Helm chart writes it from its values)")
    parser.add_argument("--paged-lists", action="store_true",
                        default=os.environ.get("PARATRAIN_PAGED_LISTS", "") not in ("", "0"),
                        help="list jobs and pods page by page even where the API server streams lists "
                             "(sendInitialEvents); the default streams them where it can, one object at a time")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    # The handlers module reads these at import (kopf fixes a timer's interval when it is declared).
    os.environ["PARATRAIN_METRICS_PORT"] = str(args.metrics_port)
    os.environ["PARATRAIN_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["PARATRAIN_PROGRESS_SECONDS"] = str(args.progress_seconds)
    os.environ["PARATRAIN_QPS"], os.environ["PARATRAIN_BURST"] = str(args.qps), str(args.burst)
    os.environ["PARATRAIN_NAMESPACES"] = ",".join(args.namespace)
    os.environ["PARATRAIN_WRITE_CONCURRENCY"] = str(args.write_concurrency)
    os.environ["PARATRAIN_PLATFORM"] = args.platform
    os.environ["PARATRAIN_PAGED_LISTS"] = "1" if args.paged_lists else ""

    import kopf

    from . import handlers  # noqa: F401 (registers the handlers)

    kopf.configure(verbose=args.verbose)
    if args.leader_elect:
        asyncio.run(stand_by(args))
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
