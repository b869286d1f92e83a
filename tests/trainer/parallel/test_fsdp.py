"""FSDP2 (ZeRO-2/3 for composed layouts) as fsdp.apply_fsdp configures it, in the test process (one rank) and on
two gloo ranks."""

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from paratrain.train.models.gpt import GPT, GPTConfig
from paratrain.train.models.weights import init_weights
from paratrain.train.parallel.fsdp import apply_fsdp

from ..harness import spawn_ranks


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



def count_gathers(rank: int, store_file: str, zero_stage: int, out: str) -> None:
    import torch.distributed as dist

    from .test_tp_collectives import collective_counter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model = GPT(GPTConfig(vocab_size=32, block_size=8, layers=2, heads=2, embed_dim=16))
        apply_fsdp(model, dp_mesh, zero_stage=zero_stage, precision="fp32")
        model.to_empty(device="cpu")
        init_weights(model, seed=1)
        tokens = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the second step, after FSDP2's lazy initialisation
            with collective_counter() as counted:
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(counted.counts))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("zero_stage,gathers", [(3, 4), (2, 3)])
def test_backward_gathers_again_only_what_forward_freed(zero_stage, gathers, tmp_path):
    """Issue 44: ZeRO-3 freed the root's weights (embeddings, final norm, head) and the last block's after forward,
    and backward gathered them again at once. Two blocks and the root on 2 ranks: ZeRO-3 gathers the root and
    each block in forward and block 0 again in backward (4, was 6); ZeRO-2 keeps all of them gathered (3). Each
    module reduce-scatters its gradients once."""
    out = tmp_path / "counts.json"
    spawn_ranks(count_gathers, 2, str(tmp_path / "store"), zero_stage, str(out))
    counts = json.loads(out.read_text())
    assert sum(n for name, n in counts.items() if "gather" in name) == gathers, counts
    assert sum(n for name, n in counts.items() if "reduce_scatter" in name) == 3, counts
