"""Hugging Face interop: a full paratrain model state dict ↔ `LlamaForCausalLM` / `GPT2LMHeadModel` weights.

    export_hf(job, model_state, "out/")       # config.json + model.safetensors or shards (+ tokenizer.json)
    spec.model.init: out/                      # train from such a directory (load_hf_into, every layout)

Llama's tensors are renamed (llama.py follows HF's rotate_half RoPE, so q/k need no permutation), and paratrain's
fused q/k/v, grouped by key/value head (gpt.fuse_qkv), is split into HF's three. GPT-2 keeps its matrices as Conv1D
(in, out), transposed from a Linear's (out, in), and stacks q/k/v as [q; k; v] in one `c_attn`; the biases it has
and paratrain's GPT has not (attention's, and with model.bias false the MLP's and LayerNorms') are written as zeros
and must be zeros on the way in.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ...api import ParallelTrainJob
from ..parallel.tensors import copy_into, full_shape_of
from .hf_config import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, WEIGHTS_INDEX, config_json, weight_shards
from .gpt import GPTConfig, fuse_qkv, unfuse_qkv
from .registry import MODELS, ModelConfig, build_model, model_config

# (paratrain name, Hugging Face name) as regular expression and replacement, per family.
NAMES = {
    "llama": [
        (r"tok_emb\.weight", "model.embed_tokens.weight"),
        (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
        (r"layers\.(\d+)\.attn\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
        (r"layers\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"layers\.(\d+)\.mlp\.(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
        (r"norm\.weight", "model.norm.weight"),
        (r"head\.weight", "lm_head.weight"),
    ],
    "gpt": [
        (r"tok_emb\.weight", "transformer.wte.weight"),
        (r"pos_emb\.weight", "transformer.wpe.weight"),
        (r"layers\.(\d+)\.ln([12])\.(weight|bias)", r"transformer.h.\1.ln_\2.\3"),
        (r"layers\.(\d+)\.attn\.wo\.weight", r"transformer.h.\1.attn.c_proj.weight"),
        (r"layers\.(\d+)\.mlp\.(fc|proj)\.(weight|bias)", r"transformer.h.\1.mlp.c_\2.\3"),
        (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
        (r"head\.weight", "lm_head.weight"),
    ],
}
FUSED_QKV = re.compile(r"layers\.(\d+)\.attn\.wqkv\.weight")
TIED_EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt": "transformer.wte.weight"}


def hf_name(family: str, name: str) -> str:
    for pattern, replacement in NAMES[family]:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise KeyError(f"{name}: no Hugging Face counterpart in family {family}")


def _conv1d(family: str, hf: str) -> bool:
    """GPT-2's block matrices are Conv1D weights, (in, out)."""
    return family == "gpt" and hf.startswith("transformer.h.") and re.search(r"\.c_\w+\.weight$", hf) is not None


def _llama_qkv(layer: str) -> list[str]:
    return [f"model.layers.{layer}.self_attn.{x}_proj.weight" for x in "qkv"]


def _missing_bias(cfg: ModelConfig, hf: str) -> str | None:
    """The GPT-2 bias beside the weight `hf` that paratrain's model `cfg` has no parameter for: attention's output
    projection's always (c_attn's is handled with q/k/v), the MLP's and LayerNorms' where model.bias is false."""
    if not (isinstance(cfg, GPTConfig) and hf.startswith("transformer.") and hf.endswith(".weight")):
        return None
    if hf.endswith(".attn.c_proj.weight") or (not cfg.bias and re.search(r"\.(ln_\w+|mlp\.c_\w+)\.weight$", hf)):
        return hf.removesuffix(".weight") + ".bias"
    return None


