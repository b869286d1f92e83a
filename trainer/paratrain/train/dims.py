"""ParallelDims: the one object that owns the device mesh (after torchtitan's parallel_dims.py).

Mesh order is (pp, dp, tp): tensor-parallel peers are adjacent ranks (same node, fastest links), pipeline stages
are farthest apart (they exchange only activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    device_type: str = "cpu"
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} degree must be >= 1, got {getattr(self, name)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.dp * self.tp * self.pp} "
                             f"!= WORLD_SIZE({self.world_size})")

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @cached_property
    def mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))

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
