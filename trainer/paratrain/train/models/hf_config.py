"""Hugging Face `config.json` for a spec's model, and what keeps a Hugging Face directory from being its weights.

Torch-free: `paratrain run` checks `spec.model.init` with it before any process starts (launch.preflight).
Llama maps to `LlamaForCausalLM`; the GPT to `GPT2LMHeadModel` (exact GELU is GPT-2's `activation_function:
"gelu"`; the untied head is `tie_word_embeddings: false`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...api.spec import ModelSpec

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint: tensor name → the file holding it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}


def config_json(model: ModelSpec, vocab_size: int) -> dict[str, Any]:
    """The config.json of `model` over `vocab_size` tokens (transformers 4.x reads rope_theta, 5.x rope_parameters)."""
    m = model
    if m.family == "llama":
        return {
            "architectures": [ARCHITECTURES["llama"]], "model_type": "llama", "vocab_size": vocab_size,
            "hidden_size": m.embed_dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.layers,
            "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_dim": m.embed_dim // m.heads,
            "max_position_embeddings": m.block_size, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
            "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        }
    # GPT-2's own end-of-text token (50256, transformers' default for both ids) only where the vocabulary has it: a
    # character or small BPE vocabulary has no such token, and transformers warns at every load of one that names it.
    special = 50256 if vocab_size > 50256 else None
    return {
        "architectures": [ARCHITECTURES["gpt"]], "model_type": "gpt2", "vocab_size": vocab_size,
        "bos_token_id": special, "eos_token_id": special,
        "n_embd": m.embed_dim, "n_inner": m.ffn_dim, "n_layer": m.layers, "n_head": m.heads,
        "n_positions": m.block_size, "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu",
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "resid_pdrop": m.dropout, "embd_pdrop": 0.0, "attn_pdrop": m.dropout, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _rope(config: dict[str, Any]) -> tuple[float | None, Any]:
    """(rope theta, the scaling it asks for besides plain RoPE, or None)."""
    params = config.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def mismatches(model: ModelSpec, config: dict[str, Any], vocab_size: int | None) -> list[str]:
    """What in a Hugging Face config.json differs from `model` (vocab_size too, where known): empty if its weights
    can initialise this spec's model."""
    expected = config_json(model, vocab_size if vocab_size is not None else config.get("vocab_size"))
    if config.get("model_type") != expected["model_type"]:
        return [f"model_type is {config.get('model_type')!r}, spec.model.family {model.family} needs "
                f"{expected['model_type']!r}"]
    out = []
    if model.family == "llama":
        config = {"num_key_value_heads": config.get("num_attention_heads"), "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False, **config}
        theta, scaling = _rope(config)
        if scaling:
            out.append(f"rope scaling {scaling} is not supported (plain RoPE only)")
        if theta != model.rope_theta:
            out.append(f"rope_theta is {theta}, the spec's ropeTheta {model.rope_theta}")
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias")
        if config.get("head_dim", expected["head_dim"]) != expected["head_dim"]:
            out.append(f"head_dim is {config['head_dim']}, the spec's embedDim/heads {expected['head_dim']}")
    else:
        config = {"n_inner": None, "activation_function": "gelu_new", **config}
        config["n_inner"] = config["n_inner"] or 4 * config.get("n_embd", 0)
        keys = ("vocab_size", "n_embd", "n_inner", "n_layer", "n_head", "n_positions", "layer_norm_epsilon",
                "activation_function")
    out += [f"{k} is {config.get(k)!r}, the spec's {expected[k]!r}" for k in keys if config.get(k) != expected[k]]
    return out


def read_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a Hugging Face model directory; ValueError (naming spec.model.init) if unreadable."""
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"spec.model.init: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"spec.model.init: {path} holds a JSON {type(config).__name__}, not an object")
    return config


def weight_shards(directory: str | Path) -> dict[str, str]:
    """Tensor name → the safetensors file holding it, from a sharded checkpoint's index (Hugging Face's
    `model.safetensors.index.json`); empty for a single model.safetensors. ValueError (naming spec.model.init) for
    an index that is unreadable or names a file that is not a bare name in the directory."""
    directory = Path(directory)
    path = directory / WEIGHTS_INDEX
    if (directory / WEIGHTS_FILE).is_file() or not path.is_file():
        return {}
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"spec.model.init: cannot read {path}: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"spec.model.init: {path} has no weight_map")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not (directory / file).is_file():
            raise ValueError(f"spec.model.init: {path} puts {name} in {file!r}, not a file in {directory}")
    return weight_map


def init_problem(model: ModelSpec, vocab_size: int | None) -> str | None:
    """Why `model.init` cannot initialise this model (missing directory or files, other shapes), or None."""
    directory = Path(model.init)
    weights = (directory / WEIGHTS_FILE).is_file() or (directory / WEIGHTS_INDEX).is_file()
    if not (directory / CONFIG_FILE).is_file() or not weights:
        return (f"{model.init}: not a Hugging Face model directory with {CONFIG_FILE} and {WEIGHTS_FILE} (or "
                f"{WEIGHTS_INDEX} and its shards; looked in {directory.resolve()})")
    try:
        config = read_config(directory)
        weight_shards(directory)
    except ValueError as exc:
        return str(exc).removeprefix("spec.model.init: ")
    wrong = mismatches(model, config, vocab_size)
    return f"{model.init} holds another model: " + "; ".join(wrong) if wrong else None
