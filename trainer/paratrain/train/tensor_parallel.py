"""Tensor parallel (Megatron-style, with DTensor): in every block, attention and MLP are sharded column-then-row.

q/k/v and fc are split by output features (each rank owns heads/tp heads and 4C/tp MLP units), wo and proj by
input features, so each block needs one all-reduce forward and one backward. Embeddings, norms and the head stay
replicated: their gradients are identical on every tp rank.

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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}


HEADS_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed from the data-parallel one


def reseeded(seed: int, step: int) -> int:
    """A random stream's seed when it restarts at `step` (resume into another layout): deterministic, and apart
    from the streams of other ranks and steps (their seeds differ by less than the stride)."""
    return seed + 1_000_003 * step


class RNGStream:
    """A random stream of its own, swapped into the device's default generator around a region: ops there that
    take no generator argument (attention's dropout) draw from it, and the default stream continues as if the region
    had drawn nothing. `state` is what a checkpoint keeps."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = _default_generator(device)
        self.seed, self.device = seed, device
        self.state = torch.Generator(device=device).manual_seed(seed).get_state()

    def restart(self, step: int) -> None:
        """Re-derive the stream from its seed and `step`: where a checkpoint of another layout cannot restore it."""
        self.state = torch.Generator(device=self.device).manual_seed(reseeded(self.seed, step)).get_state()

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
