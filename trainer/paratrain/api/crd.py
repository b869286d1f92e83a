"""The ParallelTrainJob CustomResourceDefinition, generated from the typed models.

    paratrain crd > manifests/crd.yaml

* `spec` comes from `spec.Spec` and `status` from `status.JobStatus` (the status field names the operator writes
  are defined there), converted to a *structural* schema: no $ref, Optional fields `nullable`, object fields
  defaulted to `{}` so that every nested default (and thus every field a CEL rule reads) is present.
* Every rule of `spec.cross_field_problems` (and the model validators of Volume and Toleration) has a CEL twin
  below that reports under the same field path, with the same message where it can show the values
  (tests/api/test_crd_cel.py checks both reject exactly the same random specs). Duplicate env and volume names
  are rejected by the API server itself (`x-kubernetes-list-type: map` keyed by name), which costs no CEL.
* Map keys (labels, annotations, nodeSelector), which a structural schema cannot constrain, are checked by CEL rules
  (length and label-key pattern), and so is the annotations' total size, which a pod must respect.
* The gang layout and model shape are immutable after creation (`self == oldSelf`): a running gang and its
  checkpoints are built for them.
* CEL cost: every list, map and string in the spec has maxItems / maxProperties / maxLength, which is what
  Kubernetes' cost estimator needs. The costliest rule, mountPath uniqueness (64 x 64 comparisons of strings up
  to 4096 bytes), is estimated at about 1.7M of the 10M allowed per rule (100M per CRD).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from .spec import (
    API_GROUP, API_VERSION, ELASTIC_NEEDS_A_CHECKPOINT, ELASTIC_NEEDS_THE_TRAINER, ELASTIC_NOT_WITH_MIN_GPUS,
    EXTENDED_RESOURCE, EXTENDED_RESOURCE_MEANING, IN_PLACE_NEEDS_THE_TRAINER, JOB_NAME, KIND,
    KUBERNETES_OWNED_MEANING, KUBERNETES_OWNED_RESOURCE, KUEUE_KEY_MEANING, KUEUE_KEY_PREFIX, LABEL_KEY,
    LABEL_KEY_MAX_LENGTH, LABEL_KEY_MEANING, MAX_ANNOTATION_BYTES, MAX_NAME_LENGTH, PLURAL, QUEUED_GANGS,
    RESERVED_ENV_NAMES, RESERVED_ENV_PREFIXES, RESERVED_KEY_PREFIX,
    RESERVED_MOUNT_PATHS, RESERVED_VOLUME_PREFIX, SHORT_NAME, TRAINER_CONTAINER, TRAINER_SECTIONS, Spec,
)
from .shapes import BASE_DEFAULTS, DEFAULT_FAMILY, LLAMA_FFN_MULTIPLE, PRESETS
from .status import JobStatus

# Constraint keywords that mean the same in pydantic's JSON Schema and Kubernetes' OpenAPI v3 subset.
_CARRIED = ("format", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
            "minProperties", "maxProperties")


def _openapi(node: dict[str, Any], defs: dict[str, Any], *, defaults: bool) -> dict[str, Any]:
    """One pydantic JSON Schema node → a structural OpenAPI node (recursively)."""
    if "$ref" in node:
        outer = {k: v for k, v in node.items() if k != "$ref"}
        return _openapi({**defs[node["$ref"].rsplit("/", 1)[1]], **outer}, defs, defaults=defaults)
    if "anyOf" in node:
        return _nullable(node, defs, defaults=defaults)
    out: dict[str, Any] = {"type": node["type"]}
    if "description" in node:
        out["description"] = node["description"]
    out.update({key: node[key] for key in _CARRIED if key in node})
    if node["type"] == "string" and "enum" in node:  # bounds the API server's CEL cost estimate of comparisons
        out.setdefault("maxLength", max(len(value) for value in node["enum"]))
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if exclusive in node:  # JSON Schema's number form → OpenAPI v3.0's boolean form
            out[bound], out[exclusive] = node[exclusive], True
    if defaults and node.get("default") is not None:
        out["default"] = node["default"]
    if node["type"] == "array":
        out["items"] = _openapi(node["items"], defs, defaults=defaults)
    elif node["type"] == "object":
        out.update(_object_body(node, defs, defaults=defaults))
    return out


def _nullable(node: dict[str, Any], defs: dict[str, Any], *, defaults: bool) -> dict[str, Any]:
    """`X | None` (pydantic's anyOf [X, null]) → X with `nullable: true`; other unions have no structural form."""
    options = [o for o in node["anyOf"] if o.get("type") != "null"]
    if len(options) != 1 or len(node["anyOf"]) != 2:
        raise ValueError(f"only Optional[X] unions can become a structural schema, got {node['anyOf']}")
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    out = _openapi({**options[0], **outer}, defs, defaults=defaults)
    # The API server checks a kept null against an enum, which no null passes; a field that is not nullable has
    # its null pruned instead, which is what null means here: unset.
    return out if "enum" in out else {**out, "nullable": True}


def _object_body(node: dict[str, Any], defs: dict[str, Any], *, defaults: bool) -> dict[str, Any]:
    if "properties" in node:
        props = {name: _openapi(sub, defs, defaults=defaults) for name, sub in node["properties"].items()}
        required = node.get("required", [])
        if defaults:  # `{}` makes the API server fill in the nested defaults of an omitted section
            for name, sub in props.items():
                if "properties" in sub and name not in required and not sub.get("nullable"):
                    sub.setdefault("default", {})
        return {"properties": props, **({"required": required} if required else {})}
    if "patternProperties" in node:  # a map whose keys have a pattern: parse_job checks the keys (see above)
        (values,) = node["patternProperties"].values()
        return {"additionalProperties": _openapi(values, defs, defaults=defaults)}
    if isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"]:
        return {"additionalProperties": _openapi(node["additionalProperties"], defs, defaults=defaults)}
    # dict[str, Any]: Kubernetes' own structures (affinity), kept as data and validated by the pod schema.
    return {"x-kubernetes-preserve-unknown-fields": True}


def model_schema(model: type[BaseModel], *, defaults: bool) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _openapi(schema, schema.get("$defs", {}), defaults=defaults)


# ---- CEL rules ------------------------------------------------------------------------------------------------


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _message_expression(template: str) -> str:
    """`"a({self.x}) b"` → `"a(%s) b".format([self.x])`: a CEL message showing the offending values.

    Not `"a(" + string(self.x) + ") b"`: the API server's cost estimator sizes `string(int)` as unbounded, so a
    concatenation with it exceeds the CRD's cost budget and the CRD is refused; `format` is estimated bounded."""
    parts = re.split(r"\{([^{}]+)\}", template)
    text = "".join(part.replace("%", "%%") if i % 2 == 0 else "%s" for i, part in enumerate(parts))
    values = [part for i, part in enumerate(parts) if i % 2 == 1]
    return f"{_literal(text)}.format([{', '.join(values)}])"


def _rule(rule: str, message: str, field: str | None = None) -> dict[str, Any]:
    """An `x-kubernetes-validations` entry; `{expr}` in the message makes it a messageExpression."""
    out: dict[str, Any] = {"rule": rule}
    if "{" in message:
        out["messageExpression"] = _message_expression(message)
    else:
        out["message"] = message
    if field:
        out["fieldPath"] = field
    return out


def _given(expr: str, cel_type: str = "string") -> str:
    """An optional (nullable) field that is set: absent and explicit null both count as unset."""
    return f"(has({expr}) && type({expr}) == {cel_type})"


def _present(expr: str) -> str:
    """An optional (nullable) object field that is set."""
    return f"(has({expr}) && type({expr}) != null_type)"


def _cel_list(items: Any) -> str:
    return "[" + ", ".join(_literal(i) for i in items) + "]"


def _failure_policy_clash(field: str, what: str) -> dict[str, Any]:
    """`failure_policy_clashes`' twin for one matcher field: no two rules give a value of it different actions.
    The message names the first rule in such a pair and the first rule it clashes with."""
    rules = "self.rules"

    def clash(a: str, b: str) -> str:
        return (f"({a}.action != {b}.action && has({a}.{field}) && has({b}.{field}) && "
                f"{a}.{field}.exists(v, v in {b}.{field}))")

    first = f"{rules}.filter(y, {rules}.exists(x, {clash('x', 'y')}))[0]"
    # The first rule clashing with `first`, without nesting `first` in a loop (the API server's cost estimate of
    # that exceeds its budget 100-fold): each rule's clashing rules, the first non-empty list's head.
    other = f"{rules}.map(y, {rules}.filter(x, {clash('x', 'y')})).filter(c, size(c) > 0)[0][0]"
    return _rule(f"!has({rules}) || !{rules}.exists(y, {rules}.exists(x, {clash('x', 'y')}))",
                 f"rules[{{{rules}.indexOf({first})}}] and rules[{{{rules}.indexOf({other})}}] give one {what} "
                 f"different actions ({{{first}.action}} and {{{other}.action}}): a failure takes one action",
                 ".rules")


P, M, T, R, S = "self.parallelism", "self.model", "self.training", "self.resources", "self.scheduling"
_ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef")
_ONE_ENV_VALUE = [_rule(f"!({_present('self.valueFrom')} && has(self.value) && size(self.value) > 0)",
                        "value and valueFrom are exclusive")]
_ONE_ENV_SOURCE = [_rule(" + ".join(f"({_present(f'self.{k}')} ? 1 : 0)" for k in _ENV_SOURCES) + " == 1",
                         "exactly one of secretKeyRef, configMapKeyRef, fieldRef must be set")]
_RESERVED_MOUNTS = _cel_list(RESERVED_MOUNT_PATHS)
_RESERVED_ENV = " || ".join(
    [f"self.name in {_cel_list(sorted(RESERVED_ENV_NAMES))}"] + [f"self.name.startsWith({_literal(p)})"
                                                                 for p in RESERVED_ENV_PREFIXES])
_RESERVED_KEY = f"k.startsWith({_literal(RESERVED_KEY_PREFIX)})"
_RESERVED_KEYS = [_rule(f"!self.exists(k, {_RESERVED_KEY})",
                        f"key '{{self.filter(k, {_RESERVED_KEY})[0]}}': keys under {RESERVED_KEY_PREFIX} "
                        "are reserved by paratrain")]
_KUEUE_KEY = f"k.startsWith({_literal(KUEUE_KEY_PREFIX)})"
_KUEUE_KEYS = [_rule(f"!self.exists(k, {_KUEUE_KEY})",
                     f"key '{{self.filter(k, {_KUEUE_KEY})[0]}}': {KUEUE_KEY_MEANING}")]
_GOOD_KEY = f"size(k) <= {LABEL_KEY_MAX_LENGTH} && k.matches({_literal(LABEL_KEY)})"
# Built directly: the pattern's own braces ({0,61}) would read as placeholders of a _rule message.
_LABEL_KEYS = [{"rule": f"self.all(k, {_GOOD_KEY})", "messageExpression": _literal(
    f"key '%s' is not a label key: {LABEL_KEY_MEANING}, at most {LABEL_KEY_MAX_LENGTH} characters")
    + f".format([self.filter(k, !({_GOOD_KEY}))[0]])"}]
_GOOD_RESOURCE = f"size(k) <= 253 && k.matches({_literal(EXTENDED_RESOURCE)})"
_ANNOTATION_BYTES = "self.map(k, size(bytes(k)) + size(bytes(self[k])))"
_ANNOTATIONS_FIT_A_POD = [_rule(
    f"{_ANNOTATION_BYTES}.sum() <= {MAX_ANNOTATION_BYTES}",
    f"annotations total {{{_ANNOTATION_BYTES}.sum()}} bytes; a pod's may not exceed {MAX_ANNOTATION_BYTES} "
    "(the API server's 256 KiB, less paratrain's own)")]

def _cel_value(value: Any) -> str:
    return _literal(value) if isinstance(value, str) else repr(value)


def model_value(field: str) -> str:
    """CEL for the value of `spec.model.<field>` after shapes.resolve: the job's, else the preset's, else the
    family's default (the shape fields have no schema default; see shapes.py)."""
    explicit = f"{M}.{field}"
    # The preset's value as a chain of conditionals, not a map literal: a message's placeholders hold no braces.
    cel_type = "string" if field == "family" else "int"
    # Unreachable (the preset is one of PRESETS, each setting every field used here), but of the field's type: the
    # API server type-checks both branches of every conditional and refuses the CRD otherwise.
    preset_value = '""' if cel_type == "string" else "0"
    for name, preset in reversed(PRESETS.items()):
        preset_value = f"({M}.preset == {_literal(name)} ? {_cel_value(preset[field])} : {preset_value})"
    return (f"({_given(explicit, cel_type)} ? {explicit} : ({_given(f'{M}.preset')} ? {preset_value} : "
            f"{_default_without_preset(field)}))")


def _default_without_preset(field: str) -> str:
    """What shapes.family_default gives when no preset is named (the other shape fields explicit or default)."""
    def given_or(name: str, default: str) -> str:
        return f"({_given(f'{M}.{name}', 'string' if name == 'family' else 'int')} ? {M}.{name} : {default})"

    if field == "family":
        return _literal(DEFAULT_FAMILY)
    if field in BASE_DEFAULTS:
        return repr(BASE_DEFAULTS[field])
    if field == "kvHeads":
        return given_or("heads", repr(BASE_DEFAULTS["heads"]))
    if field == "ffnDim":
        embed, m = given_or("embedDim", repr(BASE_DEFAULTS["embedDim"])), LLAMA_FFN_MULTIPLE
        family = given_or("family", _literal(DEFAULT_FAMILY))
        return f"({family} == 'llama' ? {m} * ((8 * {embed} / 3 + {m - 1}) / {m}) : 4 * {embed})"
    raise KeyError(field)


def _at_defaults(section: str) -> str:
    """CEL: every field of `spec.<section>` holds its default (as the API server fills them in) or is unset."""
    terms = []
    for field in Spec.model_fields[section].annotation.model_fields.values():
        path = f"self.{section}.{field.alias}"
        if field.default is None:
            terms.append(f"(!has({path}) || type({path}) == null_type)")
        elif isinstance(field.default, bool):
            terms.append(path if field.default else f"!{path}")
        elif isinstance(field.default, float):
            terms.append(f"double({path}) == {field.default!r}")
        else:
            terms.append(f"{path} == {_cel_value(field.default)}")
    return " && ".join(terms)


_ENTRYPOINT = _present("self.entrypoint")
_ELASTIC = _present("self.elastic")


def _for_the_builtin_trainer(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**rule, "rule": f"{_ENTRYPOINT} || ({rule['rule']})"} for rule in rules]


