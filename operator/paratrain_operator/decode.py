"""Bounded JSON decoding of what the API server sends: one tenant's object must never stop the operator.

The API server accepts JSON nested up to 10,000 levels in any `x-kubernetes-preserve-unknown-fields` section,
and Python's decoder raises RecursionError near 1,000 (and any later deepcopy, diff or dump of a deep object
fails the same way, wherever the stack already stands). So every decode of API data here refuses nesting past
MAX_DEPTH before it parses, and refuses anything that is not JSON, with one exception type, `Undecodable`, that
says what was refused. No Kubernetes object the operator reads comes near the bound (a pod is about 10 levels
deep, the ParallelTrainJob schema about 12).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64
_STRING = re.compile(rb'"[^"]*"')  # a JSON string, once its escaped backslashes and quotes are gone
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_CURLY_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
HEAD_BYTES = 64 * 1024  # where an object's metadata is looked for (it comes first in the API server's JSON)


class Undecodable(ValueError):
    """Data the operator will not decode: nested deeper than MAX_DEPTH, or not JSON."""

    def __init__(self, reason: str, head: bytes = b""):
        super().__init__(reason)
        self.reason, self.ref = reason, ObjectRef.of(head)


@dataclass(frozen=True)
class ObjectRef:
    """What the first bytes of an object (or of a watch event holding one) say it is, as far as they tell."""

    kind: str = ""
    namespace: str = ""
    name: str = ""
    uid: str = ""
    generation: str = ""

    @classmethod
    def of(cls, head: bytes) -> ObjectRef:
        head = head[:HEAD_BYTES]
        obj = head.partition(b'"object":')[2] or head  # a watch event names its object after "object"
        meta = obj.partition(b'"metadata":')[2]
        found = {}
        for key, where in (("kind", obj), ("namespace", meta), ("name", meta), ("uid", meta)):
            match = re.search(rb'"%s":"([^"\\]{1,253})"' % key.encode(), where)
            found[key] = match.group(1).decode("ascii", "replace") if match else ""
        generation = re.search(rb'"generation":(\d{1,19})', meta)
        return cls(**found, generation=generation.group(1).decode() if generation else "")

    def __str__(self) -> str:
        return f"{self.kind or 'object'} {self.namespace or '?'}/{self.name or '?'}"


def deeper_than(data: bytes | bytearray, limit: int) -> bool:
    """Whether the JSON text nests objects and arrays more than `limit` levels deep. Linear in the data's brackets
    per level checked, all in C: strings are cut out, every other byte but brackets dropped, and each round removes
    the innermost pairs; what is left after `limit` rounds is deeper than that."""
    if data.count(b"[") + data.count(b"{") <= limit:  # too few brackets to nest that deep: most objects
        return False
    # Escapes first (outside strings JSON has no backslash): then a string is `"[^"]*"`, one opcode to the regex
    # engine, where a pattern that steps over escapes keeps state per escape (hundreds of MiB for 7 MB of \u003c).
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKETS).translate(_CURLY_AS_SQUARE)
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):  # empty, or unbalanced (not JSON: the parser says so)
            return False
        brackets = shorter
    return b"[]" in brackets


def loads(data: bytes | bytearray | str, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing nesting past `max_depth` and anything that is not JSON with `Undecodable`. A
    bytearray is decoded where it lies (a page of megabytes is not copied first)."""
    raw = data.encode() if isinstance(data, str) else data
    if deeper_than(raw, max_depth):
        raise Undecodable(f"nested deeper than {max_depth} levels", bytes(raw[:HEAD_BYTES]))
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise Undecodable(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})", bytes(raw[:HEAD_BYTES])) from None
