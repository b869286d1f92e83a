"""manifests/ and the chart's CRD copy are exactly what scripts/gen_manifests.py makes from their sources.

When a test here fails after a spec or chart change: `.venv/bin/python scripts/gen_manifests.py`, then commit the
result.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from paratrain.api.crd import crd_manifest
from paratrain.cli import main as paratrain_main

from .conftest import ROOT
from .policy import only

MANIFESTS = ROOT / "manifests"
HELM_OWNED_KEYS = ("app.kubernetes.io/", "helm.sh/")


@pytest.fixture(scope="module")
def expected(gen) -> dict[Path, str]:
    return gen.expected_files()


def test_generated_files_are_up_to_date(gen, expected) -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen.stale_files(expected)]
    assert not stale, f"out of date: {stale}; run `.venv/bin/python scripts/gen_manifests.py` and commit the result"


def test_drift_is_detected(gen, expected) -> None:
    # The check above can fail: any edit to a generated file makes it stale.
    for path in (gen.CHART_CRD, MANIFESTS / "install.yaml"):
        edited = dict(expected)
        edited[path] = expected[path].replace("paralleltrainjobs", "paralleltrainjob", 1)
        assert path in gen.stale_files(edited)


def test_crd_file_is_what_paratrain_crd_prints() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert paratrain_main(["crd"]) == 0
    assert yaml.safe_load(out.getvalue()) == yaml.safe_load((MANIFESTS / "crd.yaml").read_text()) == crd_manifest()


def without_helm_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """The object minus the labels and keep-annotation the chart adds."""
    meta = dict(obj["metadata"])
    for field in ("labels", "annotations"):
        kept = {k: v for k, v in meta.get(field, {}).items() if not k.startswith(HELM_OWNED_KEYS)}
        meta.pop(field, None)
        if kept:
            meta[field] = kept
    return {**obj, "metadata": meta}


def test_chart_installs_the_same_crd(render) -> None:
    # The chart reads files/crds/ through fromYaml/toYaml: the round trip must not change the schema.
    crd = only(render(), "CustomResourceDefinition")
    source = crd_manifest()
    assert without_helm_metadata(crd) == without_helm_metadata(source)
    assert source["metadata"].get("labels", {}).items() <= crd["metadata"]["labels"].items()


def test_install_bundle_is_the_chart_defaults_plus_namespace(gen, render) -> None:
    objects = [o for o in yaml.safe_load_all((MANIFESTS / "install.yaml").read_text()) if o]
    namespace = objects[0]
    assert namespace["kind"] == "Namespace" and namespace["metadata"]["name"] == gen.NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(objects[1:], key=key) == sorted(render(namespace=gen.NAMESPACE), key=key)
    assert objects[1]["kind"] == "CustomResourceDefinition"  # before anything that might need it
    assert objects[-1]["kind"] == "Deployment"  # the operator starts once its RBAC exists
    for obj in objects:
        if obj["kind"] in {"ServiceAccount", "Service", "Deployment"}:
            assert obj["metadata"]["namespace"] == gen.NAMESPACE, obj["kind"]


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_every_manifest_validates_strictly(version: str) -> None:
    docs = []
    for path in [MANIFESTS / "crd.yaml", MANIFESTS / "install.yaml"]:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)



def test_manifest_examples_are_the_cluster_ready_examples(gen) -> None:
    copies = sorted(p.name for p in (MANIFESTS / "examples").glob("*.yaml"))
    assert copies, "at least one example job is meant for a cluster"
    for name in copies:
        assert all(gen.cluster_ready(d) for d in yaml.safe_load_all((MANIFESTS / "examples" / name).read_text()) if d)
    # Every example is cluster-shaped now (the CPU image holds their data); a job the operator refuses is not offered.
    assert copies == sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    local = yaml.safe_load((ROOT / "examples" / "shakespeare.yaml").read_text())
    local["spec"]["checkpoint"]["path"] = "runs/shakespeare/checkpoints"  # relative: lost with the pod
    assert not gen.cluster_ready(local)
