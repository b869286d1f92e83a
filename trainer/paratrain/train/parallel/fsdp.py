"""ZeRO-2/3 for composed layouts (tensor or pipeline parallel), through FSDP2. Data-parallel-only layouts use
DeepSpeed (deepspeed_engine.py) with the same stage semantics; stage 1 is zero1.py.

- stage 2: gradients sharded — FSDP2 without resharding after forward (parameters whole during fwd/bwd);
- stage 3: also parameters sharded — FSDP2 resharding after forward.

Under pipeline parallel the stage module is sharded; torch's PipelineStage drives FSDP2 so that gradients are
reduce-scattered once, after the last microbatch's backward, not once per microbatch.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .precision import DTYPES


def mixed_precision_policy(precision: str, reduce_precision: str = "fp32") -> MixedPrecisionPolicy:
    """Under bf16/fp16, parameters are all-gathered and computed in the 16-bit type (half the traffic and memory of
    fp32) over the fp32 shards the optimizer steps; gradients are reduce-scattered in fp32 by default, because
    summing many ranks' 16-bit gradients loses the small ones (torchtitan's default too), or in the 16-bit type
    where spec.reducePrecision asks (half the traffic)."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=DTYPES[reduce_precision])


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, precision: str,
               reduce_precision: str = "fp32") -> None:
    """Shard each block, then the root (embeddings, final norm, head), over the dp mesh. Under ZeRO-3 a block's
    weights are freed after its forward and gathered again for its backward, except the last block's and the
    root's: backward starts with them, so freeing them would only gather them again at once (torchtitan's default;
    FSDP2 spares the root by itself only where reshard_after_forward is left unset)."""
    reshard = zero_stage == 3
    policy = mixed_precision_policy(precision, reduce_precision)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard and i < len(blocks) - 1, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    if dp_mesh.device_type == "cpu":
        # gloo's AVG reduce-scatter returned summed gradients in some torch versions (torch#162338; 2.13 averages).
        # Sum explicitly and divide once ourselves, so the result is the mean on every backend. Each sharded module
        # reduce-scatters its own parameters' gradients under its own settings: set them on every one.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(float(dp_mesh.size()))
