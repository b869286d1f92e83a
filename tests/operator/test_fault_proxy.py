"""The fault proxy (support/fault_proxy.py) on the real control plane: requests pass through as the client's own
identity, faults hit only the matching requests, and watch streams
are passed on, silenced, dropped and expired as the live fault tests need."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import pytest

from ..support.control_plane import KubeApi, wait_for
from .support.fault_proxy import FaultProxy
from .support.real_cluster import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, operator_kubeconfig

pytestmark = pytest.mark.timeout(120)
NS = "fault-proxy"
CMS = f"/api/v1/namespaces/{NS}/configmaps"


@pytest.fixture(scope="module")
def proxy(control_plane):
    if not control_plane.api.get(f"/api/v1/namespaces/{NS}").ok:
        control_plane.create_namespace(NS)
    p = FaultProxy(control_plane.kubeconfig)
    yield p
    p.close()
    assert not p.internal_errors, p.internal_errors


@pytest.fixture(scope="module")
def operator(control_plane, proxy: FaultProxy, tmp_path_factory: pytest.TempPathFactory) -> KubeApi:
    """The operator's ServiceAccount, through the proxy."""
    return KubeApi(operator_kubeconfig(control_plane, tmp_path_factory.mktemp("proxy") / "kubeconfig",
                                       server=proxy.url))


def watch(api: KubeApi, since: str, timeout: int) -> list[dict[str, Any]]:
    """This module's namespace watched from `since` (the operator may watch namespaces, not ConfigMaps)."""
    with api.watch("/api/v1/namespaces", resourceVersion=since, timeoutSeconds=str(timeout),
                   fieldSelector=f"metadata.name={NS}") as stream:
        return [json.loads(line) for line in stream]


def touch(control_plane, step: int) -> str:
    """Change the namespace (directly on the API server, as the admin); its new resourceVersion."""
    changed = control_plane.api.request("PATCH", f"/api/v1/namespaces/{NS}",
                                        {"metadata": {"labels": {"step": str(step)}}},
                                        content_type="application/merge-patch+json")
    return control_plane.api.must(changed)["metadata"]["resourceVersion"]


def test_requests_pass_through_as_the_clients_own_identity(operator: KubeApi, proxy: FaultProxy):
    review = operator.must(operator.create("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                           {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
    assert operator.get(f"/api/v1/namespaces/{NS}/secrets").status == 403  # the real authorizer judges it
    operator.must(operator.create(CMS, {"metadata": {"name": "through"}}))
    assert operator.create(CMS, {"metadata": {"name": "through"}}).status == 409
    assert (NS, "configmaps", "through") in proxy.created and proxy.created.count((NS, "configmaps", "through")) == 1
    answered = [entry[:3] for entry in proxy.log]
    assert ["POST", CMS, 201] in answered and ["POST", CMS, 409] in answered
    assert all(entry[3] > 0 and entry[4] <= entry[5] for entry in proxy.log if entry[1] == CMS)  # bytes, times


def test_injected_faults_hit_only_the_matching_requests(control_plane, operator: KubeApi, proxy: FaultProxy):
    operator.must(operator.create(CMS, {"metadata": {"name": "f"}}))
    fault = proxy.inject("GET", r"/configmaps/f$", status=500, after=1, times=2)
    assert [operator.get(f"{CMS}/f").status for _ in range(4)] == [200, 500, 500, 200]
    assert (fault.seen, fault.faulted) == (4, 2)
    throttle = proxy.inject("GET", r"/configmaps/f$", status=429, retry_after=3)
    response = operator.get(f"{CMS}/f")
    assert (response.status, response.body["reason"], throttle.faulted) == (429, "TooManyRequests", 1)
    outage = proxy.inject("GET", r"/configmaps/f$", status=503, times=None)
    assert operator.get(f"{CMS}/f").status == 503
    assert control_plane.api.get(f"{CMS}/f").ok  # clients talking to the API server directly: never faulted
    proxy.faults.remove(outage)
    held = proxy.inject("POST", r"/configmaps$", status=None, hold=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        create = pool.submit(operator.create, CMS, {"metadata": {"name": "held"}})
        wait_for(lambda: held.faulted, 10, "the create to be held")
        time.sleep(0.3)
        assert not create.done() and control_plane.api.get(f"{CMS}/held").status == 404  # not forwarded yet
        held.release()
        assert create.result(10).status == 201  # no status: released, it is served


def test_watch_streams_are_passed_on_silenced_dropped_and_expired(control_plane, operator: KubeApi,
                                                                  proxy: FaultProxy):
    since = touch(control_plane, 1)
    touch(control_plane, 2)
    events = watch(operator, since, 1)
    assert [(e["type"], e["object"]["metadata"]["labels"]["step"]) for e in events] == [("MODIFIED", "2")]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        muted = pool.submit(watch, operator, touch(control_plane, 3), 3)
        wait_for(lambda: proxy.mute_watches("v1/namespaces"), 10, "the watch to be open")
        touch(control_plane, 4)
        assert muted.result(10) == []  # the stream stayed open (until its timeout) and said nothing

        dropped = pool.submit(watch, operator, touch(control_plane, 5), 50)
        wait_for(lambda: [e for e in proxy.log if e[2] is None and "watch=true" in e[1]], 10, "the watch to open")
        time.sleep(0.5)
        started = time.monotonic()
        assert proxy.drop_watches("v1/pods") == 0 and proxy.drop_watches() == 1
        dropped.result(10)
        assert time.monotonic() - started < 5  # ended by the drop, not by its timeout

    proxy.drop_watches(expire_history=True)  # resuming from before now: 410 Gone, as the API server says it
    events = watch(operator, since, 1)
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [("ERROR", 410, "Expired")]
    now = touch(control_plane, 6)
    touch(control_plane, 7)
    assert [e["type"] for e in watch(operator, now, 1)] == ["MODIFIED"]  # from a fresh version: served
    assert proxy.expired_watches == 1
