"""FSDP2 (ZeRO-2/3 for composed layouts) as zero.apply_fsdp configures it, in the test process (one rank)."""

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from paratrain.train.model import GPT, GPTConfig
from paratrain.train.zero import apply_fsdp


def test_every_sharded_module_sums_and_divides_on_gloo(one_rank_group):
    """Each block reduce-scatters its own gradients, so each needs the gloo settings, not only the root. torch has
    no getter for them: read them where FSDPModule's setters write them, in each module's parameter groups."""
    dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = GPT(GPTConfig(vocab_size=32, block_size=8, layers=2, heads=2, embed_dim=16))
    apply_fsdp(model, dp_mesh, zero_stage=3)
    sharded = {name or "root": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert sorted(sharded) == ["layers.0", "layers.1", "root"]
    for name, module in sharded.items():
        for group in module._get_fsdp_state()._fsdp_param_groups:
            assert (group.force_sum_reduction_for_comms, group.gradient_divide_factor) == (True, 1.0), name
