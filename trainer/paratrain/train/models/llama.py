"""A Llama-style decoder (Llama 2/3): RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases.

Parameter layout and conventions follow Hugging Face's LlamaForCausalLM, so its weights map one to one (hf.py):
RoPE rotates the two *halves* of each head (HF's `rotate_half`), not interleaved pairs, so q and k need no
permutation. Built to be parallelised from outside exactly like the GPT (model.py):
- q, k and v are one fused Linear grouped by key/value head (gpt.fuse_qkv; hf.py splits it into HF's three),
  o and gate, up, down separate: tensor parallel shards the fused q/k/v (by whole key/value groups) and gate/up by
  output features, o and down by input features (`tp_plan`); attention reads its *local* head counts from the
  shapes;
- blocks live in a ModuleDict keyed "0".."L-1", and the embedding / final norm / head may be None on a pipeline
  stage (`embeddings`, `final`);
- the embedding and the head are separate matrices (untied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import attend, matmul_input, split_heads


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    block_size: int
    layers: int
    heads: int
    kv_heads: int
    embed_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hs), in fp32: position t rotates frequency i by t / theta^(2i/hs); both halves of a
    head share the frequencies (HF's layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated by position; computed in fp32 (one copy of x, not two) and returned in x's
    dtype."""
    wide = x.float()
    x1, x2 = wide.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half
    return (wide * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.embed_dim // cfg.heads
        self.group = cfg.heads // cfg.kv_heads  # query heads per key/value head
        self.wqkv = nn.Linear(cfg.embed_dim, cfg.embed_dim + 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=False)
        self.dropout = cfg.dropout
        self.heads_rng = None  # tensor parallel's RNGStream for the heads this rank holds; None: the default stream

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallel each rank holds heads / tp query and kvHeads / tp key/value heads.
        q, k, v = split_heads(self.wqkv(x), self.head_dim, self.group)  # (B, nh, T, hs), (B, nkv, T, hs) twice
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # v alone, so attention keeps it for backward and not the whole projection's output (q and k are rotated
        # copies already): at Llama 3 8B's widths that is 1,024 of 6,144 columns per token and layer.
        v = v.contiguous()
        # Query head i reads key/value head i // (nh / nkv), as HF's repeat_kv; the same on a tp shard.
        y = attend(q, k, v, self.dropout if self.training else 0.0, self.heads_rng)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, local C)
        return F.dropout(self.wo(y), self.dropout, self.training)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.embed_dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.embed_dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.embed_dim, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(matmul_input(self.attn_norm(x)), cos, sin)
        return x + self.mlp(matmul_input(self.mlp_norm(x)))


class Llama(nn.Module):
    # The family's plan for the parallel modes and init (see model.GPT for what each means).
    family = "llama"
    tp_plan = {"attn.wqkv": "colwise", "attn.wo": "rowwise", "mlp.gate": "colwise", "mlp.up": "colwise",
               "mlp.down": "rowwise"}
    embeddings = ("tok_emb",)
    final = ("norm", "head")
    residual_projections = ("attn.wo.weight", "mlp.down.weight")

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 → logits (B, T, V); on a middle pipeline stage, hidden (B, T, C) → (B, T, C)."""
        h = self.tok_emb(x) if self.tok_emb is not None else x  # (B, T, C)
        cos, sin = rope_tables(x.shape[1], self.cfg.embed_dim // self.cfg.heads, self.cfg.rope_theta, x.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h
