"""Tensor parallel (Megatron-style, with DTensor): in every block, attention and MLP are sharded column-then-row.

Each model family declares its block's plan (`tp_plan`, module name → "colwise" / "rowwise"): the fused q/k/v
projection (its rows grouped by key/value head, models/gpt.fuse_qkv) and the MLP's input projections (GPT's fc,
Llama's gate and up) are split by output features (each rank owns heads/tp query heads, kvHeads/tp key/value heads
and ffnDim/tp MLP units), wo and the MLP's output projection by input features,
so attention and the MLP each need one all-reduce forward and one backward (4 per block and step,
tests/trainer/test_tp_collectives.py). The head is split by vocabulary, its logits left sharded for the loss to read
in place (loss.py; at a 128k vocabulary the head is a model's largest matrix, its logits the largest activation).
Embeddings and norms stay replicated: their gradients are identical on every tp rank.

Dropout follows Megatron's model-parallel RNG: dropout on replicated activations (residual, MLP output) draws from
the stream the tp group shares, so the replicas stay equal; attention dropout, on the heads only this rank holds,
draws from a stream of the rank's own, as the single-process model draws independent masks for every head.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Each sub-layer's input enters as one replicated DTensor that its input projections share (Llama's gate and up):
# their partial input gradients add up as DTensors and are all-reduced once, in backward, where plain tensors
# would be reduced once per projection. So each block makes Megatron's 4 all-reduces per step.
SUBLAYERS = ("attn", "mlp")


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


def _shared_replicated_input(sublayer: nn.Module) -> PrepareModuleInput:
    """The sub-layer's first input (the activations) as a replicated DTensor; the others (Llama's RoPE tables)
    pass through as they are."""
    others = len(inspect.signature(sublayer.forward).parameters) - 1
    layouts = (Replicate(),) + (None,) * others
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, heads_rng: RNGStream) -> None:
    """Shard every block over `tp_mesh` by the model's `tp_plan` (its attention dropout draws from `heads_rng`,
    this rank's own stream), and the head by vocabulary."""
    projections = {name: STYLES[style]() for name, style in model.tp_plan.items()}
    for block in model.layers.values():
        plan = {name: _shared_replicated_input(block.get_submodule(name)) for name in SUBLAYERS}
        parallelize_module(block, tp_mesh, {**plan, **projections})
        block.attn.heads_rng = heads_rng
    if model.head is not None:  # the last pipeline stage's
        parallelize_module(model.head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
