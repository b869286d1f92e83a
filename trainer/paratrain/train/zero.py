"""ZeRO for composed layouts (tensor or pipeline parallel), torch-native. Data-parallel-only layouts use DeepSpeed
(see deepspeed_engine.py); both give the same stage semantics:

- stage 1: each dp rank keeps optimizer state for its partition of the parameters only (ZeroOneOptimizer);
- stage 2: also gradients sharded — FSDP2 without resharding after forward (parameters whole during fwd/bwd);
- stage 3: also parameters sharded — FSDP2 resharding after forward.

Under pipeline parallel the stage module is sharded; torch's PipelineStage drives FSDP2 so that gradients are
reduce-scattered once, after the last microbatch's backward, not once per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .precision import DTYPES
from .tensors import local, local_bytes


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Under bf16/fp16, parameters are all-gathered and computed in the 16-bit type (half the traffic and memory of
    fp32) over the fp32 shards the optimizer steps; gradients are reduce-scattered in fp32, because summing many
    ranks' 16-bit gradients loses the small ones (torchtitan's default too)."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, precision: str) -> None:
    """Shard each block, then the root (embeddings, final norm, head), over the dp mesh."""
    reshard = zero_stage == 3
    policy = mixed_precision_policy(precision)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    if dp_mesh.device_type == "cpu":
        # gloo's AVG reduce-scatter returned summed gradients in some torch versions (torch#162338; 2.13 averages).
        # Sum explicitly and divide once ourselves, so the result is the mean on every backend. Each sharded module
        # reduce-scatters its own parameters' gradients under its own settings: set them on every one.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(float(dp_mesh.size()))


class ZeroOneOptimizer:
    """ZeRO stage 1: partition parameters over dp ranks; each rank's optimizer holds only its partition's state,
    steps it, and broadcasts the updated parameters to the other dp ranks. Gradients stay whole (all-reduced).

    Partitions are of whole parameters, so `local_optimizer`'s state, keyed by parameter name
    (`get_optimizer_state_dict(module, local_optimizer)`, as TorchEngine.state_dict does), is each owned
    parameter's complete state (a DTensor shard of it under tensor parallel): a checkpoint holds every parameter's
    state once, from its owner, and a run of any partition reads back the parameters it owns."""

    def __init__(self, param_groups: list[dict], dp_mesh: DeviceMesh,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]):
        self.group = dp_mesh.get_group()
        ranks = dist.get_process_group_ranks(self.group)
        loads = [0] * len(ranks)
        self.owner: list[tuple[nn.Parameter, int]] = []
        owned_groups = []
        # Largest first onto the least-loaded rank: balanced partitions, deterministic on every rank.
        flat = [p for g in param_groups for p in g["params"]]
        for p in sorted(flat, key=lambda q: -local(q).numel()):
            r = loads.index(min(loads))
            loads[r] += local(p).numel()
            self.owner.append((p, ranks[r]))
        me = dist.get_rank()
        mine = {id(p) for p, r in self.owner if r == me}
        for g in param_groups:
            owned_groups.append({**g, "params": [p for p in g["params"] if id(p) in mine]})
        self.local_optimizer = make_optimizer(owned_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.local_optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.local_optimizer.step()
        for p, src in self.owner:
            dist.broadcast(local(p.data), src=src, group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local_optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self.owner:
            p.grad = None

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.local_optimizer)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
               and v.dim() > 0)
