"""The training loss: mean token cross-entropy in fp32 whatever the autocast dtype (the softmax over the vocabulary
needs the range), CE_CHUNK_TOKENS tokens at a time.

Under tensor parallel the head's logits stay sharded by vocabulary (tensor_parallel.apply_tp: a DTensor, Shard on
the last dim) and the loss reads each rank's part where it is, as Megatron's vocab-parallel cross-entropy does: per
piece, the row maxima and then the sums of exponentials and the targets' logits are all-reduced over the tp group
(2 all-reduces). torch's own `loss_parallel` computes the same with DTensor ops, but keeps the whole fp32
log-softmax for backward and must wrap backward too (a pipeline schedule's included); this keeps one piece in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Tokens per piece of the loss: its fp32 copy of the logits exists for one piece at a time (4,096 tokens × a 128k
# vocabulary × 4 bytes = 2 GB), never for the whole batch (32 × 2,048 tokens: 34 GB).
CE_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logits sit in the vocabulary: columns start.. of it, the others on the group's ranks."""

    group: dist.ProcessGroup
    start: int


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss of logits (B, T, V) against targets (B, T). In training each piece's gradient is computed
    with its loss, into one buffer of the logits' shape and type (ChunkedCrossEntropy), so only that buffer outlives
    the forward pass. Vocabulary-sharded logits (a DTensor) give every rank of their group the whole loss."""
    shard = None
    if isinstance(logits, DTensor):
        shard = vocab_shard(logits)
        logits = logits.to_local()
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if flat.requires_grad and torch.is_grad_enabled():
        return ChunkedCrossEntropy.apply(flat, flat_targets, shard)
    total = sum(_piece_loss(flat[start:start + CE_CHUNK_TOKENS], flat_targets[start:start + CE_CHUNK_TOKENS], shard)[0]
                for start in range(0, flat_targets.numel(), CE_CHUNK_TOKENS))
    return total / flat_targets.numel()


def vocab_shard(logits: DTensor) -> VocabShard | None:
    """The vocabulary part a DTensor's local logits hold; None when they are replicated (whole)."""
    mesh, placements = logits.device_mesh, logits.placements
    if all(placement.is_replicate() for placement in placements):
        return None
    if mesh.ndim != 1 or not placements[0].is_shard(logits.ndim - 1):
        raise ValueError(f"logits sharded as {placements} over {mesh}: the loss reads them sharded by vocabulary only")
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, placements)
    return VocabShard(mesh.get_group(), offset[-1])


def _piece_loss(logits: torch.Tensor, targets: torch.Tensor,
                shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, the piece's softmax over this rank's columns in fp32 (a private copy, the only buffer of the
    piece's size: exponentiated and normalised in place; the caller may overwrite it), each target's column among
    them, -1 where another rank holds it)."""
    probs = logits.to(torch.float32, copy=True)
    columns = targets if shard is None else targets - shard.start
    mine = (columns >= 0) & (columns < probs.shape[1])
    columns = torch.where(mine, columns, -1)
    peak = probs.amax(dim=-1)
    if shard is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=shard.group)
    probs.sub_(peak[:, None])
    target = probs.gather(1, columns.clamp(min=0)[:, None]).squeeze(1).where(mine, 0.0)
    # Row sums of exponentials and the targets' logits (less the peak), summed over the ranks holding the columns.
    sums = torch.stack([probs.exp_().sum(dim=-1), target])
    if shard is not None:
        dist.all_reduce(sums, group=shard.group)
    probs.div_(sums[0][:, None])
    return (sums[0].log() - sums[1]).sum(), probs, columns


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of (n, V) logits (or this rank's (n, V/tp) columns), piece by piece, with its
    gradient, softmax less the one-hot target over n, computed in the same pass into one buffer of the logits' type:
    backward only scales it. Each piece's fp32 copy, exponentiated in place, is the only buffer of its size and
    lives for that piece alone (an exponentials' temporary and the previous piece's copy, still bound while the next
    was made, had made three); the logits are not kept for backward. (Slices recomputed in backward, as before, gave
    each piece a gradient of the logits' full size: the loss peaked near 4x the logits.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
        count = targets.numel()
        # fp16 logits keep their gradient in fp32 until backward has scaled it: softmax/count of a 32k-token batch
        # underflows fp16 before the loss scale could lift it. bf16 has fp32's range.
        grad = torch.empty_like(logits, dtype=torch.float32 if logits.dtype == torch.float16 else logits.dtype)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, count, CE_CHUNK_TOKENS):
            end = min(start + CE_CHUNK_TOKENS, count)
            loss, probs, columns = _piece_loss(logits[start:end], targets[start:end], shard)
            total += loss
            # less the one-hot target where this rank holds its column: index arithmetic, no host sync (a boolean
            # mask would wait for the device to count its rows); adding -0.0 elsewhere changes nothing
            probs.scatter_add_(1, columns.clamp(min=0)[:, None], -(columns >= 0).to(probs.dtype)[:, None])
            grad[start:end] = probs.div_(count)
            del probs  # before the next piece's copy: one fp32 piece at a time
        ctx.save_for_backward(grad)
        return total / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output), None, None  # in place: the graph runs backward once; autograd casts to fp16
