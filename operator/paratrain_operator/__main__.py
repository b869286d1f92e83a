"""`python -m paratrain_operator`: run the operator (what the Helm chart's Deployment runs).

    python -m paratrain_operator                      # every namespace
    python -m paratrain_operator --namespace team-a   # only these (repeatable)

Liveness is served at --liveness (default http://0.0.0.0:8080/healthz), Prometheus metrics at
http://0.0.0.0:--metrics-port/metrics (default 9090; 0 turns them off). Credentials: the pod's service account
in a cluster, else $KUBECONFIG / ~/.kube/config. The RBAC it needs is in `paratrain_operator.rbac`.
"""

from __future__ import annotations

import argparse
import os
import sys

from .kube import DEFAULT_BURST, DEFAULT_QPS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain_operator", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="serve only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("PARATRAIN_METRICS_PORT", "9090")))
    parser.add_argument("--resync-seconds", type=float,
                        default=float(os.environ.get("PARATRAIN_RESYNC_SECONDS", "10")),
                        help="how often each job is reconciled and its progress polled without any event")
    parser.add_argument("--qps", type=float, default=float(os.environ.get("PARATRAIN_QPS", DEFAULT_QPS)),
                        help="API requests a second, on average (client-side rate limit; 0: none)")
    parser.add_argument("--burst", type=int, default=int(os.environ.get("PARATRAIN_BURST", DEFAULT_BURST)),
                        help="API requests at once above --qps")
    parser.add_argument("--write-concurrency", type=int,
                        default=int(os.environ.get("PARATRAIN_WRITE_CONCURRENCY", "64")),
                        help="pod creates or deletes in flight at once for one job (they start at 1 and double)")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    # The handlers module reads these at import (kopf fixes a timer's interval when it is declared).
    os.environ["PARATRAIN_METRICS_PORT"] = str(args.metrics_port)
    os.environ["PARATRAIN_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["PARATRAIN_QPS"], os.environ["PARATRAIN_BURST"] = str(args.qps), str(args.burst)
    os.environ["PARATRAIN_NAMESPACES"] = ",".join(args.namespace)
    os.environ["PARATRAIN_WRITE_CONCURRENCY"] = str(args.write_concurrency)

    import kopf

    from . import handlers  # noqa: F401 (registers the handlers)

    kopf.configure(verbose=args.verbose)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
