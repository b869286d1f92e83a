"""Tensor parallel (Megatron-style, with DTensor): in every block, attention and MLP are sharded column-then-row.

q/k/v and fc are split by output features (each rank owns heads/tp heads and 4C/tp MLP units), wo and proj by
input features, so attention and the MLP each need one all-reduce forward and one backward (4 per block and step,
tests/trainer/test_tp_collectives.py). Embeddings, norms and the head stay replicated: their gradients are identical
on every tp rank.

Dropout follows Megatron's model-parallel RNG: dropout on replicated activations (residual, MLP output) draws from
the stream the tp group shares, so the replicas stay equal; attention dropout, on the heads only this rank holds,
draws from a stream of the rank's own, as the single-process model draws independent masks for every head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

# Each sub-layer's input enters as one replicated DTensor that q, k and v (or the MLP's input projections) share:
# their partial input gradients add up as DTensors and are all-reduced once, in backward, where plain tensors
# would be reduced once per projection (3 for attention). So each block makes Megatron's 4 all-reduces per step.
_SHARED_REPLICATED_INPUT = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                              use_local_output=False)
BLOCK_PLAN = {
    "attn": _SHARED_REPLICATED_INPUT,
    "mlp": _SHARED_REPLICATED_INPUT,
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}


HEADS_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed from the data-parallel one


class RNGStream:
    """A random stream of its own, swapped into the device's default generator around a region: ops there that
    take no generator argument (attention's dropout) draw from it, and the default stream continues as if the region
    had drawn nothing. `state` is what a checkpoint keeps."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = _default_generator(device)
        self.state = torch.Generator(device=device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer = self.generator.get_state()
        self.generator.set_state(self.state)
        try:
            yield
        finally:
            self.state = self.generator.get_state()
            self.generator.set_state(outer)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        torch.cuda.init()  # fills default_generators
        return torch.cuda.default_generators[device.index]
    return torch.default_generator


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, heads_rng: RNGStream) -> None:
    """Shard every block over `tp_mesh`; its attention dropout draws from `heads_rng`, this rank's own stream."""
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
        block.attn.heads_rng = heads_rng
