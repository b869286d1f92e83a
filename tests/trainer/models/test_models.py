"""The model families in the test process: the spec's parameter count, FLOPs per token, grouped-query attention."""

import pytest
import torch

from paratrain.api.shapes import parameter_count
from paratrain.api.spec import Spec
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
    for name in ("layers.0.attn.wk.weight", "layers.0.attn.wv.weight"):
        state[name] = state[name].view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-6)
