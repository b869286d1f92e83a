"""ParallelDims: the one object that owns the device mesh and decides which implementation runs each parallel mode
(after torchtitan's parallel_dims.py). Everything else asks it — `dims.fsdp_enabled`, `dims.uses_deepspeed` — and
never re-derives a mode from the spec.

Mesh order is (pp, dp, tp) by default (spec.parallelism.rankOrder tp-dp-pp): tensor-parallel peers are adjacent
ranks (same node, fastest links), then a stage's data-parallel replicas, and pipeline stages farthest apart (they
exchange only activations). tp-pp-dp makes it (dp, pp, tp): each replica's stages adjacent, replicas farthest
apart, for a topology whose domains should hold whole pipelines.

Which implementation shards what, by layout (ZeRO stage z over the dp ranks):

    data parallel only, z = 0        DDP                                         ddp_enabled
    data parallel only, z = 1..3     DeepSpeed ZeRO-z (deepspeed_engine.py)      uses_deepspeed
    with TP and/or PP,  z = 0        OverlappedGradReducer                       composed_dp
    with TP and/or PP,  z = 1        OverlappedGradReducer + ZeroOneOptimizer    composed_dp, zero1_enabled
    with TP and/or PP,  z = 2, 3     FSDP2 (fsdp.apply_fsdp)                     fsdp_enabled
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...api import Spec


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int = 0  # ZeRO over the dp ranks: 1 optimizer state, 2 also gradients, 3 also parameters
    device_type: str = "cpu"
    mesh_dims: tuple[str, str, str] = ("pp", "dp", "tp")  # outermost first: Parallelism.mesh_dims
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} degree must be >= 1, got {getattr(self, name)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.dp * self.tp * self.pp} "
                             f"!= WORLD_SIZE({self.world_size})")
        if sorted(self.mesh_dims) != ["dp", "pp", "tp"] or self.mesh_dims[-1] != "tp":
            raise ValueError(f"mesh_dims must be pp and dp in either order, then tp: got {self.mesh_dims}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    @classmethod
    def from_spec(cls, spec: Spec, world_size: int | None = None, device_type: str = "cpu") -> ParallelDims:
        """The layout of `spec` over `world_size` ranks (default: the spec's own nodes x procsPerNode)."""
        p = spec.parallelism
        return cls(dp=p.data, tp=p.tensor, pp=p.pipeline, world_size=world_size or spec.world_size,
                   zero_stage=p.zero_stage, device_type=device_type, mesh_dims=p.mesh_dims)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def zero_enabled(self) -> bool:
        return self.zero_stage > 0

    @property
    def model_parallel_enabled(self) -> bool:
        """Tensor or pipeline parallel: the model this rank holds is a part (DTensor shards, a stage)."""
        return self.tp_enabled or self.pp_enabled

    @property
    def uses_deepspeed(self) -> bool:
        """ZeRO on a data-parallel-only layout: DeepSpeed runs it, as the spec promises (deepspeed_engine.py)."""
        return self.zero_enabled and not self.model_parallel_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """ZeRO-2/3 on a composed layout: FSDP2 shards gradients (and at 3 parameters) over dp."""
        return self.zero_stage >= 2 and not self.uses_deepspeed

    @property
    def zero1_enabled(self) -> bool:
        """ZeRO-1 on a composed layout: ZeroOneOptimizer partitions the optimizer state over dp."""
        return self.zero_stage == 1 and not self.uses_deepspeed

    @property
    def ddp_enabled(self) -> bool:
        """Plain data parallel: DDP wraps the whole model."""
        return self.dp_enabled and not self.zero_enabled and not self.model_parallel_enabled

    @property
    def composed_dp(self) -> bool:
        """Data parallel over TP shards or a pipeline stage, which DDP cannot wrap: OverlappedGradReducer."""
        return self.dp_enabled and self.model_parallel_enabled and not self.fsdp_enabled

    @cached_property
    def mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device_type, tuple(getattr(self, d) for d in self.mesh_dims),
                                mesh_dim_names=self.mesh_dims)

    def get_mesh(self, name: str) -> DeviceMesh:
        return self.mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.mesh[name].get_group()

    def coordinate(self, name: str) -> int:
        return self.mesh[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    def dropout_seed(self, seed: int) -> int:
        """This rank's default random stream: the same within a tensor-parallel group (its activations are
        replicated and must stay equal), different across data-parallel replicas and pipeline stages."""
        return seed + 1009 * self.dp_rank + self.pp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1
