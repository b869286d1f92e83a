"""Property: every ParallelTrainJob document either renders objects the API server accepts or is refused by
`parse_job` with a SpecError whose every problem names a field of the document — never any other exception.

Documents come from two generators: any value of any type under the spec's real field names (derived from the
models, so new fields are fuzzed too), and well-formed jobs with random degrees, sizes and names. One exception
is kept opaque: `spec.scheduling.affinity` is Kubernetes' own structure, passed through as data for the API server
to validate at pod creation (see spec.SchedulingSpec), so it is drawn from valid affinities here.
"""

from __future__ import annotations

import ast
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from paratrain.api import SpecError, parse_job
from paratrain.api.spec import API_GROUP, API_VERSION, KIND, ParallelTrainJob, Spec
from paratrain_operator.render import render_job

from ..operator.test_render_valid import validate
from . import apiserver

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

AFFINITIES = [
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "a100"]}]}]}}},
    {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
]
PAYLOADS = ["x\nkind: Secret", "a: b\n---\nkind: Pod", '"}, {"name": "EVIL"', "{{ 7*7 }}", "{% if 1 %}x{% endif %}",
            "-", "", " ", "é中😀", "\u2028", "\x00", "a" * 64, "MASTER_ADDR", "NCCL_DEBUG", "paratrain.dev/x"]
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(PAYLOADS),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
INTS = st.one_of(st.integers(1, 4), st.integers(-2, 70),
                 st.sampled_from([0, 8, 64, 4096, 4097, 10**6, 2**31, -(10**6)]))
TEXTS = st.one_of(st.from_regex(r"[a-z0-9][-a-z0-9.]{0,70}", fullmatch=True), st.sampled_from(PAYLOADS),
                  st.text(max_size=16))


def _mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """Usually `good`, sometimes `bad`."""
    return st.integers(0, 9).flatmap(lambda i: good if i else bad)


