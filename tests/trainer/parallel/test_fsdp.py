"""FSDP2 (ZeRO-2/3 for composed layouts) as fsdp.apply_fsdp configures it, in the test process (one rank)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from paratrain.train.models.gpt import GPT, GPTConfig
from paratrain.train.models.weights import init_weights
from paratrain.train.parallel.fsdp import apply_fsdp


def test_every_sharded_module_sums_and_divides_on_gloo(one_rank_group):
    """Each block reduce-scatters its own gradients, so each needs the gloo settings, not only the root. torch has
    no getter for them: read them where FSDPModule's setters write them, in each module's parameter groups."""
    dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = GPT(GPTConfig(vocab_size=32, block_size=8, layers=2, heads=2, embed_dim=16))
    apply_fsdp(model, dp_mesh, zero_stage=3, precision="fp32")
    sharded = {name or "root": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert sorted(sharded) == ["layers.0", "layers.1", "root"]
    for name, module in sharded.items():
        for group in module._get_fsdp_state()._fsdp_param_groups:
            assert (group.force_sum_reduction_for_comms, group.gradient_divide_factor) == (True, 1.0), name


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("fp32", torch.float32)])
def test_sixteen_bit_runs_gather_and_compute_in_sixteen_bits_over_fp32_shards(precision, dtype, one_rank_group):
    """MixedPrecisionPolicy: each block's weights are all-gathered (and used) in the run's 16-bit type, the
    shards the optimizer steps and their gradients (reduce-scattered in fp32) stay fp32."""
    dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = GPT(GPTConfig(vocab_size=32, block_size=8, layers=2, heads=2, embed_dim=16))
    apply_fsdp(model, dp_mesh, zero_stage=3, precision=precision)
    model.to_empty(device="cpu")
    init_weights(model, seed=1)
    seen = []
    model.layers["0"].mlp.fc.register_forward_pre_hook(lambda module, _: seen.append(module.weight.dtype))
    tokens = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    assert seen == [dtype]
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
