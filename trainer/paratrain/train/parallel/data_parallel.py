"""Data parallel: model replicas over the mesh's "dp" dimension, gradients averaged, bucketed and overlapped with
backward: by DDP where it can wrap the model, else by OverlappedGradReducer.

Gradients are summed in fp32, or in 16 bits where spec.reducePrecision asks (`reduce_dtype`): each rank's share is
then cast and divided by the group's size before the sum, as torch's fp16/bf16 compress hooks do, so the sum cannot
overflow where the mean would not (a share past fp16's 65,504 is inf at the cast: fp16's loss scaler skips that step
and halves the scale, as for any overflow)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .tensors import local


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """DDP for layouts without tensor or pipeline parallel: bucketed all-reduce overlapped with backward; in 16 bits
    through torch's compress hook where `reduce_dtype` says (its buckets stay fp32)."""
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    ddp = DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
    if reduce_dtype is not None:
        ddp.register_comm_hook(dp_mesh.get_group(), COMPRESS_HOOKS[reduce_dtype])
    return ddp


COMPRESS_HOOKS = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}


class Bucket:
    """Parameters reduced together, as one flat buffer of their local tensors (DTensor shards under tensor
    parallel) padded to a multiple of the dp size, so that it splits into `shards` equal shards, one per dp rank
    (ZeRO-1's reduce-scatter and all-gather, DeepSpeed's flat partitioning)."""

    def __init__(self, params: list[nn.Parameter], shards: int):
        self.params = params
        self.dtype, self.device = local(params[0]).dtype, local(params[0]).device
        self.sizes = [local(p).numel() for p in params]
        self.shard_numel = -(-sum(self.sizes) // shards)
        self.numel = self.shard_numel * shards

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One flat buffer of `tensors` (one per parameter, None read as zeros), padded with zeros; in `dtype`
        (default: the parameters')."""
        flat = torch.zeros(self.numel, dtype=dtype or self.dtype, device=self.device)
        for view, t in zip(self.unflatten(flat), tensors, strict=True):
            if t is not None:
                view.copy_(local(t))
        return flat

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer shaped as each parameter's local tensor."""
        views, offset = [], 0
        for p, size in zip(self.params, self.sizes, strict=True):
            views.append(flat[offset: offset + size].view_as(local(p)))
            offset += size
        return views

    def pieces(self, shard: int) -> list[tuple[nn.Parameter, int, int, int]]:
        """(parameter, start, stop, offset): elements start:stop of the parameter's flattened local tensor lie in
        shard `shard`, from `offset` in it. A parameter can straddle two shards."""
        lo, hi = shard * self.shard_numel, (shard + 1) * self.shard_numel
        found, offset = [], 0
        for p, size in zip(self.params, self.sizes, strict=True):
            start, stop = max(lo, offset), min(hi, offset + size)
            if start < stop:
                found.append((p, start - offset, stop - offset, start - lo))
            offset += size
        return found


class OverlappedGradReducer:
    """Average gradients over dp for composed layouts (DTensor shards, pipeline stages), which DDP cannot wrap, the
    way DDP does it: parameters are grouped into buckets of about `bucket_bytes` in reverse order (the order
    backward produces their gradients), and a bucket's reduction starts, asynchronously, as soon as its last
    gradient is final — while backward goes on computing the next ones. `finish` waits for them and averages.

    A bucket's reduction is an all-reduce that writes the average back into every gradient, or with `shard` (ZeRO-1,
    zero1.ZeroOneOptimizer) a reduce-scatter: this rank keeps only its shard of the bucket's average
    (`grad_shards[i]`, its Bucket.pieces) and drops the parameters' whole gradients as soon as they are sent.

    `reduce_dtype` (16-bit, spec.reducePrecision): buckets are flattened in it and divided before the sum; the
    averages are written back in the gradients' own dtype.

    Gradients are final in the optimizer step's last micro-step only (`expect(passes)`: the backward passes each
    parameter gets there — a pipeline stage runs one per microbatch); earlier micro-steps just accumulate."""

    def __init__(self, params: list[nn.Parameter], dp_mesh: DeviceMesh, bucket_bytes: int = 25 * 2**20,
                 shard: bool = False, reduce_dtype: torch.dtype | None = None):
        self.group, self.size, self.rank = dp_mesh.get_group(), dp_mesh.size(), dp_mesh.get_local_rank()
        self.shard, self.reduce_dtype = shard, reduce_dtype
        grouped: list[list[nn.Parameter]] = [[]]
        filled = 0
        for p in reversed(params):
            if filled and filled + local(p).nbytes > bucket_bytes:
                grouped.append([])
                filled = 0
            grouped[-1].append(p)
            filled += local(p).nbytes
        self.buckets = [Bucket(group, self.size) for group in grouped]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        self.passes_needed = 0  # 0: not the last micro-step
        self.passes: dict[int, int] = {}
        self.ready = [0] * len(self.buckets)
        self.pending: dict[int, tuple[torch.Tensor, object, torch.Tensor]] = {}
        self.grad_shards: list[torch.Tensor] = []  # shard mode: this rank's shard of each bucket's mean gradient
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def expect(self, passes: int) -> None:
        """The coming backward is the step's last; each parameter receives `passes` gradient contributions."""
        self.passes_needed = passes

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.passes_needed:
            return
        self.passes[id(p)] = self.passes.get(id(p), 0) + 1
        if self.passes[id(p)] == self.passes_needed:
            i = self.bucket_of[id(p)]
            self.ready[i] += 1
            if self.ready[i] == len(self.buckets[i].params):
                self._launch(i)

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        if self.shard:
            flat = self._predivided(bucket.flatten([p.grad for p in bucket.params], self.reduce_dtype))
            for p in bucket.params:
                p.grad = None  # sent: this rank keeps only its shard of the mean
            out = flat.new_empty(bucket.shard_numel)
            work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.pending[i] = out, work, flat  # flat must outlive the collective
            return
        grads = [local(p.grad) for p in bucket.params if p.grad is not None]
        if grads:
            flat = self._predivided(torch.cat([g.reshape(-1) for g in grads]))
            self.pending[i] = flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True), flat

    def _predivided(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` in the reduce dtype, divided by the group's size where that is 16-bit (else after the sum)."""
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype).div_(self.size)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (starting any whose gradients never all arrived: parameters this stage did not
        use) and write the averages back: into the gradients, or into `grad_shards` in shard mode."""
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self._launch(i)
        self.grad_shards = []
        for i, (out, work, _) in sorted(self.pending.items()):
            work.wait()
            if self.reduce_dtype is None:
                out /= self.size
            if self.shard:
                self.grad_shards.append(out.to(self.buckets[i].dtype))
                continue
            offset = 0
            for g in (local(p.grad) for p in self.buckets[i].params if p.grad is not None):
                g.copy_(out[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
        self.passes_needed, self.passes, self.pending = 0, {}, {}
        self.ready = [0] * len(self.buckets)