def _manual_layout(rule: dict[str, Any]) -> dict[str, Any]:
    """A layout rule holds under mode manual; under auto the planner chooses the layout (and each it tries passes
    the rule)."""
    return {**rule, "rule": f"{P}.mode == 'auto' || ({rule['rule']})"}


FAMILY, LAYERS, HEADS, KV_HEADS, EMBED_DIM, FFN_DIM = (
    model_value(f) for f in ("family", "layers", "heads", "kvHeads", "embedDim", "ffnDim"))

# Where (a dotted path under spec, `[]` for list items) → rules; each twin of one `cross_field_problems` check.
SPEC_RULES: dict[str, list[dict[str, Any]]] = {
    "": [
        _manual_layout(_rule(f"{P}.data * {P}.tensor * {P}.pipeline == self.nodes * self.procsPerNode",
              f"data({{{P}.data}}) x tensor({{{P}.tensor}}) x pipeline({{{P}.pipeline}}) = "
              f"{{{P}.data * {P}.tensor * {P}.pipeline}} must equal nodes({{self.nodes}}) x "
              "procsPerNode({self.procsPerNode}) = {self.nodes * self.procsPerNode}", ".parallelism")),
        _manual_layout(_rule(f"{P}.zeroStage == 0 || {P}.data >= 2",
              f"zeroStage {{{P}.zeroStage}} shards over data-parallel ranks and needs parallelism.data >= 2",
              ".parallelism.zeroStage")),
        # The built-in trainer's own constraints: not for a program of its own (see cross_field_problems).
        *_for_the_builtin_trainer([
            _rule(f"{EMBED_DIM} % {HEADS} == 0",
                  f"embedDim({{{EMBED_DIM}}}) must be divisible by heads({{{HEADS}}})", ".model.embedDim"),
            _manual_layout(_rule(f"{HEADS} % {P}.tensor == 0",
                  f"heads({{{HEADS}}}) must be divisible by parallelism.tensor({{{P}.tensor}})", ".model.heads")),
            _rule(f"{HEADS} % {KV_HEADS} == 0",
                  f"heads({{{HEADS}}}) must be divisible by kvHeads({{{KV_HEADS}}})", ".model.kvHeads"),
            _manual_layout(_rule(f"{KV_HEADS} == {HEADS} || {KV_HEADS} % {P}.tensor == 0",
                  f"kvHeads({{{KV_HEADS}}}) must be divisible by parallelism.tensor({{{P}.tensor}})", ".model.kvHeads")),
            _manual_layout(_rule(f"{FFN_DIM} % {P}.tensor == 0",
                  f"ffnDim({{{FFN_DIM}}}) must be divisible by parallelism.tensor({{{P}.tensor}})", ".model.ffnDim")),
            _rule(f"{FAMILY} != 'llama' || {EMBED_DIM} % {HEADS} != 0 || {EMBED_DIM} / {HEADS} % 2 == 0",
                  f"RoPE rotates pairs: the head dimension embedDim/heads = {{{EMBED_DIM} / {HEADS}}} must be even",
                  ".model.embedDim"),
            _rule(f"{FAMILY} != 'gpt' || {KV_HEADS} == {HEADS}",
                  f"family gpt has no grouped-query attention: kvHeads({{{KV_HEADS}}}) must equal heads({{{HEADS}}})",
                  ".model.kvHeads"),
            _rule(f"{FAMILY} != 'llama' || !{_given(f'{M}.bias', 'bool')} || !{M}.bias",
                  "family llama has no biases: bias is for family gpt", ".model.bias"),
            _rule(f"{FAMILY} != 'gpt' || !{_given(f'{M}.ropeTheta', 'double')}",
                  "family gpt learns position embeddings: ropeTheta is for family llama", ".model.ropeTheta"),
            _manual_layout(_rule(f"{LAYERS} >= {P}.pipeline",
                  f"layers({{{LAYERS}}}) must be >= parallelism.pipeline({{{P}.pipeline}}): every stage needs at "
                  "least one layer", ".model.layers")),
            _manual_layout(_rule(f"{T}.batchSize % {P}.data == 0",
                  f"batchSize({{{T}.batchSize}}) must be divisible by parallelism.data({{{P}.data}})",
                  ".training.batchSize")),
            # Each checked only when the division before it is exact (the rule before reports the other case).
            _manual_layout(_rule(f"{T}.batchSize % {P}.data != 0 || {T}.batchSize / {P}.data % {T}.gradientAccumulation == 0",
                  f"per-rank batch batchSize/data = {{{T}.batchSize / {P}.data}} must be divisible by "
                  f"gradientAccumulation({{{T}.gradientAccumulation}})", ".training.gradientAccumulation")),
            _manual_layout(_rule(f"{T}.batchSize % {P}.data != 0 || {T}.batchSize / {P}.data % {T}.gradientAccumulation != 0 || "
                  f"{T}.batchSize / {P}.data / {T}.gradientAccumulation % {P}.microbatches == 0",
                  f"per-rank micro-step batch batchSize/data/gradientAccumulation = "
                  f"{{{T}.batchSize / {P}.data / {T}.gradientAccumulation}} must be divisible by "
                  f"microbatches({{{P}.microbatches}})", ".parallelism.microbatches")),
            _manual_layout(_rule(f"!{T}.compile || {P}.zeroStage != 3 || {P}.tensor > 1 || {P}.pipeline > 1",
                  "compile does not go with DeepSpeed ZeRO-3 (zeroStage 3 with tensor and pipeline 1), whose "
                  "gathers hook every module: use zeroStage 1 or 2, or add tensor or pipeline parallelism (ZeRO-3 "
                  "then runs on FSDP2)", ".training.compile")),
            _manual_layout(_rule(f"{P}.microbatches == 1 || {P}.pipeline > 1",
                  "microbatches > 1 needs parallelism.pipeline > 1", ".parallelism.microbatches")),
            _manual_layout(_rule(f"{P}.pipeline == 1 || {P}.pipelineSchedule != '1F1B' || {P}.microbatches >= {P}.pipeline",
                  f"1F1B needs microbatches({{{P}.microbatches}}) >= pipeline({{{P}.pipeline}})",
                  ".parallelism.microbatches")),
            _rule(f"{T}.minLearningRate <= {T}.learningRate",
                  f"minLearningRate({{{T}.minLearningRate}}) must be <= learningRate({{{T}.learningRate}})",
                  ".training.minLearningRate"),
            _rule(f"{T}.warmupSteps <= {T}.steps",
                  f"warmupSteps({{{T}.warmupSteps}}) must be <= steps({{{T}.steps}})", ".training.warmupSteps"),
            _rule(f"self.data.source == 'synthetic' || {_given('self.data.path')}",
                  "data.source '{self.data.source}' needs data.path", ".data.path"),
        ]),
        *(_rule(f"{P}.mode == 'auto' || !{_given(f'{P}.{name}', kind)}",
                f"{name} is for parallelism.mode auto (the planner's); this job's mode is manual",
                f".parallelism.{name}")
          for name, kind in (("objective", "string"), ("pin", "list"), ("allow", "list"),
                             ("memoryHeadroom", "double"))),
        _rule(f"{P}.mode == 'manual' || !{_ENTRYPOINT}", "mode auto plans the built-in trainer's model: a program "
              "of its own (spec.entrypoint) gives its layout (mode manual)", ".parallelism.mode"),
        _rule("self.reducePrecision in ['fp32', self.precision]",
              "reducePrecision({self.reducePrecision}) must be fp32 or the job's precision({self.precision}): "
              "gradients are summed in fp32 or in the 16-bit type they are computed in", ".reducePrecision"),
        _rule(f"{R}.gpusPerNode == 0 || {R}.gpusPerNode == self.procsPerNode",
              f"gpusPerNode({{{R}.gpusPerNode}}) must equal procsPerNode({{self.procsPerNode}}) (one process per "
              "GPU), or be 0 for CPU", ".resources.gpusPerNode"),
        _rule(f"!{_given(f'{S}.queue')} || {S}.gang in {list(QUEUED_GANGS)}",
              "queue is Volcano's or KAI's and needs scheduling.gang 'volcano' or 'kai'", ".scheduling.queue"),
        _rule(f"!{_given(f'{S}.topologyKey')} || !{_present(f'{S}.topology')}",
              "topologyKey is the deprecated form of topology.level: give topology only", ".scheduling"),
        _rule(f"!{_present(f'{S}.topology')} || !{_given(f'{S}.topology.ranksPerDomain', 'int')} || "
              f"{S}.topology.ranksPerDomain % self.procsPerNode == 0",
              f"ranksPerDomain({{{S}.topology.ranksPerDomain}}) must be a multiple of "
              "procsPerNode({self.procsPerNode}): a domain holds whole pods", ".scheduling.topology.ranksPerDomain"),
        _rule(f"!{_present(f'{S}.topology')} || !{_given(f'{S}.topology.ranksPerDomain', 'int')} || "
              f"self.nodes * self.procsPerNode % {S}.topology.ranksPerDomain == 0",
              f"ranksPerDomain({{{S}.topology.ranksPerDomain}}) must divide the gang's nodes({{self.nodes}}) x "
              "procsPerNode({self.procsPerNode}) = {self.nodes * self.procsPerNode} ranks",
              ".scheduling.topology.ranksPerDomain"),
        _manual_layout(_rule(f"!{_present(f'{S}.topology')} || !{_given(f'{S}.topology.ranksPerDomain', 'int')} || "
              f"{S}.topology.ranksPerDomain % {P}.tensor == 0",
              f"ranksPerDomain({{{S}.topology.ranksPerDomain}}) must be a multiple of tensor({{{P}.tensor}}): a "
              "tensor-parallel group, whose all-reduces run in every layer, never crosses a domain",
              ".scheduling.topology.ranksPerDomain")),
        *(_rule(f"!{_ENTRYPOINT} || ({_at_defaults(section)})",
                f"{section} is read only by the built-in trainer: with spec.entrypoint your program trains (it gets "
                "the layout as PARATRAIN_* env); leave it out", f".{section}") for section in TRAINER_SECTIONS),
        _rule(f"!{_ENTRYPOINT} || !{_given(f'{R}.gpuMemory')}",
              "the memory model is the built-in trainer's: leave gpuMemory out with spec.entrypoint",
              ".resources.gpuMemory"),
        _rule(f"!{_ENTRYPOINT} || !has(self.restartPolicy) || !has(self.restartPolicy.inPlaceLimit) || "
              "self.restartPolicy.inPlaceLimit == 0", IN_PLACE_NEEDS_THE_TRAINER, ".restartPolicy.inPlaceLimit"),
        # elastic_problems' twins
        _rule(f"!{_ELASTIC} || self.elastic.minNodes <= self.nodes",
              "minNodes({self.elastic.minNodes}) must be at most nodes({self.nodes}): the gang starts at nodes and "
              "shrinks to minNodes", ".elastic.minNodes"),
        _rule(f"!{_ELASTIC} || !{_given('self.elastic.maxNodes', 'int')} || self.elastic.maxNodes >= self.nodes",
              "maxNodes({self.elastic.maxNodes}) must be at least nodes({self.nodes}): the gang starts at nodes and "
              "grows to maxNodes", ".elastic.maxNodes"),
        _rule(f"!{_ELASTIC} || !{_ENTRYPOINT}", ELASTIC_NEEDS_THE_TRAINER, ".elastic"),
        _rule(f"!{_ELASTIC} || {_ENTRYPOINT} || {_given('self.checkpoint.path')}", ELASTIC_NEEDS_A_CHECKPOINT,
              ".elastic"),
        _rule(f"!{_ELASTIC} || !{_given(f'{P}.objective')} || {P}.objective != 'minGPUs'", ELASTIC_NOT_WITH_MIN_GPUS,
              ".elastic"),
    ],
    "pod": [
        _rule("!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.mountPath == v.mountPath))",
              "mountPath {self.volumes.filter(v, !self.volumes.exists_one(w, w.mountPath == v.mountPath))[0]"
              ".mountPath} is used by more than one volume", ".volumes"),
        _rule(f"!has(self.volumes) || !self.volumes.exists(v, v.mountPath in {_RESERVED_MOUNTS})",
              f"mountPath {{self.volumes.filter(v, v.mountPath in {_RESERVED_MOUNTS})[0].mountPath}} is reserved "
              "by paratrain", ".volumes"),
    ],
    "pod.env[]": [
        _rule(f"!({_RESERVED_ENV})",
              "{self.name} is reserved: torchrun's rendezvous contract, which paratrain sets", ".name"),
        *_ONE_ENV_VALUE,
    ],
    "pod.env[].valueFrom": _ONE_ENV_SOURCE,
    "pod.topologySpreadConstraints[]": [
        _rule(f"!{_given('self.minDomains', 'int')} || self.whenUnsatisfiable == 'DoNotSchedule'",
              "minDomains needs whenUnsatisfiable DoNotSchedule", ".minDomains"),
    ],
    "pod.initContainers[]": [
        _rule(f"self.name != {_literal(TRAINER_CONTAINER)}", f"{TRAINER_CONTAINER} is the trainer container's name",
              ".name"),
    ],
    "pod.initContainers[].env[].valueFrom": _ONE_ENV_SOURCE,
    "pod.initContainers[].env[]": _ONE_ENV_VALUE,
    "resources": [
        # has(): the CRD's own default for resources ({}) is checked before nested defaults fill it in.
        _rule("!has(self.extra) || !has(self.gpuResource) || !(self.gpuResource in self.extra)",
              "{self.gpuResource} is resources.gpuResource: request it with gpusPerNode", ".extra"),
        _rule("!has(self.claims) || self.claims.filter(c, c.providesGpus).size() <= 1",
              "only one claim can provide the GPUs", ".claims"),
        _rule("!has(self.claims) || !self.claims.exists(c, c.providesGpus) || self.gpusPerNode > 0",
              "a claim provides GPUs: gpusPerNode says how many (one per process), not 0", ".gpusPerNode"),
        _rule(f"!has(self.gpuResource) || !self.gpuResource.matches({_literal(KUBERNETES_OWNED_RESOURCE)})",
              f"{{self.gpuResource}}: {KUBERNETES_OWNED_MEANING}", ".gpuResource"),
        _rule(f"!has(self.extra) || !self.extra.exists(k, k.matches({_literal(KUBERNETES_OWNED_RESOURCE)}))",
              f"{{self.extra.filter(k, k.matches({_literal(KUBERNETES_OWNED_RESOURCE)}))[0]}}: "
              f"{KUBERNETES_OWNED_MEANING}", ".extra"),
    ],
    "pod.volumes[]": [
        _rule(" + ".join(f"({_given(f'self.{source}')} ? 1 : 0)"
                         for source in ("persistentVolumeClaim", "configMap", "secret")) + " + (self.emptyDir ? 1 : 0)"
              " == 1", "exactly one of persistentVolumeClaim, configMap, secret, emptyDir must be set"),
        _rule(f"!self.name.startsWith({_literal(RESERVED_VOLUME_PREFIX)})",
              f"volume names starting with '{RESERVED_VOLUME_PREFIX}' are reserved by paratrain", ".name"),
    ],
    "pod.labels": _LABEL_KEYS + _RESERVED_KEYS + _KUEUE_KEYS,
    "pod.annotations": _LABEL_KEYS + _RESERVED_KEYS + _KUEUE_KEYS + _ANNOTATIONS_FIT_A_POD,
    "scheduling.nodeSelector": _LABEL_KEYS,
    "resources.extra": [{"rule": f"self.all(k, {_GOOD_RESOURCE})", "messageExpression": _literal(
        f"invalid key: must be an extended resource name ({EXTENDED_RESOURCE_MEANING}), got '%s'")
        + f".format([self.filter(k, !({_GOOD_RESOURCE}))[0]])"}],
    "failurePolicy": [_failure_policy_clash("exitCodes", "exit code"),
                      _failure_policy_clash("podConditions", "pod condition")],
    "failurePolicy.rules[]": [
        _rule("(has(self.exitCodes) && size(self.exitCodes) > 0) != "
              "(has(self.podConditions) && size(self.podConditions) > 0)",
              "a rule matches either exitCodes or podConditions: give exactly one"),
        _rule("self.action != 'RestartInPlace' || !has(self.podConditions) || size(self.podConditions) == 0",
              "RestartInPlace matches exitCodes only: a pod with a condition is gone or going"),
    ],
    # The API server's own toleration rules (Toleration's validator): a pod breaking one is refused.
    "scheduling.tolerations[]": [
        _rule(f"({_given('self.key')} && size(self.key) > 0) || ({_given('self.operator')} && "
              "self.operator == 'Exists')",
              "operator must be Exists when key is empty (an empty key matches every taint)"),
        _rule(f"!({_given('self.operator')} && self.operator == 'Exists') || !({_given('self.value')} && "
              "size(self.value) > 0)", "value must be empty when operator is Exists"),
        _rule(f"!{_given('self.tolerationSeconds', 'int')} || ({_given('self.effect')} && self.effect == 'NoExecute')",
              "tolerationSeconds needs effect NoExecute"),
    ],
}
IMMUTABLE = ("nodes", "procsPerNode", "parallelism", "model")
# The API server rejects duplicate names in these.
LIST_MAP_KEYS = {"pod.env": "name", "pod.volumes": "name", "pod.initContainers": "name", "resources.claims": "name"}


