"""A GPT-style decoder-only transformer, small enough to read in one sitting (after nanoGPT).

Written so each parallel mode can be applied from outside:
- q, k and v come from one fused Linear (one matmul, as nanoGPT's c_attn) whose rows are grouped by key/value
  head (`fuse_qkv`), so tensor parallel shards it by rows into whole heads, and the output projection by input
  features; attention reads the number of *local* heads from the activation shape, so it works on a shard
  unchanged;
- blocks live in a ModuleDict keyed "0".."L-1", and embeddings / final norm / head may be None, so a pipeline
  stage is the same class with the other stages' parts deleted (parameter names stay globally unique);
- no weight tying: the embedding and the head can sit on different pipeline stages.
The class attributes of GPT are the family's plan for the parallel modes and init; llama.py declares its own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    layers: int
    heads: int
    embed_dim: int
    ffn_dim: int | None = None  # None: 4 x embed_dim
    norm_eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = True  # the MLP's and the LayerNorms' (attention has none)

    def __post_init__(self) -> None:
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.embed_dim)

    @property
    def kv_heads(self) -> int:
        return self.heads  # no grouped-query attention: every query head has its own key and value


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.embed_dim // cfg.heads
        self.wqkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=False)
        self.wo = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.dropout = cfg.dropout
        self.heads_rng = None  # tensor parallel's RNGStream for the heads this rank holds; None: the default stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_heads(self.wqkv(x), self.head_dim, group=1)  # each (B, nh, T, hs)
        y = attend(q, k, v, self.dropout if self.training else 0.0, self.heads_rng)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, local C)
        return F.dropout(self.wo(y), self.dropout, self.training)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The fused projection's weight from q (nh·hs, C), k and v (nkv·hs, C): rows grouped by key/value head, each
    group its query heads' rows, then the key's and the value's ([q_0..q_g-1, k_0, v_0, q_g.., k_1, v_1, ...]).
    A tensor-parallel shard of the rows (Shard(0), nkv divisible by tp) then holds whole groups: its heads' q, k
    and v (Megatron's layout; a [q; k; v] stack would give rank 0 all of q)."""
    columns = q.shape[-1]
    return torch.cat([t.reshape(kv_heads, -1, columns) for t in (q, k, v)], dim=1).reshape(-1, columns)


def unfuse_qkv(wqkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v's weights from the fused one (fuse_qkv's inverse)."""
    columns, head_dim = wqkv.shape[-1], wqkv.shape[0] // (heads + 2 * kv_heads)
    group = wqkv.reshape(kv_heads, -1, head_dim, columns)  # (nkv, g + 2, hs, C)
    g = heads // kv_heads
    return group[:, :g].reshape(-1, columns), group[:, g].reshape(-1, columns), group[:, g + 1].reshape(-1, columns)


def split_heads(qkv: torch.Tensor, head_dim: int, group: int) -> tuple[torch.Tensor, ...]:
    """The fused projection's output (B, T, local rows) as q (B, nh, T, hs), k and v (B, nkv, T, hs), `group`
    query heads per key/value head: views where group is 1 (GPT), q a copy otherwise. One split, so backward
    assembles the fused gradient with one cat (a view or select per piece would each zero-fill the whole)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.view(B, T, -1, group + 2, head_dim).split([group, 1, 1], dim=3)  # (B, T, local nkv, ·, hs)
    return q.reshape(B, T, -1, head_dim).transpose(1, 2), k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)


def fuses_grouped_heads(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's fused attention kernels take grouped key/value heads (`enable_gqa`) for these inputs. On
    CUDA only flash (and cuDNN) do, and only in 16 bits: the memory-efficient kernel takes no `enable_gqa`, so fp32
    (and TF32) grouped-query attention would fall to the math kernel, which holds the whole attention matrix (2 GiB
    a layer for llama3-1b at batch 4, 2,048 tokens) and is about 10x slower. CPU's flash kernel takes both."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def attention_kernel(device_type: str, dtype: torch.dtype, grouped: bool) -> str:
    """The SDPA kernel `attend` aims at, for the run's first line (torch may still choose another where a kernel's
    own limits, e.g. its head size, rule it out: bench/gpu.sh prints torch's verdicts on a GPU)."""
    if device_type != "cuda":
        return f"{device_type} flash"
    if dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "memory-efficient, key/value heads repeated to the query heads" if grouped else "memory-efficient"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, heads_rng) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs), nkv dividing nh (grouped-query attention:
    query head i reads key/value head i // (nh / nkv)); where no fused kernel takes grouped heads for q's device and
    dtype (`fuses_grouped_heads`), k and v are repeated to every query head first, which the memory-efficient
    kernel takes. Dropout on these heads draws from `heads_rng` when set (tensor parallel: heads this rank alone
    holds, see tensor_parallel.py)."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not fuses_grouped_heads(q.device.type, q.dtype):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with heads_rng.fork() if dropout and heads_rng else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                              enable_gqa=k.shape[1] != q.shape[1])


def matmul_input(h: torch.Tensor) -> torch.Tensor:
    """A norm's output in autocast's compute dtype, cast once: q, k and v (the MLP's input projections) then share
    one 16-bit copy, kept for their backward, where each Linear would cast and keep a copy of its own."""
    device = h.device.type
    return h.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else h


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.embed_dim, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.embed_dim, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(matmul_input(self.ln1(x)))
        return x + self.mlp(matmul_input(self.ln2(x)))


class GPT(nn.Module):
    family = "gpt"  # spec.model.family; Hugging Face's GPT2LMHeadModel (hf.py)
    # Tensor parallel: how each Linear inside a block is sharded (tensor_parallel.py); the fused q/k/v (by whole
    # heads, see fuse_qkv) and fc by output features, wo and proj by input features.
    tp_plan = {"attn.wqkv": "colwise", "attn.wo": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
    embeddings = ("tok_emb", "pos_emb")  # the first pipeline stage's; lookups, no FLOPs per token (perf.py)
    final = ("ln_f", "head")  # the last pipeline stage's
    residual_projections = ("attn.wo.weight", "mlp.proj.weight")  # init std scaled by 1/sqrt(2 x layers)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.block_size, cfg.embed_dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps, bias=cfg.bias)
        self.head: nn.Linear | None = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 → logits (B, T, V); on a middle pipeline stage, hidden (B, T, C) → (B, T, C)."""
        h = x
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for block in self.layers.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.head is not None:
            h = self.head(h)
        return h
