"""What the API server refuses beyond the OpenAPI schemas (which kubernetes-validate checks): name formats, label
syntax, annotation and ConfigMap size limits — the rules of k8s.io/apimachinery validation, as of Kubernetes 1.30."""

from __future__ import annotations

import re
from typing import Any

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Service names
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
ENV_VAR_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
IANA_SVC_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
TOTAL_ANNOTATION_BYTES = 256 * 1024
CONFIG_MAP_BYTES = 1024 * 1024


def _name(value: Any, rule: re.Pattern, max_len: int) -> bool:
    return isinstance(value, str) and len(value) <= max_len and rule.fullmatch(value) is not None


def _qualified_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return (not prefix or _name(prefix, DNS1123_SUBDOMAIN, 253)) and _name(name, QUALIFIED_NAME, 63)


def problems(obj: dict[str, Any]) -> list[str]:
    out = []
    kind, meta = obj["kind"], obj["metadata"]
    if kind == "Service":
        ok = _name(meta["name"], DNS1035_LABEL, 63)
    else:
        ok = _name(meta["name"], DNS1123_SUBDOMAIN, 253)
    if not ok:
        out.append(f"{kind} metadata.name {meta['name']!r}")
    if not _name(meta.get("namespace", "default"), DNS1123_LABEL, 63):
        out.append(f"{kind} metadata.namespace {meta.get('namespace')!r}")
    for key, value in meta.get("labels", {}).items():
        if not _qualified_key(key) or not _name(value, LABEL_VALUE, 63):
            out.append(f"{kind} label {key!r}: {value!r}")
    annotations = meta.get("annotations", {})
    out += [f"{kind} annotation key {key!r}" for key in annotations if not _qualified_key(key)]
    if sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) > TOTAL_ANNOTATION_BYTES:
        out.append(f"{kind} annotations exceed {TOTAL_ANNOTATION_BYTES} bytes")
    if kind == "ConfigMap":
        out += [f"ConfigMap data key {key!r}" for key in obj["data"] if not _name(key, CONFIG_MAP_KEY, 253)]
        if sum(len(k.encode()) + len(v.encode()) for k, v in obj["data"].items()) > CONFIG_MAP_BYTES:
            out.append(f"ConfigMap data exceeds {CONFIG_MAP_BYTES} bytes")
    if kind == "Pod":
        spec = obj["spec"]
        for field in ("hostname", "subdomain"):
            if field in spec and not _name(spec[field], DNS1123_LABEL, 63):
                out.append(f"Pod spec.{field} {spec[field]!r}")
        volumes = [v["name"] for v in spec.get("volumes", [])]
        out += [f"Pod volume name {v!r}" for v in volumes if not _name(v, DNS1123_LABEL, 63)]
        if len(set(volumes)) != len(volumes):
            out.append(f"Pod volume names repeat: {volumes}")
        for c in spec["containers"]:
            out += [f"Pod env name {e['name']!r}" for e in c.get("env", [])
                    if not _name(e["name"], ENV_VAR_NAME, 1 << 20)]
            out += [f"Pod port name {p['name']!r}" for p in c.get("ports", [])
                    if "name" in p and not (_name(p["name"], IANA_SVC_NAME, 15) and re.search("[a-z]", p["name"]))]
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            out += [f"Pod mount of unknown volume {m['name']!r}" for m in c.get("volumeMounts", [])
                    if m["name"] not in volumes]
            if len(set(mounts)) != len(mounts):
                out.append(f"Pod mountPaths repeat: {mounts}")
    return out
