"""Dropout under tensor parallel, in the test process: each tp rank's attention heads get masks of their own."""

import functools

import pytest
import torch

from paratrain.train.models import llama
from paratrain.train.models.gpt import Attention, GPTConfig
from paratrain.train.parallel.tensor_parallel import RNGStream

CPU = torch.device("cpu")
FAMILIES = ["gpt", "llama"]


class LlamaAttention(llama.Attention):
    """Llama's attention with its RoPE tables made here, to be called like the GPT's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, *llama.rope_tables(x.shape[1], self.head_dim, 10000.0, x.device))


def attention(dropout: float, heads_seed: int, family: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every "rank"
    if family == "llama":
        attn = LlamaAttention(llama.LlamaConfig(vocab_size=32, block_size=8, layers=1, heads=2, kv_heads=1,
                                                embed_dim=16, ffn_dim=32, dropout=dropout))
    else:
        attn = Attention(GPTConfig(vocab_size=32, block_size=8, layers=1, heads=2, embed_dim=16, dropout=dropout))
    attn.heads_rng = RNGStream(heads_seed, CPU)
    return attn


def forward_on_a_tp_rank(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output, and where the stream the tp group shares is left, after one training forward."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)  # the stream a tp group shares (the replicated activations' dropout)
    out = attn(x)
    return out, torch.get_rng_state()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_ranks_draw_their_own_attention_dropout_masks(family):
    attention_of = functools.partial(attention, family=family)
    (out0, shared0), (out1, shared1) = (forward_on_a_tp_rank(attention_of(0.5, heads_seed=100 + r)) for r in (0, 1))
    assert not torch.equal(out0, out1), "two tp ranks' heads drew the same attention-dropout masks"
    # The heads' masks came from the ranks' own streams: the shared stream moved alike on both (the residual
    # dropout drew from it, the same mask on every rank).
    assert torch.equal(shared0, shared1)
    again, _ = forward_on_a_tp_rank(attention_of(0.5, heads_seed=100))
    assert torch.equal(again, out0), "a rank's masks depend on its seeds only"


@pytest.mark.parametrize("family", FAMILIES)
def test_without_dropout_the_heads_stream_is_never_used(family):
    attn = attention(0.0, heads_seed=100, family=family)
    before = attn.heads_rng.state.clone()
    forward_on_a_tp_rank(attn)
    assert torch.equal(attn.heads_rng.state, before)
