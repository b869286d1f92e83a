"""The API emulator's own semantics, which the live tests rely on (each closes a gap of kmock 0.8 as shipped)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from .support.server import ApiServer

PODS, CMS = "v1/pods", "v1/configmaps"


@pytest.fixture(scope="module")
def api():
    with ApiServer() as server:
        server.create_namespace("ns")
        yield server
        assert not server.emulator.internal_errors


def http(api: ApiServer, method: str, path: str, body: Any = None, content_type: str = "application/json",
         accept: str = "application/json") -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(api.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
            return response.status, [json.loads(line) for line in text.splitlines() if line] \
                if "watch=true" in path else json.loads(text)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_namespaces_and_core_discovery(api: ApiServer):
    assert http(api, "GET", "/api/v1/namespaces/ns")[1]["metadata"]["name"] == "ns"
    assert "ns" in [n["metadata"]["name"] for n in http(api, "GET", "/api/v1/namespaces")[1]["items"]]
    assert http(api, "GET", "/api/v1")[1]["groupVersion"] == "v1"


def test_create_fills_metadata_and_generates_names(api: ApiServer):
    code, obj = http(api, "POST", "/api/v1/namespaces/ns/configmaps", {"metadata": {"generateName": "ev-"}})
    meta = obj["metadata"]
    assert code == 201 and meta["name"].startswith("ev-") and len(meta["name"]) == 8
    assert meta["namespace"] == "ns" and meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0
    assert http(api, "POST", "/api/v1/namespaces/ns/configmaps", {"metadata": {"name": meta["name"]}})[0] == 409
    assert http(api, "POST", "/api/v1/namespaces/nope/configmaps", {"metadata": {"name": "x"}})[0] == 404


def test_patches_honour_resource_versions_and_json_patch_tests(api: ApiServer):
    obj = api.create(CMS, {"metadata": {"name": "rv"}, "data": {"a": "1"}}, "ns")
    rv = obj["metadata"]["resourceVersion"]
    path = "/api/v1/namespaces/ns/configmaps/rv"
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"}, {"op": "add", "path": "/data/b",
                                                                                  "value": "2"}]
    assert http(api, "PATCH", path, stale, "application/json-patch+json")[0] == 409
    fresh = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, stale[1]]
    code, patched = http(api, "PATCH", path, fresh, "application/json-patch+json")
    assert code == 200 and patched["data"] == {"a": "1", "b": "2"} and patched["metadata"]["resourceVersion"] > rv
    assert http(api, "PATCH", path, {"metadata": {"resourceVersion": rv}, "data": {"c": "3"}},
                "application/merge-patch+json")[0] == 409
    code, replaced = http(api, "PUT", path, {"metadata": {"name": "rv"}, "data": {"only": "this"}})
    assert code == 200 and replaced["data"] == {"only": "this"}


def test_status_is_a_subresource_and_only_spec_bumps_generation(api: ApiServer):
    pod = api.create(PODS, {"metadata": {"name": "s"}, "spec": {"containers": []}, "status": {"phase": "Lie"}}, "ns")
    assert "status" not in pod  # status is not taken on create
    after = api.patch(PODS, "ns", "s", {"status": {"phase": "Running"}, "spec": {"x": 1}}, subresource="status")
    assert after["status"] == {"phase": "Running"} and "x" not in after["spec"] and after["metadata"]["generation"] == 1
    after = api.patch(PODS, "ns", "s", {"status": {"phase": "Failed"}, "spec": {"x": 1}})
    assert after["status"] == {"phase": "Running"} and after["spec"]["x"] == 1 and after["metadata"]["generation"] == 2
    labelled = api.patch(PODS, "ns", "s", {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 2


def test_label_and_field_selectors(api: ApiServer):
    for name, labels in [("l1", {"app": "x", "tier": "a"}), ("l2", {"app": "y"}), ("l3", {"tier": "b"})]:
        api.create(CMS, {"metadata": {"name": name, "labels": labels}}, "ns")

    def select(query: str) -> list[str]:
        items = http(api, "GET", f"/api/v1/namespaces/ns/configmaps?{query}")[1]["items"]
        return sorted(i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith("l"))
    assert select("labelSelector=app%3Dx") == ["l1"]
    assert select("labelSelector=app") == ["l1", "l2"]
    assert select("labelSelector=!app") == ["l3"]
    assert select("labelSelector=tier%20in%20(a,b),app!%3Dx") == ["l3"]
    assert select("fieldSelector=metadata.name%3Dl2") == ["l2"]


def test_watches_resume_from_a_resource_version(api: ApiServer):
    obj = api.create(CMS, {"metadata": {"name": "w", "labels": {"watched": "yes"}}}, "ns")
    since = obj["metadata"]["resourceVersion"]
    api.patch(CMS, "ns", "w", {"data": {"k": "v"}})
    api.patch(CMS, "ns", "w", {"metadata": {"labels": {"watched": "no"}}})  # leaves the selection
    api.delete(CMS, "ns", "w")
    code, events = http(api, "GET", f"/api/v1/namespaces/ns/configmaps?watch=true&resourceVersion={since}"
                                    "&labelSelector=watched%3Dyes&timeoutSeconds=1")
    assert code == 200 and [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    code, events = http(api, "GET", f"/api/v1/namespaces/ns/configmaps?watch=true&resourceVersion={since}"
                                    "&fieldSelector=metadata.name%3Dw&timeoutSeconds=1")
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "DELETED"]
    api.call(api.emulator.drop_watches, expire_history=True)  # resuming from before now: 410 Gone
    code, events = http(api, "GET", f"/api/v1/namespaces/ns/configmaps?watch=true&resourceVersion={since}"
                                    "&timeoutSeconds=1")
    assert code == 200 and [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
    now = http(api, "GET", "/api/v1/namespaces/ns/configmaps")[1]["metadata"]["resourceVersion"]
    api.create(CMS, {"metadata": {"name": "w2"}}, "ns")
    code, events = http(api, "GET", f"/api/v1/namespaces/ns/configmaps?watch=true&resourceVersion={now}"
                                    "&timeoutSeconds=1")
    assert [e["type"] for e in events] == ["ADDED"]  # from a fresh list's version: served


def test_owner_references_cascade_and_dangling_owners_are_collected(api: ApiServer):
    owner = api.create(CMS, {"metadata": {"name": "owner"}}, "ns")
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    api.create(CMS, {"metadata": {"name": "child", "ownerReferences": [ref]}}, "ns")
    api.create(CMS, {"metadata": {"name": "grandchild", "ownerReferences": [
        {**ref, "name": "child", "uid": api.object(CMS, "ns", "child")["metadata"]["uid"]}]}}, "ns")
    api.delete(CMS, "ns", "owner")
    assert api.object(CMS, "ns", "child") is None and api.object(CMS, "ns", "grandchild") is None
    orphan = api.create(CMS, {"metadata": {"name": "late", "ownerReferences": [ref]}}, "ns")  # owner already gone
    assert orphan and api.object(CMS, "ns", "late") is None


def test_bound_running_pods_stop_gracefully_until_the_kubelet_confirms(api: ApiServer):
    api.create(PODS, {"metadata": {"name": "g"}, "spec": {"nodeName": "n", "containers": []}}, "ns")
    api.patch(PODS, "ns", "g", {"status": {"phase": "Running"}}, subresource="status")
    marked = api.delete(PODS, "ns", "g")
    assert marked["metadata"]["deletionTimestamp"] and api.object(PODS, "ns", "g") is not None
    api.delete(PODS, "ns", "g", gracePeriodSeconds=0)  # what the kubelet sends once the containers stopped
    assert api.object(PODS, "ns", "g") is None


def test_crds_register_their_resource_and_tables_use_printer_columns(api: ApiServer):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "widgets.ex.dev"},
           "spec": {"group": "ex.dev", "scope": "Namespaced", "names": {"plural": "widgets", "kind": "Widget",
                                                                        "singular": "widget", "shortNames": ["wd"]},
                    "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                                  "additionalPrinterColumns": [
                                      {"name": "Ready", "type": "string",
                                       "jsonPath": '.status.conditions[?(@.type=="Ready")].status'}]}]}}
    api.create("apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert http(api, "GET", "/apis/ex.dev/v1")[1]["resources"][0]["shortNames"] == ["wd"]
    api.create("ex.dev/v1/widgets", {"metadata": {"name": "w1"}}, "ns")
    api.patch("ex.dev/v1/widgets", "ns", "w1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
              subresource="status")
    table = http(api, "GET", "/apis/ex.dev/v1/namespaces/ns/widgets",
                 accept="application/json;as=Table;v=v1;g=meta.k8s.io")[1]
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Ready"]
    assert table["rows"][0]["cells"] == ["w1", "True"]


def test_injected_faults_hit_only_the_matching_requests(api: ApiServer):
    api.create(CMS, {"metadata": {"name": "f"}}, "ns")
    fault = api.emulator.inject("GET", r"/configmaps/f$", status=500, after=1, times=2)
    statuses = [http(api, "GET", "/api/v1/namespaces/ns/configmaps/f")[0] for _ in range(4)]
    assert statuses == [200, 500, 500, 200] and fault.seen == 4 and fault.faulted == 2
    throttle = api.emulator.inject("GET", r"/configmaps/f$", status=429, retry_after=3)
    code, body = http(api, "GET", "/api/v1/namespaces/ns/configmaps/f")
    assert code == 429 and body["reason"] == "TooManyRequests" and throttle.faulted == 1
    outage = api.emulator.inject("GET", r"/configmaps/f$", status=503, times=None)
    assert http(api, "GET", "/api/v1/namespaces/ns/configmaps/f")[0] == 503
    assert api.object(CMS, "ns", "f") is not None  # in-process clients (the kubelet) are never faulted
    api.emulator.faults.remove(outage)
