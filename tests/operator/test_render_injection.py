"""User strings reach the cluster as data: whatever a value holds (newlines, quotes, `{{ }}`, YAML documents),
it arrives intact where it belongs, and no object or field appears that was not there without it."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paratrain.api import SpecError, parse_job
from paratrain_operator.render import render_job, to_json, to_yaml_stream

TEMPLATES = Path(__file__).resolve().parents[2] / "operator/paratrain_operator/templates"
PAYLOADS = [
    "x\nkind: Secret",
    "---\napiVersion: v1\nkind: Secret\nmetadata: {name: stolen}",
    "\"}, {\"name\": \"INJECTED\", \"value\": \"1",
    "' single \" double \\ backslash",
    "{{ 7 * 7 }} {% if true %}jinja{% endif %} {# comment #}",
    "key: value\n  nested: [1, 2]",
    "- a\n- b",
    "# not a comment",
    "&anchor *alias !!python/object/apply:os.system ['id']",
    "| > @ ` % ! ? : , [ ] { }",
    "null", "true", "~", "0x1F", "1e3", "",
    " leading and trailing spaces ",
    "tab\there\r\ncrlf",
    "emoji 😀 and 中文 and é",
    "line\u2028separator\u2029paragraph\u0085nel",
    "c1 \x7f\x80\x9f controls, bom \ufeff",
]


def job_with(payload: str) -> dict[str, Any]:
    return {
        "apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "inj"},
        "spec": {
            "nodes": 2, "parallelism": {"data": 2},
            "data": {"source": "text", "path": "/data/" + payload.replace("\n", " ").replace("\r", " ")},
            "scheduling": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In",
                                                             "values": [payload]}]}]}}}},
            "pod": {
                "env": [{"name": "USER_VALUE", "value": payload}],
                "annotations": {"example.com/note": payload},
                "volumes": [{"name": "data", "mountPath": "/data/" + payload.replace("\n", " ").replace("\r", " "),
                             "emptyDir": True}],
            },
        },
    }


def render(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return render_job(parse_job(doc), "ns")


def shape(value: Any) -> Any:
    """The structure without the data: mapping keys and list lengths, strings blanked."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


BASELINE = render(job_with("plain"))


def env_value(pod: dict[str, Any], name: str) -> str:
    return next(e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == name)


@pytest.mark.parametrize("payload", PAYLOADS, ids=[repr(p)[:30] for p in PAYLOADS])
def test_payload_arrives_intact_and_adds_nothing(payload: str) -> None:
    objects = render(job_with(payload))
    assert shape(objects) == shape(BASELINE)  # no extra object, field, list item
    pods = [o for o in objects if o["kind"] == "Pod"]
    flat = payload.replace("\n", " ").replace("\r", " ")
    for pod in pods:
        assert env_value(pod, "USER_VALUE") == payload
        assert pod["metadata"]["annotations"]["example.com/note"] == payload
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [payload]
        assert {"name": "data", "mountPath": "/data/" + flat} in pod["spec"]["containers"][0]["volumeMounts"]
    spec_file = yaml.safe_load(objects[0]["data"]["job.yaml"])
    assert parse_job(spec_file).spec == parse_job(job_with(payload)).spec  # the trainer reads the same job
    assert list(yaml.safe_load_all(to_yaml_stream(objects))) == objects  # and `paratrain render` prints it


def test_payloads_that_are_not_allowed_are_refused_before_rendering() -> None:
    """Where Kubernetes gives a string a grammar (image, names, label values), the spec refuses anything else."""
    for change in [{"image": "busybox\nkind: Secret"}, {"image": "x\" y"},
                   {"pod": {"labels": {"team": "a\nb"}}}, {"pod": {"env": [{"name": "A\nB", "value": ""}]}},
                   {"pod": {"imagePullSecrets": ["a\nkind: Secret"]}},
                   {"pod": {"volumes": [{"name": "d", "mountPath": "/x\nkind: Secret", "emptyDir": True}]}},
                   {"scheduling": {"queue": "q\n- x", "gang": "volcano"}},
                   {"scheduling": {"queue": "q\n- x", "gang": "kai"}}]:
        with pytest.raises(SpecError):
            parse_job({"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob",
                       "metadata": {"name": "inj"}, "spec": change})


def test_tricky_but_valid_image_arrives_intact() -> None:
    image = "registry.example.com:5000/team/trainer@sha256:" + "ab" * 32
    doc = job_with("plain")
    doc["spec"]["image"] = image
    pods = [o for o in render(doc) if o["kind"] == "Pod"]
    assert [p["spec"]["containers"][0]["image"] for p in pods] == [image, image]


AWKWARD = st.sampled_from(["\x00", "\x7f", "\x85", "\x9f", "\u2028", "\u2029", "\ufeff", "\ud800", "\udfff",
                          "😀", '"', "\\", "\n", "{{", "}}"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.characters(), AWKWARD), max_size=30).map("".join))
def test_any_text_survives_json_into_yaml(text: str) -> None:
    """The `tojson` filter's output reads back as the same value with PyYAML's own parser and with libyaml's
    (which the renderer uses); only a lone surrogate, which no Kubernetes object can hold, becomes U+FFFD."""
    expected = re.sub("[\ud800-\udfff]", "\ufffd", text)
    for loader in (yaml.SafeLoader, yaml.CSafeLoader):
        assert yaml.load(f"value: {to_json(text)}\n", Loader=loader) == {"value": expected}
        assert yaml.load(f"value: {to_json({'k': [text]})}\n", Loader=loader) == {"value": {"k": [expected]}}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_any_env_value_renders_intact(text: str) -> None:
    doc = job_with("plain")
    doc["spec"]["pod"]["env"][0]["value"] = text
    pods = [o for o in render(copy.deepcopy(doc)) if o["kind"] == "Pod"]
    assert [env_value(p, "USER_VALUE") for p in pods] == [text, text]


def test_templates_insert_every_value_as_json() -> None:
    """No `{{ ... }}` in a template writes raw text: each ends in `|tojson`."""
    expressions = []
    for template in TEMPLATES.glob("*.j2"):
        expressions += re.findall(r"\{\{(.*?)\}\}", template.read_text(), flags=re.S)
    assert len(expressions) > 20
    assert [e for e in expressions if not e.strip().endswith("|tojson")] == []
