"""Reading a ParallelTrainJob: YAML file or dict → typed job, with every problem named by its field path."""

from __future__ import annotations

import copy
import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from . import spec as _spec
from .spec import ParallelTrainJob, cross_field_problems, fixes

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# YAML aliases let a tiny file stand for billions of values ("billion laughs"), which would only blow up later,
# when the job is written out for the trainer or the cluster.
MAX_YAML_VALUES = 100_000
# What each spec pattern means, so an error says "must be a DNS label", not the regular expression.
_PATTERN_MEANING = {
    _spec.DNS_LABEL: "a DNS label (lowercase letters, digits and '-', starting and ending with a letter or digit)",
    _spec.JOB_NAME: "a DNS label starting with a letter (lowercase letters, digits and '-', ending with a letter or "
                    "digit): the job's Service is named after it",
    _spec.DNS_SUBDOMAIN: "a DNS subdomain (DNS labels joined by '.')",
    _spec.LABEL_KEY: f"a label key ({_spec.LABEL_KEY_MEANING})",
    _spec.LABEL_VALUE: "a label value (up to 63 of A-Z a-z 0-9 - _ . and alphanumeric at both ends, or empty)",
    _spec.ENV_NAME: "an environment variable name (letters, digits and '_', not starting with a digit)",
    _spec.ABS_PATH: "an absolute path (starting with '/', without newlines)",
    _spec.QUANTITY: "a Kubernetes quantity such as 500m, 4 or 16Gi",
    _spec.IMAGE: "a container image reference such as ghcr.io/org/trainer:1.0",
    _spec.EXTENDED_RESOURCE: f"an extended resource name ({_spec.EXTENDED_RESOURCE_MEANING})",
    _spec.CONFIG_KEY: "a Secret or ConfigMap key (letters, digits, '-', '_' and '.')",
    _spec.ENV_FIELD_PATH: ("a pod field env can take: metadata.name, metadata.namespace, metadata.uid, "
                           "metadata.labels['KEY'], metadata.annotations['KEY'], spec.nodeName, "
                           "spec.serviceAccountName, status.hostIP(s) or status.podIP(s)"),
}


@dataclass(frozen=True)
class Problem:
    path: str  # e.g. "spec.parallelism.data"
    message: str
    fix: str = ""  # values that would work, where they can be named (not part of the message: the CRD's CEL twin
    # of a rule says the message alone)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f"; {self.fix}" if self.fix else "")


class SpecError(ValueError):
    """A job that must not start. `problems` lists every bad field, not just the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid ParallelTrainJob:\n" + "\n".join(f"  - {p}" for p in problems))


# pydantic's own steps inside union and validator schemas, e.g. `function-after[_check(), Spec]`, `int`.
_PYDANTIC_STEP = re.compile(r"[a-z-]+\[.*\]|int|str|float|bool|none")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _loc_to_path(loc: tuple[Any, ...], doc: Any) -> str:
    """pydantic's error location as a path into `doc`: `spec.pod.volumes[0].name`, `spec.pod.labels['a/b']`."""
    out, node = "", doc
    for i, part in enumerate(loc):
        if part == "[key]":
            continue  # pydantic's marker after a bad mapping key; the key itself is shown as [key]
        in_doc = isinstance(node, dict) and part in node
        if not in_doc and not isinstance(part, int) and _PYDANTIC_STEP.fullmatch(str(part)):
            continue  # not a field or key of the document (a user's key named `int` is)
        if isinstance(part, int) and isinstance(node, list):
            node = node[part] if part < len(node) else None
        else:
            node = node.get(part) if in_doc else None
        if isinstance(part, int):
            out += f"[{part}]"
        elif (i + 1 < len(loc) and loc[i + 1] == "[key]") or not _IDENTIFIER.fullmatch(str(part)):
            out += f"[{part!r}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """For an unknown key: the closest field its parent has (`learningRat` → `learningRate`), or a hint."""
    names = _field_names_at(ParallelTrainJob, loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else " (misspelt?)"


def _field_names_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """The field names (as the YAML spells them) of the model at `loc` inside `model`; [] when loc leaves models."""
    for part in loc:
        if isinstance(part, int) or part == "[key]":
            continue  # a list item or map value: its model is the one the field's annotation holds
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        model = _model_in(field.annotation) if field else None
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (itself, or inside Optional, list[...] or dict[..., ...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


def parse_job(doc: Any) -> ParallelTrainJob:
    """Validate a job document; raise SpecError listing every problem (field errors, then cross-field rules)."""
    if not isinstance(doc, dict):
        raise SpecError([Problem("<root>", f"expected a mapping (a ParallelTrainJob object), got {type(doc).__name__}")])
    try:
        job = ParallelTrainJob.model_validate(doc, context={"defer_cross_field": True})
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown field" + _did_you_mean(err["loc"])
            elif err["type"] == "value_error":
                msg = msg.removeprefix("Value error, ")
            elif err["type"] == "string_pattern_mismatch":
                pattern = err.get("ctx", {}).get("pattern")
                got = repr(err["input"])
                got = got if len(got) <= 80 else got[:77] + "..."
                msg = f"must be {_PATTERN_MEANING.get(pattern, f'match {pattern!r}')}, got {got}"
            if err["loc"] and err["loc"][-1] == "[key]":
                msg = f"invalid key: {msg}"
            problems.append(Problem(_loc_to_path(err["loc"], doc), msg))
        raise SpecError(problems) from None
    problems = [Problem(path, msg, fixes(job.spec).get(path, "")) for path, msg in cross_field_problems(job.spec)]
    if problems:
        raise SpecError(problems)
    return job


def parse_scalar(text: str) -> Any:
    """A `--set` value, read as a YAML scalar: `2` → 2, `true` → True, `1e-3` → 0.001, `bf16` → "bf16"."""
    value = yaml.safe_load(text) if text.strip() else ""
    if isinstance(value, str) and _NUMBER.fullmatch(text.strip()):
        return float(text)  # PyYAML (YAML 1.1) reads `1e-3` as a string; users mean a number
    return value


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `path.to.field=value` overrides (e.g. `spec.parallelism.data=2`) to a copy of `doc`."""
    out = copy.deepcopy(doc)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([Problem("--set", f"expected PATH=VALUE, got {item!r}")])
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([Problem(key, f"cannot set a field inside {part!r}: it is not a mapping")])
            node = child
        node[parts[-1]] = parse_scalar(raw)
    return out


def _expands_beyond(doc: Any, limit: int) -> bool:
    """Whether `doc`, with aliases expanded, holds more than `limit` values (walks at most `limit` of them)."""
    stack, seen = [doc], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError([Problem(str(path), f"cannot read: {exc.strerror}")]) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError([Problem(str(path), f"not valid YAML: {exc}")]) from None
    if len(docs) != 1:
        raise SpecError([Problem(str(path), f"expected one YAML document, found {len(docs)}")])
    if _expands_beyond(docs[0], MAX_YAML_VALUES):
        raise SpecError([Problem(str(path), f"expands to more than {MAX_YAML_VALUES} values (aliases repeating "
                                            "data?); a job has a few hundred")])
    return docs[0]


def load_job(path: str | Path, overrides: list[str] | None = None) -> ParallelTrainJob:
    return parse_job(apply_overrides(read_yaml(path), overrides or []))