def _model_doc(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    fields = {f.alias or name: _field_value(model, name, f.annotation) for name, f in model.model_fields.items()}
    doc = st.fixed_dictionaries({}, optional=fields)
    misspelt = st.tuples(doc, st.sampled_from(["hostPath", "securityContext", "privileged", "tensr"]), JUNK)
    return st.one_of(doc, doc, doc, misspelt.map(lambda t: {**t[0], t[1]: t[2]}))


def _field_value(model: type[BaseModel], name: str, annotation: Any) -> st.SearchStrategy:
    if model.__name__ == "SchedulingSpec" and name == "affinity":
        return st.sampled_from([None, *AFFINITIES])
    return _mostly(_typed(annotation), JUNK)


def _typed(annotation: Any) -> st.SearchStrategy:
    """A value of roughly the field's type (bounds and patterns deliberately ignored)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model_doc(annotation)
    if origin is Annotated:
        return _typed(args[0])
    if origin in (Union, types.UnionType):
        return st.one_of([_typed(a) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(_typed(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(_typed(args[0]), _typed(args[1]), max_size=3)
    return {int: INTS, float: st.one_of(st.floats(-10, 10), st.floats(allow_nan=True, allow_infinity=True)),
            str: TEXTS, bool: st.booleans(), type(None): st.none()}.get(annotation, JUNK)


def _document(spec: st.SearchStrategy) -> st.SearchStrategy:
    name = _mostly(st.from_regex(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", fullmatch=True), TEXTS)
    meta = st.fixed_dictionaries({"name": name}, optional={"namespace": TEXTS, "uid": TEXTS})
    return st.fixed_dictionaries({
        "apiVersion": _mostly(st.just(f"{API_GROUP}/{API_VERSION}"), st.sampled_from(["v1", "paratrain.dev/v1"])),
        "kind": _mostly(st.just(KIND), st.sampled_from(["Pod", ""])),
        "metadata": _mostly(meta, JUNK),
        "spec": spec,
    })


ANY_VALUES = _mostly(_document(_model_doc(Spec)), JUNK)


@st.composite
def well_formed_spec(draw) -> dict:
    """A job that satisfies every cross-field rule, with random degrees and sizes, then a few hostile values."""
    data, tensor, pipeline = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    world = data * tensor * pipeline
    procs = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world % d == 0]))
    microbatches = draw(st.sampled_from([pipeline, 2 * pipeline])) if pipeline > 1 else 1
    heads = tensor * draw(st.integers(1, 3))
    zero = draw(st.sampled_from([0, 1, 2, 3] if data > 1 and pipeline == 1 else [0, 1] if data > 1 else [0]))
    steps = draw(st.integers(1, 10**6))
    gang = draw(st.sampled_from(["none", "volcano", "kai", "coscheduling"]))
    name = st.from_regex(r"[a-z]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
    spec = {
        "image": draw(st.sampled_from(["ghcr.io/org/trainer:1.0", "registry:5000/a/b@sha256:" + "0" * 64, "t"])),
        "nodes": world // procs, "procsPerNode": procs,
        "parallelism": {"data": data, "tensor": tensor, "pipeline": pipeline, "zeroStage": zero,
                        "microbatches": microbatches, "pipelineSchedule": draw(st.sampled_from(["GPipe", "1F1B"]))},
        "precision": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        "model": {"layers": pipeline * draw(st.integers(1, 4)), "heads": heads,
                  "embedDim": heads * draw(st.sampled_from([8, 16, 64])),
                  "blockSize": draw(st.sampled_from([2, 64, 131072]))},
        "training": {"steps": steps, "warmupSteps": draw(st.integers(0, min(steps, 100))),
                     "batchSize": data * microbatches * draw(st.sampled_from([1, 3, 1000]))},
        "resources": {"gpusPerNode": draw(st.sampled_from([0, procs])), "cpu": draw(st.sampled_from(["500m", "8"])),
                      "memory": draw(st.sampled_from(["2Gi", "1.5e9", "512Mi"]))},
        "scheduling": {"gang": gang, "affinity": draw(st.sampled_from([None, *AFFINITIES])),
                       "nodeSelector": draw(st.dictionaries(name, name, max_size=2))},
        "checkpoint": {"path": "/ckpt/run", "interval": draw(st.integers(0, 1000))},
        "runPolicy": {"backoffLimit": draw(st.integers(0, 1000))},
        "pod": {"env": [{"name": f"USER_{i}", "value": v} for i, v in enumerate(draw(st.lists(TEXTS, max_size=3)))],
                "volumes": [{"name": f"vol-{v}", "mountPath": f"/mnt/{v}", "persistentVolumeClaim": v}
                            for v in draw(st.lists(name, max_size=2, unique=True))],
                "labels": draw(st.dictionaries(name, name, max_size=2)),
                "annotations": draw(st.dictionaries(name, TEXTS, max_size=2))},
    }
    if gang in ("volcano", "kai"):
        spec["scheduling"]["queue"] = draw(name)
    for path, value in draw(_mostly(st.just([]), st.sampled_from(HOSTILE_PAIRS))):
        node = spec
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[path[-1]] = value
    return spec


# (path inside spec, value): one or two of these land on a well-formed job, or none.
HOSTILE = [
    (("nodes",), 10**6), (("nodes",), 0), (("procsPerNode",), -1), (("parallelism", "data"), 0),
    (("parallelism", "tensor"), -2), (("parallelism", "pipeline"), 10**6), (("parallelism", "microbatches"), 0),
    (("training", "batchSize"), 10**12), (("training", "steps"), 0), (("model", "vocabSize"), 10**9),
    (("model", "embedDim"), 2**40), (("image",), "x\nkind: Secret"), (("image",), "a: b\n---\nkind: Pod"),
    (("image",), "{{ 7*7 }}"), (("pod", "env"), [{"name": "MASTER_ADDR", "value": "evil"}]),
    (("pod", "env"), [{"name": "NCCL_SOCKET_IFNAME", "value": "eth9"}]),
    (("pod", "env"), [{"name": "A", "value": "x\n---\nkind: Secret"}]),
    (("pod", "volumes"), [{"name": "Data", "mountPath": "/data", "emptyDir": True}]),
    (("pod", "volumes"), [{"name": "data", "mountPath": "/data", "hostPath": "/"}]),
    (("pod", "labels"), {"a": "x\ny"}), (("pod", "annotations"), {"a": "{% raw %}\n---\nkind: Pod"}),
    (("pod", "securityContext"), {"privileged": True}), (("pod", "hostPath"), "/"),
    (("resources", "memory"), "1Gi\nprivileged: true"), (("checkpoint", "path"), "/a\nb"),
    (("runPolicy", "collectiveTimeoutSeconds"), 0),
]
HOSTILE_PAIRS = [[a] for a in HOSTILE] + [[a, b] for a, b in zip(HOSTILE, HOSTILE[7:] + HOSTILE[:7])]


_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


def _unwrap(annotation: Any) -> Any:
    while get_origin(annotation) in (Annotated, Union, types.UnionType):
        args = get_args(annotation)
        annotation = args[0] if get_origin(annotation) is Annotated else next(a for a in args if a is not type(None))
    return annotation


def _field_path_names_the_document(path: str, doc: Any) -> bool:
    """Each step of `path` is a field of the model at that point, or a key/index the document really has."""
    steps = list(_STEP.finditer(path))
    if not steps or "".join(m.group(0) for m in steps) != path:
        return False
    annotation: Any = ParallelTrainJob
    for n, match in enumerate(steps):
        name, index, quoted = match.groups()
        key = name if name is not None else ast.literal_eval(quoted) if quoted else None
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = {f.alias or n_: f.annotation for n_, f in annotation.model_fields.items()}
            if key in fields:
                annotation, doc = fields[key], doc.get(key) if isinstance(doc, dict) else None
                continue
            # Not a field: the document's own unknown key, and the last step.
            return isinstance(doc, dict) and key in doc and n == len(steps) - 1
        if get_origin(annotation) is list and index is not None:
            annotation = get_args(annotation)[0]
            doc = doc[int(index)] if isinstance(doc, list) and int(index) < len(doc) else None
        elif get_origin(annotation) is dict and key is not None:
            annotation, doc = get_args(annotation)[1], doc.get(key) if isinstance(doc, dict) else None
        else:
            return False
    return True


def check(doc: Any) -> None:
    try:
        job = parse_job(doc)
    except SpecError as exc:
        event("refused")
        assert exc.problems and str(exc)
        for problem in exc.problems:
            assert problem.message, problem
            named = _field_path_names_the_document(problem.path, doc)
            assert named or (problem.path == "<root>" and not isinstance(doc, dict)), f"{problem} (in {doc!r})"
        return
    event("rendered")
    namespace = job.metadata.namespace or "default"
    objects = render_job(job, namespace=namespace, attempt=job.spec.run_policy.backoff_limit)
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert len(pods) == job.spec.nodes
    for obj in objects:
        assert apiserver.problems(obj) == [], obj["metadata"]
    for obj in [o for o in objects if o["kind"] != "Pod"] + [pods[0], pods[-1]]:
        validate(obj)  # strict 1.30 schemas (slow: only the first and last pod, the others differ by rank)


@FUZZ
@given(ANY_VALUES)
def test_any_values_under_the_real_field_names(doc):
    check(doc)


@FUZZ
@given(well_formed_spec(), _mostly(st.from_regex(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", fullmatch=True),
                                   st.sampled_from(["a" * 51, "7b", "x-", "Big", "a.b", "", "a\nb"])))
def test_well_formed_jobs_with_random_degrees_sizes_and_names(spec, name):
    check({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": spec})


def _leaf_fields(model: type[BaseModel], path: str) -> list[tuple[str, list[str]]]:
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        keys = [*path, field.alias or name]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _leaf_fields(annotation, keys)
        else:
            out.append((".".join(keys), keys))
    return out


def _job(spec: dict) -> dict:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "metadata": {"name": "job"}, "spec": spec}


LEAVES = _leaf_fields(Spec, ["spec"])


def test_every_fields_error_names_exactly_that_field():
    for path, keys in LEAVES:
        doc: dict = {}
        node = doc
        for key in keys[1:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = [[]]  # wrong for every field: a list of a list
        try:
            parse_job(_job(doc))
        except SpecError as exc:
            paths = {p.path for p in exc.problems}
            assert paths and all(p == path or p.startswith(path + "[") for p in paths), (path, paths)
        else:
            raise AssertionError(f"{path}: [[]] accepted")


def test_unknown_keys_are_named_exactly_even_when_they_look_like_pydantic_steps():
    for key, shown in [("strange", ".strange"), ("interval", ".interval"), ("int", ".int"), ("str", ".str"),
                       ("dict[x]", "['dict[x]']"), ("hostPath", ".hostPath"), ("a.b", "['a.b']"), ("", "['']")]:
        for where, doc in [("spec", {key: 1}), ("spec.pod", {"pod": {key: 1}}),
                           ("spec.pod.volumes[0]", {"pod": {"volumes": [{"name": "v", "mountPath": "/v",
                                                                         "emptyDir": True, key: 1}]}})]:
            try:
                parse_job(_job(doc))
            except SpecError as exc:
                (problem,) = exc.problems  # the key named exactly, with a suggestion only where one is close
                assert re.fullmatch(rf"{re.escape(where + shown)}: unknown field \((misspelt\?|did you mean "
                                    r"'[A-Za-z]+'\?)\)", str(problem)), str(problem)
            else:
                raise AssertionError(f"{where}{shown} accepted")