def _at(schema: dict[str, Any], location: str) -> dict[str, Any]:
    node = schema
    for part in filter(None, location.split(".")):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def bounds(node: Mapping[str, Any]) -> list[str]:
    """A schema node's numeric and size limits, as `kubectl explain` and docs/reference.md state them."""
    out = []
    if node.get("minimum") is not None:
        out.append(f"{'>' if node.get('exclusiveMinimum') else '≥'} {plain(node['minimum'])}")
    if node.get("maximum") is not None:
        out.append(f"{'<' if node.get('exclusiveMaximum') else '≤'} {plain(node['maximum'])}")
    for key, word in (("maxLength", "chars"), ("maxItems", "items"), ("maxProperties", "entries")):
        if key in node and not (key == "maxLength" and "enum" in node):  # an enum's is its longest value's
            out.append(f"≤ {node[key]} {word}")
    return out


def plain(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return str(value)


def explain_suffix(node: Mapping[str, Any]) -> str:
    """What a field's description adds for `kubectl explain`, which shows neither defaults nor limits: its default
    (a section's `{}` aside), its values and its limits."""
    parts = []
    if node.get("default") not in (None, {}, []):
        parts.append(f"Default: {plain(node['default'])}.")
    if "enum" in node:
        parts.append(f"One of: {', '.join(plain(v) for v in node['enum'])}.")
    if bounds(node):
        parts.append(f"Limits: {', '.join(bounds(node))}.")
    return "".join(f" {p}" for p in parts)


def _explained(node: dict[str, Any]) -> None:
    """Every property's description with its explain_suffix, recursively."""
    for child in (node.get("properties") or {}).values():
        suffix = explain_suffix(child)
        if suffix:
            child["description"] = (child.get("description", "").rstrip() + suffix).strip()
        _explained(child)
        _explained(child.get("items") or {})


def spec_schema() -> dict[str, Any]:
    schema = {"description": "What to train and how: one ParallelTrainJob is one gang of pods.",
              **model_schema(Spec, defaults=True)}
    _explained(schema)
    for location, rules in SPEC_RULES.items():
        _at(schema, location).setdefault("x-kubernetes-validations", []).extend(copy.deepcopy(rules))
    for field in IMMUTABLE:
        _at(schema, field)["x-kubernetes-validations"] = [_rule(
            "self == oldSelf", f"{field} is immutable: the running gang and its checkpoints are laid out for it; "
            "create a new job to change it")]
    for location, key in LIST_MAP_KEYS.items():
        _at(schema, location).update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]})
    return schema


