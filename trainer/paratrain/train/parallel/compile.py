"""torch.compile per transformer block (spec.training.compile), after torchtitan's `apply_compile`.

Each block is compiled where it stands (`nn.Module.compile`: the module's call goes through the compiled function),
not wrapped in an OptimizedModule, so parameter names — which init, tensor-parallel plans and checkpoints key on —
stay those of the plain model. Applied after tensor parallel and activation checkpointing and before FSDP2's
sharding (torchtitan's order): a block's graph holds its own ops, DTensor's collectives and the recomputation
policy; FSDP2's gathers stay around it. Blocks are alike, so the first compiles and the others reuse its code (one
compilation per shape: training and evaluation batches are two).

Inductor writes C++ for CPU kernels (a compiler on PATH) and Triton for CUDA ones.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn


def compile_problem(device: torch.device) -> str | None:
    """Why blocks cannot be compiled on `device` here, or None."""
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if not shutil.which(cxx):
            return (f"spec.training.compile: inductor compiles CPU kernels with a C++ compiler and there is no "
                    f"{cxx!r} on PATH here (set CXX, install g++, or set training.compile false)")
    return None


def apply_compile(model: nn.Module) -> None:
    """Compile every block of `model.layers` (this pipeline stage's) in place."""
    for block in model.layers.values():
        block.compile()
