"""Prometheus metrics (`/metrics` on the operator's metrics port). No per-job labels: bounded cardinality."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from paratrain.api.status import PHASES

JOBS = Gauge("paratrain_jobs", "ParallelTrainJobs this operator serves, by phase", ["phase"])
RECONCILE_SECONDS = Histogram("paratrain_reconcile_duration_seconds", "Time of one reconcile pass of one job",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RECONCILE_ERRORS = Counter("paratrain_reconcile_errors_total", "Reconcile passes that failed (and will be retried)")
UNDECODABLE = Counter("paratrain_undecodable_objects_total",
                      "Watch events (jobs, pods) skipped because the operator will not decode them: nested too deep, "
                      "too large, not JSON")
GANG_RESTARTS = Counter("paratrain_gang_restarts_total", "Whole-gang restarts after a retryable pod failure",
                        ["namespace"])

_phases: dict[tuple[str, str], str] = {}
for _phase in PHASES:
    JOBS.labels(_phase).set(0)


def _publish() -> None:
    for phase in PHASES:
        JOBS.labels(phase).set(sum(p == phase for p in _phases.values()))


def record_phase(namespace: str, name: str, phase: str) -> None:
    if _phases.get((namespace, name)) != phase:
        _phases[(namespace, name)] = phase
        _publish()


def forget(namespace: str, name: str) -> None:
    if _phases.pop((namespace, name), None) is not None:
        _publish()


def serve(port: int) -> None:
    start_http_server(port)