def status_schema() -> dict[str, Any]:
    schema = {"description": "Written by the operator (see paratrain.api.status).",
              **model_schema(JobStatus, defaults=False)}
    _at(schema, "conditions").update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Layout", "type": "string", "jsonPath": ".status.layout", "description": "data × tensor × pipeline degrees, ZeRO stage (when not 0), precision"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progressText", "description": "step/totalSteps"},
    {"name": "Loss", "type": "string", "jsonPath": ".status.lossText", "description": "four significant digits"},
    {"name": "Restarts", "type": "string", "jsonPath": ".status.restartsText",
     "description": "counted gang restarts (in place, pods replaced, stops)"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.eta"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # `kubectl get ptj -o wide` adds these.
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.nodes", "priority": 1},
    {"name": "Tokens/s", "type": "integer", "jsonPath": ".status.progress.tokensPerSecond", "priority": 1},
    {"name": "Last-Restart", "type": "string", "jsonPath": ".status.lastRestartReason", "priority": 1},
    {"name": "Restarted", "type": "date", "jsonPath": ".status.lastRestartTime", "priority": 1},
    {"name": "Failure", "type": "string", "jsonPath": ".status.failureReason", "priority": 1},
]


def crd_manifest() -> dict[str, Any]:
    """The `paralleltrainjobs.paratrain.dev` CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    root = {
        "type": "object",
        "description": "A training job run as one gang of pods with data, tensor and pipeline parallelism, ZeRO "
                       "and mixed precision chosen in its spec.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # The name becomes the Service's and prefixes pod names and DNS labels (see spec.MAX_NAME_LENGTH).
            "metadata": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": MAX_NAME_LENGTH, "pattern": JOB_NAME}}},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        # Required, not defaulted to {}: the API server checks every default against the CEL rules as it stands,
        # nested defaults not applied, and the spec-level rules read fields of the nested sections.
        "required": ["spec"],
    }
    version = {
        "name": API_VERSION, "served": True, "storage": True,
        "schema": {"openAPIV3Schema": root},
        "subresources": {"status": {}},
        "additionalPrinterColumns": PRINTER_COLUMNS,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}", "labels": {"app.kubernetes.io/name": "paratrain"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": KIND.lower(), "kind": KIND, "listKind": f"{KIND}List",
                      "shortNames": [SHORT_NAME], "categories": ["paratrain"]},
            "versions": [version],
        },
    }
