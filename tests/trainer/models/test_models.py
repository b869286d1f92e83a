"""The model families in the test process: the spec's parameter count, FLOPs per token, grouped-query attention."""

import pytest
import torch

from paratrain.api.shapes import parameter_count
from paratrain.api.spec import Spec
from paratrain.train.models.gpt import fuse_qkv, unfuse_qkv
from paratrain.train.models.llama import Llama, LlamaConfig
from paratrain.train.models.registry import build_model, model_config
from paratrain.train.models.weights import init_weights
from paratrain.train.perf import model_flops_per_token

SPECS = {
    "gpt": {"layers": 2, "heads": 2, "embedDim": 32, "ffnDim": 48},
    "llama-gqa": {"family": "llama", "layers": 2, "heads": 4, "kvHeads": 2, "embedDim": 32},
    "llama3-1b": {"preset": "llama3-1b"},
}


@pytest.mark.parametrize("name", SPECS)
def test_parameter_count_from_the_spec_is_the_built_models(name):
    spec = Spec.model_validate({"model": SPECS[name]})
    with torch.device("meta"):  # shapes only: llama3-1b's 1.5B parameters allocate nothing
        model = build_model(model_config(spec, vocab_size=1000))
    assert parameter_count(spec.model, 1000) == sum(p.numel() for p in model.parameters())


def test_llama_flops_per_token_count_the_head_not_the_embedding():
    spec = Spec.model_validate({"model": SPECS["llama-gqa"]})
    cfg = model_config(spec, vocab_size=1000)
    matmul_params = parameter_count(spec.model, 1000) - 1000 * 32
    assert model_flops_per_token(cfg) == 6 * matmul_params + 12 * 2 * 32 * spec.model.block_size


def test_grouped_query_attention_is_attention_with_repeated_key_value_heads():
    """kvHeads 2 of 4 query heads equals full multi-head attention whose k/v heads are repeated (HF's repeat_kv:
    query head i reads key/value head i // 2)."""
    gqa_cfg = LlamaConfig(vocab_size=32, block_size=8, layers=1, heads=4, kv_heads=2, embed_dim=32, ffn_dim=64)
    gqa = Llama(gqa_cfg)
    init_weights(gqa, seed=3)
    mha = Llama(LlamaConfig(**{**gqa_cfg.__dict__, "kv_heads": 4}))
    state = gqa.state_dict()
    head_dim = 32 // 4
    q, k, v = unfuse_qkv(state["layers.0.attn.wqkv.weight"], heads=4, kv_heads=2)
    k, v = (t.view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(32, 32) for t in (k, v))
    state["layers.0.attn.wqkv.weight"] = fuse_qkv(q, k, v, kv_heads=4)
    mha.load_state_dict(state)
    tokens = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_fused_qkv_rows_split_into_whole_heads(heads, kv_heads):
    """The fused weight's rows, cut into kvHeads/tp equal parts (tensor parallel's Shard(0)), give each part the
    q rows of its query heads and the k and v rows of their key/value head; and unfuse_qkv inverts fuse_qkv."""
    head_dim, columns = 3, 5
    q = torch.randn(heads * head_dim, columns)
    k, v = torch.randn(2, kv_heads * head_dim, columns)
    fused = fuse_qkv(q, k, v, kv_heads)
    for got, want in zip(unfuse_qkv(fused, heads, kv_heads), (q, k, v)):
        assert torch.equal(got, want)
    group = heads // kv_heads
    for tp in (t for t in (1, 2, 4) if kv_heads % t == 0):
        for rank, part in enumerate(fused.chunk(tp)):
            kv = range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
            rows = lambda t, heads_of: torch.cat([t[h * head_dim:(h + 1) * head_dim] for h in heads_of])
            want = fuse_qkv(rows(q, [j * group + i for j in kv for i in range(group)]), rows(k, kv), rows(v, kv),
                            len(kv))
            assert torch.equal(part, want), f"tp {tp} rank {rank} holds other heads' rows"


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fused_qkv_computes_the_separate_projections_attention(family):
    """One block's attention with the fused projection equals attention written with three separate q, k, v
    matmuls of the unfused weights (the textbook form), GQA included."""
    import torch.nn.functional as F

    from paratrain.train.models.llama import apply_rope, rope_tables

    heads, kv_heads = (4, 4) if family == "gpt" else (4, 2)
    spec = Spec.model_validate({"model": {"family": family, "layers": 1, "heads": heads, "kvHeads": kv_heads,
                                          "embedDim": 32}})
    model = build_model(model_config(spec, vocab_size=16))
    init_weights(model, seed=5)
    attn = model.layers["0"].attn
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    wq, wk, wv = unfuse_qkv(attn.wqkv.weight, heads, kv_heads)
    q, k, v = (F.linear(x, w).view(2, 8, -1, 8).transpose(1, 2) for w in (wq, wk, wv))
    args = ()
    if family == "llama":
        args = rope_tables(8, 8, 10000.0, x.device)
        q, k = apply_rope(q, *args), apply_rope(k, *args)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 32)
    torch.testing.assert_close(attn(x, *args), attn.wo(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grouped", [True, False])
def test_attention_aims_at_a_fused_kernel_for_every_precision_and_head_layout(device, dtype, grouped):
    """On CUDA, only 16-bit inputs take grouped key/value heads fused (flash); fp32 grouped heads are repeated for
    the memory-efficient kernel rather than left to the math kernel. CPU's flash takes every case."""
    from paratrain.train.models.gpt import attention_kernel, fuses_grouped_heads

    half = dtype != torch.float32
    assert fuses_grouped_heads(device, dtype) is (device == "cpu" or half)
    kernel = attention_kernel(device, dtype, grouped)
    expected = ("cpu flash" if device == "cpu" else "flash" if half else
                "memory-efficient, key/value heads repeated to the query heads" if grouped else "memory-efficient")
    assert kernel == expected and "math" not in kernel


def test_repeated_key_value_heads_attend_exactly_as_grouped_ones(monkeypatch):
    """The repeat `attend` makes where no fused kernel takes grouped heads (CUDA fp32) computes what grouped-query
    attention does, forward and backward: forced here on CPU."""
    from paratrain.train.models import gpt

    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    grouped = gpt.attend(q, k, v, 0.0, None)
    grouped.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    monkeypatch.setattr(gpt, "fuses_grouped_heads", lambda device_type, dtype: False)
    repeated = gpt.attend(q, k, v, 0.0, None)
    repeated.sum().backward()
    torch.testing.assert_close(repeated, grouped)
    for t, g in zip((q, k, v), grads, strict=True):
        torch.testing.assert_close(t.grad, g)