def to_hf(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full paratrain state dict of the model `cfg` as the Hugging Face model's."""
    return {hf: t for name, tensor in state.items() for hf, t in to_hf_tensors(cfg, name, tensor).items()}


def to_hf_tensors(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """paratrain's parameter `name` of the model `cfg` as the Hugging Face tensors it becomes (q/k/v split, GPT-2's
    Conv1D transposes, the zero biases paratrain's GPT has no parameter for), in their order in the HF state."""
    family = MODELS[type(cfg)].family
    if m := FUSED_QKV.fullmatch(name):
        qkv = unfuse_qkv(tensor, cfg.heads, cfg.kv_heads)
        if family == "llama":
            return {hf: t.contiguous() for hf, t in zip(_llama_qkv(m[1]), qkv)}
        # c_attn: [q; k; v] stacked by output features, stored (in, out)
        return {f"transformer.h.{m[1]}.attn.c_attn.weight": torch.cat(qkv).T.contiguous(),
                f"transformer.h.{m[1]}.attn.c_attn.bias": torch.zeros(sum(len(t) for t in qkv),
                                                                      device=tensor.device)}
    hf = hf_name(family, name)
    out = {hf: tensor.T.contiguous() if _conv1d(family, hf) else tensor.contiguous()}
    if bias := _missing_bias(cfg, hf):
        out[bias] = torch.zeros(tensor.shape[0], device=tensor.device)  # the output features (a Linear's rows)
    return out


def from_hf(cfg: ModelConfig, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The full tensor of paratrain's parameter `name` in the model `cfg`, from Hugging Face tensors fetched by
    `get(hf_name)`."""
    family = MODELS[type(cfg)].family
    if m := FUSED_QKV.fullmatch(name):
        if family == "llama":
            return fuse_qkv(*map(get, _llama_qkv(m[1])), kv_heads=cfg.kv_heads)
        prefix = f"transformer.h.{m[1]}.attn."
        _require_zero_bias(get, prefix + "c_attn.bias")
        return fuse_qkv(*get(prefix + "c_attn.weight").T.chunk(3), kv_heads=cfg.kv_heads)  # (3C, C) → q, k, v
    hf = hf_name(family, name)
    if bias := _missing_bias(cfg, hf):
        _require_zero_bias(get, bias)
    tensor = get(hf)
    return tensor.T if _conv1d(family, hf) else tensor


def _require_zero_bias(get: Callable[[str], torch.Tensor], hf: str) -> None:
    try:
        bias = get(hf)
    except KeyError:
        return
    if bias.any():
        raise ValueError(f"spec.model.init: {hf} is not zero: paratrain's GPT has no such bias (attention never; the "
                         "MLP and LayerNorms where model.bias is false), so these weights (e.g. OpenAI's GPT-2) "
                         "cannot be loaded exactly")


@torch.no_grad()
def load_hf_into(model: nn.Module, directory: str | Path) -> None:
    """Every parameter this rank holds (a pipeline stage's, tensor-parallel or FSDP2 shards) from the Hugging Face
    directory: each full tensor is read, and this rank's part copied in, as init_weights does."""
    from safetensors import safe_open

    shards = weight_shards(directory)  # a sharded checkpoint's index, or {} for one model.safetensors
    with contextlib.ExitStack() as stack:
        files = {file: stack.enter_context(safe_open(str(Path(directory) / file), framework="pt"))
                 for file in sorted(set(shards.values())) or [WEIGHTS_FILE]}
        where = shards or dict.fromkeys(files[WEIGHTS_FILE].keys(), WEIGHTS_FILE)

        def get(hf: str) -> torch.Tensor:
            if hf == "lm_head.weight" and hf not in where:  # tied embeddings (Llama 3.2 1B/3B): an untied copy
                hf = TIED_EMBEDDING[model.family]
            if hf not in where:
                raise KeyError(hf)
            return files[where[hf]].get_tensor(hf)

        for name, param in model.named_parameters():
            try:
                full = from_hf(model.cfg, name, get)
            except KeyError as exc:
                raise ValueError(f"spec.model.init: {directory} has no {exc} (for {name})") from None
            if full.shape != full_shape_of(param):
                raise ValueError(f"spec.model.init: {name} is {tuple(full.shape)} in {directory}, the spec's model "
                                 f"needs {tuple(full_shape_of(param))}")
            copy_into(param, full.float())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default (max_shard_size="5GB")
STAGING_PREFIX = ".paratrain-export-"


def export_hf(job: ParallelTrainJob, model_state: Mapping[str, torch.Tensor], out_dir: str | Path,
              tokenizer_json: str | Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              dtype: str = "fp32") -> Path:
    """Write a full (unsharded) paratrain model state as a Hugging Face model directory: config.json, the weights
    in `dtype` (fp32 or bf16) as model.safetensors, or where they pass `max_shard_bytes` as shards
    model-0000i-of-0000n.safetensors with model.safetensors.index.json (transformers' layout: each shard filled in
    order up to the limit, a tensor larger than it alone in its own), and, if given, tokenizer.json. Every file is
    written first into a directory of its own inside `out_dir`, then renamed into place, and only then are an
    earlier export's weight files that this one does not have removed: an export that fails midway leaves the
    earlier one whole. Other files there are left alone. Returns the directory.

    `model_state` is read one tensor at a time, in order, and a shard is written as soon as its tensors are there:
    with a mapping that reads each tensor when asked (checkpoint.CheckpointModel, whose `shapes` give the shapes
    without reading) the export holds one shard and one parameter, not the model (32 GB in fp32 at 8B)."""
    spec = job.spec
    shapes = getattr(model_state, "shapes", None) or {k: v.shape for k, v in model_state.items()}
    vocab_size = shapes["tok_emb.weight"][0]
    cfg = model_config(spec, vocab_size)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in build_model(cfg).state_dict().items()}
    got = {k: torch.Size(v) for k, v in shapes.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(k for k in got if got[k] != expected[k])
        raise ValueError(f"the model state is not the full model of {job.metadata.name}'s spec "
                         f"(differs at {', '.join(wrong[:5])}): export needs every parameter, unsharded")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{STAGING_PREFIX}*"):  # a killed export's
        shutil.rmtree(stale, ignore_errors=True)
    # Written into a directory of its own inside `out`, then moved in: a failure midway (a full disk, a kill)
    # leaves the earlier export whole, never a directory of mixed or missing weights.
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        written = _write_hf(spec, cfg, got, model_state, staging, tokenizer_json, max_shard_bytes, dtype)
        _usual_modes(staging)
        for name in written:  # each rename replaces a file (or a planted link) whole
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in [out / WEIGHTS_FILE, out / WEIGHTS_INDEX, *out.glob("model-*-of-*.safetensors")]:
        if old.name not in written and (old.is_symlink() or old.exists()):  # an earlier export's: one set of weights
            old.unlink()
    return out


def _write_hf(spec, cfg, got: dict[str, torch.Size], model_state: Mapping[str, torch.Tensor], out: Path,
              tokenizer_json: str | Path | None, max_shard_bytes: int, dtype: str) -> list[str]:
    """export_hf's files, written into the empty directory `out`; their names."""
    from safetensors.torch import save_file

    vocab_size = got["tok_emb.weight"][0]
    config = config_json(spec.model, vocab_size) | {"torch_dtype": str(DTYPES[dtype]).removeprefix("torch.")}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    with torch.device("meta"):  # the HF tensors' names, order and sizes, for the shard plan, without the data
        planned = to_hf(cfg, {k: torch.empty(v) for k, v in got.items()})
    shards = shard_names(planned, max_shard_bytes, DTYPES[dtype].itemsize)
    remaining = {file: {name for name, f in shards.items() if f == file} for file in set(shards.values())}
    pending: dict[str, torch.Tensor] = {}
    for name in got:
        pending.update((hf, t.detach().to("cpu", DTYPES[dtype])) for hf, t in
                       to_hf_tensors(cfg, name, model_state[name]).items())
        for file, names in remaining.items():
            if names and names <= pending.keys():
                save_file({hf: pending.pop(hf) for hf in sorted(names)}, str(out / file), metadata={"format": "pt"})
                names.clear()
    if pending or any(remaining.values()):  # the plan (on the meta device) and the tensors disagreed
        raise AssertionError(f"export wrote no file for {sorted(pending or set().union(*remaining.values()))[:5]}")
    if len(remaining) > 1:
        total = sum(t.numel() for t in planned.values()) * DTYPES[dtype].itemsize
        (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": shards},
                                                    indent=2) + "\n")
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, out / TOKENIZER_FILE)
    return sorted(p.name for p in out.iterdir())


def shard_names(tensors: dict[str, torch.Tensor], max_shard_bytes: int, itemsize: int) -> dict[str, str]:
    """Tensor name → its file: every tensor in model.safetensors where all fit in `max_shard_bytes`, else shards
    filled in order (a tensor larger than the limit alone in its own), named as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], WEIGHTS_FILE)
    return {name: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, group in enumerate(groups)
            for name in group}


def _usual_modes(out: Path) -> None:
    """Give the files the mode any new file gets here (0644 under the usual umask): safetensors writes its file
    0600, beside 0644 config.json, and a model directory is made to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        if path.is_file() and not path.is_symlink():  # a link's target is not ours to change
            path.chmod(0o666 & ~umask)
