"""Data parallel: model replicas over the mesh's "dp" dimension, gradients averaged, bucketed and overlapped with
backward: by DDP where it can wrap the model, else by OverlappedGradReducer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .tensors import local


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP for layouts without tensor or pipeline parallel: bucketed all-reduce overlapped with backward."""
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)


class OverlappedGradReducer:
    """Average gradients over dp for composed layouts (DTensor shards, pipeline stages), which DDP cannot wrap, the
    way DDP does it: parameters are grouped into buckets of about `bucket_bytes` in reverse order (the order
    backward produces their gradients), and a bucket's all-reduce starts, asynchronously, as soon as its last
    gradient is final — while backward goes on computing the next ones. `finish` waits for them and averages.

    Gradients are final in the optimizer step's last micro-step only (`expect(passes)`: the backward passes each
    parameter gets there — a pipeline stage runs one per microbatch); earlier micro-steps just accumulate."""

    def __init__(self, params: list[nn.Parameter], dp_mesh: DeviceMesh, bucket_bytes: int = 25 * 2**20):
        self.group, self.size = dp_mesh.get_group(), dp_mesh.size()
        self.buckets: list[list[nn.Parameter]] = [[]]
        filled = 0
        for p in reversed(params):
            if filled and filled + local(p).nbytes > bucket_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(p)
            filled += local(p).nbytes
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.passes_needed = 0  # 0: not the last micro-step
        self.passes: dict[int, int] = {}
        self.ready = [0] * len(self.buckets)
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}
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
            if self.ready[i] == len(self.buckets[i]):
                self._launch(i)

    def _launch(self, i: int) -> None:
        grads = [local(p.grad) for p in self.buckets[i] if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.pending[i] = flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (starting any whose gradients never all arrived: parameters this stage did not
        use) and write the averages back."""
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self._launch(i)
        for i, (flat, work) in sorted(self.pending.items()):
            work.wait()
            flat /= self.size
            offset = 0
            for g in (local(p.grad) for p in self.buckets[i] if p.grad is not None):
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
        self.passes_needed, self.passes, self.pending = 0, {}, {}
        self.ready = [0] * len(self.buckets)
