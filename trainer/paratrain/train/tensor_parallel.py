"""Tensor parallel (Megatron-style, with DTensor): in every block, attention and MLP are sharded column-then-row.

q/k/v and fc are split by output features (each rank owns heads/tp heads and 4C/tp MLP units), wo and proj by
input features, so each block needs one all-reduce forward and one backward. Embeddings, norms and the head stay
replicated: their gradients are identical on every tp rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
