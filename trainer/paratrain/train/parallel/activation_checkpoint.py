"""Activation checkpointing (spec.training.activationCheckpointing), applied per transformer block.

- full: a block keeps only its input; backward runs its forward again to rebuild the rest.
- selective: a block keeps the outputs of its matmuls, of attention and of tensor parallel's collectives (the
  costly ops: recomputing an all-reduce costs a collective) and recomputes the cheap ones in between (norms,
  activations, dropout, residual adds), after torchtitan's op-level selective AC.

The block's `forward` is replaced on the instance rather than the block wrapped in a module (torch's
checkpoint_wrapper), so parameter names — which weight init, tensor-parallel plans and checkpoints key on — stay
those of the plain model.

Recomputation must draw the same dropout masks as the first forward: torch.utils.checkpoint restores the default
generator, and tensor parallel's per-rank heads stream (RNGStream, swapped in around attention) is rewound to
where the first forward started and put back afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
# What selective AC keeps: matmul and attention outputs (every attention kernel torch may dispatch to), and the
# collectives DTensor issues for tensor parallel (with their waits: a recomputed wait would need the collective).
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _c10d.all_reduce.default, _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default,
    _c10d.wait_tensor.default,
})


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_and_attention)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model.layers` (this pipeline stage's) in `mode`."""
    if mode not in MODES:
        raise ValueError(f"spec.training.activationCheckpointing: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return
    context_fn = _selective_contexts if mode == "selective" else None
    for block in model.layers.values():
        block.forward = functools.partial(_checkpointed, block.forward, block, context_fn)


def _checkpointed(forward: Callable, block: nn.Module, context_fn, *args):
    kwargs = {"context_fn": context_fn} if context_fn else {}
    # Streams that attention dropout draws from (tensor parallel with dropout > 0) are replayed by a wrapper with
    # side effects; without any, the block's forward is checkpointed as it is, which torch.compile traces whole
    # (it falls back to eager around a checkpointed function that mutates outer state).
    streams = [m.heads_rng for m in block.modules() if getattr(m, "heads_rng", None) is not None and m.dropout]
    if not streams:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    starts = [s.state for s in streams]
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward itself
            return forward(*inputs)
        latest = [s.state for s in streams]  # the recomputation, during backward: replay, then put back
        for stream, start in zip(streams, starts, strict=True):
            stream.state = start
        try:
            return forward(*inputs)
        finally:
            for stream, state in zip(streams, latest, strict=True):
                stream.state = state

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
