"""Model shapes: named presets, each family's defaults, and the parameter count of a spec. Pure: no torch.

A shape field (`SHAPE_FIELDS`) has no schema default: left out, it comes from `spec.model.preset`, else from the
family's default. With a schema default the API server would fill it in before paratrain sees the job, and a
preset could never tell an explicit value from a default one. `resolve` fills them in while a ModelSpec is
validated, so after validation every shape field is a plain value; the CRD's CEL rules compute the same values
(crd.py, `model_value`).
"""

from __future__ import annotations

from typing import Any, Protocol


class ModelShape(Protocol):
    """What the counts here read of a validated `spec.model` (spec.ModelSpec has these attributes)."""

    family: str
    layers: int
    heads: int
    kv_heads: int
    embed_dim: int
    ffn_dim: int
    block_size: int
    bias: bool

FAMILIES = ("gpt", "llama")
DEFAULT_FAMILY = "gpt"
# camelCase (as written in a job) → the ModelSpec attribute.
SHAPE_FIELDS = {"family": "family", "layers": "layers", "heads": "heads", "kvHeads": "kv_heads",
                "embedDim": "embed_dim", "ffnDim": "ffn_dim", "ropeTheta": "rope_theta", "normEps": "norm_eps",
                "bias": "bias"}
# The defaults both families share; kvHeads, ffnDim, ropeTheta and bias are the family's (family_default). normEps
# has no schema default either: Helm's toYaml writes 1e-5 as `1e-05`, which YAML 1.1 readers take for a string.
BASE_DEFAULTS = {"layers": 4, "heads": 4, "embedDim": 128, "normEps": 1e-5}
LLAMA_ROPE_THETA = 10000.0
LLAMA_FFN_MULTIPLE = 256

# Architecture only: the vocabulary comes from the data, the context length (blockSize) is the job's choice.
# Llama 3.2 1B/3B tie their embeddings to the head; paratrain's are untied, so those have one more V x C matrix.
PRESETS: dict[str, dict[str, Any]] = {
    "debug": {"family": "llama", "layers": 2, "heads": 4, "kvHeads": 2, "embedDim": 64, "ffnDim": 192,
              "ropeTheta": 10000.0},
    "gpt2": {"family": "gpt", "layers": 12, "heads": 12, "kvHeads": 12, "embedDim": 768, "ffnDim": 3072},
    "llama-160m": {"family": "llama", "layers": 12, "heads": 12, "kvHeads": 12, "embedDim": 768, "ffnDim": 3072,
                   "ropeTheta": 10000.0},
    "llama3-1b": {"family": "llama", "layers": 16, "heads": 32, "kvHeads": 8, "embedDim": 2048, "ffnDim": 8192,
                  "ropeTheta": 500000.0},
    "llama3-3b": {"family": "llama", "layers": 28, "heads": 24, "kvHeads": 8, "embedDim": 3072, "ffnDim": 8192,
                  "ropeTheta": 500000.0},
    "llama3-8b": {"family": "llama", "layers": 32, "heads": 32, "kvHeads": 8, "embedDim": 4096, "ffnDim": 14336,
                  "ropeTheta": 500000.0},
}


def llama_ffn_dim(embed_dim: int) -> int:
    """Meta's SwiGLU width: 2/3 of 4 x embedDim (the parameters of a 4x GELU MLP), rounded up to 256."""
    m = LLAMA_FFN_MULTIPLE
    return m * ((8 * embed_dim // 3 + m - 1) // m)


def family_default(family: str, field: str, shape: dict[str, Any]) -> Any:
    """A family's value for `field` when neither the job nor its preset sets it; `shape` holds the validated
    layers, heads and embedDim (kvHeads and ffnDim derive from them)."""
    if field in BASE_DEFAULTS:
        return BASE_DEFAULTS[field]
    if field == "kvHeads":
        return shape["heads"]
    if field == "ffnDim":
        return llama_ffn_dim(shape["embedDim"]) if family == "llama" else 4 * shape["embedDim"]
    if field == "ropeTheta":
        return LLAMA_ROPE_THETA if family == "llama" else None  # GPT learns position embeddings
    if field == "bias":
        return family == "gpt"  # GPT-2's MLP and LayerNorm biases; Llama has none
    raise KeyError(field)


DERIVED = ("kvHeads", "ffnDim")  # defaults computed from other fields: filled in after those are validated


def resolve(data: dict[str, Any]) -> dict[str, Any]:
    """A raw `spec.model` mapping with the shape fields filled in: explicit value, else the preset's (ropeTheta
    only for a llama family), else the family's; DERIVED ones without a value stay None until `derive` (a bad heads
    must not also be reported as a bad kvHeads). Values that would fail validation are left for it to report."""
    out = dict(data)

    def given(field: str) -> Any:
        return out.get(field, out.get(SHAPE_FIELDS[field]))

    preset = PRESETS.get(out.get("preset")) if isinstance(out.get("preset"), str) else None
    preset = preset or {}
    family = given("family") or preset.get("family", DEFAULT_FAMILY)
    shape: dict[str, Any] = {"family": family}
    for field in SHAPE_FIELDS:
        if field == "family":
            continue
        value = given(field)
        if value is None and field in preset and (field != "ropeTheta" or family == "llama"):
            value = preset[field]
        if value is None and family in FAMILIES and field not in DERIVED:
            value = family_default(family, field, shape)
        shape[field] = value
    for field, value in shape.items():
        out.pop(SHAPE_FIELDS[field], None)
        out[field] = value
    return out


def derive(model: ModelShape) -> dict[str, Any]:
    """The DERIVED fields `resolve` left None, from the validated others, by ModelSpec attribute name."""
    shape = {"heads": model.heads, "embedDim": model.embed_dim}
    return {SHAPE_FIELDS[f]: family_default(model.family, f, shape) for f in DERIVED
            if getattr(model, SHAPE_FIELDS[f]) is None}


def parameter_count(model: ModelShape, vocab_size: int) -> int:
    """Parameters of the model paratrain builds for a validated `spec.model` (embedding and head untied)."""
    c, f, layers = model.embed_dim, model.ffn_dim, model.layers
    if model.family == "gpt":
        b = int(model.bias)  # the MLP's and LayerNorms' biases
        per_layer = 2 * (1 + b) * c + 4 * c * c + (c * f + b * f) + (f * c + b * c)  # ln1, ln2, q/k/v/o, fc, proj
        return vocab_size * c + model.block_size * c + layers * per_layer + (1 + b) * c + c * vocab_size
    kv = model.kv_heads * (c // model.heads)
    per_layer = c + 2 * c * c + 2 * c * kv + c + 3 * c * f  # attn norm, q/o, k/v, mlp norm, gate/up/down
    return vocab_size * c + layers * per_layer + c + c * vocab_size
