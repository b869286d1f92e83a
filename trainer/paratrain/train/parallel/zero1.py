"""ZeRO-1 for composed layouts (tensor or pipeline parallel), torch-native: each dp rank keeps optimizer state for
its shard of the parameters only, and receives only that shard of the gradients (ZeroOneOptimizer: reduce-scatter,
step the shard, all-gather). Stages 2 and 3 are FSDP2 (fsdp.py); data-parallel-only layouts use DeepSpeed
(deepspeed_engine.py) with the same stage semantics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .data_parallel import OverlappedGradReducer
from .tensors import local, local_bytes, save_owners


# Buckets whose all-gather runs at once after a step, ahead of the forward that needs them: one waited for and one
# in flight, as FSDP2's prefetch; each holds a bucket's flat buffer (25 MiB by default) until forward copies it in.
GATHERS_IN_FLIGHT = 2


class ZeroOneOptimizer:
    """ZeRO stage 1 for composed layouts, DeepSpeed's flat partitioning over OverlappedGradReducer's buckets: the
    reducer (in shard mode) reduce-scatters each bucket's gradients during backward, so this dp rank receives only
    its shard of the mean gradient; the optimizer steps that shard; the updated shards are all-gathered, bucket by
    bucket, back into every rank's whole parameters. Per step: one reduce-scatter and one all-gather per bucket.

    The optimizer sees one tensor per parameter piece in this rank's shard (Bucket.pieces), a view into the
    parameter's own local storage (its tensor-parallel shard under TP) in the parameter's group: it updates the
    parameters in place, and its state (Adam's moments) is 1/dp of the model's. Adam is elementwise, so stepping a
    flat piece is stepping those elements of the parameter. (So parameters are built and materialised before this
    optimizer, and loaded into in place, as parallelize.py and set_model_state_dict do.)

    Checkpoints (`state_dict`) hold each parameter's whole state, keyed by its name — all-gathered at save time and
    sliced again at load — in the format of a plain optimizer's `get_optimizer_state_dict(...)["state"]`
    (DTensors of the parameter's own placements under tensor parallel): DCP stores it once, and any layout, any
    dp degree or bucket size, reads it back."""

    def __init__(self, param_groups: list[dict], reducer: OverlappedGradReducer,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]):
        if not reducer.shard:
            raise ValueError("ZeroOneOptimizer needs an OverlappedGradReducer in shard (reduce-scatter) mode")
        self.reducer = reducer
        self.pieces = [bucket.pieces(reducer.rank) for bucket in reducer.buckets]
        group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        shard_groups = [{**g, "params": []} for g in param_groups]
        self.shards: list[list[nn.Parameter]] = []  # per bucket, one per piece
        for pieces in self.pieces:
            self.shards.append([nn.Parameter(local(p.data).view(-1)[start:stop]) for p, start, stop, _ in pieces])
            for shard, (p, *_) in zip(self.shards[-1], pieces, strict=True):
                shard_groups[group_of[id(p)]]["params"].append(shard)
        self.local_optimizer = make_optimizer(shard_groups)
        self._hooked = False  # gather_in_forward's
        self._to_gather: list[int] = []  # buckets whose all-gather is not launched yet, in launch order
        self._in_flight: dict[int, tuple[object, torch.Tensor]] = {}  # bucket → (its work, its flat buffer)

    @property
    def param_groups(self) -> list[dict]:
        return self.local_optimizer.param_groups

    def grads(self) -> list[torch.Tensor]:
        """This rank's shard of the step's mean gradient (once the reducer has finished), one view per piece; what
        the optimizer steps, so what clipping and loss unscaling multiply."""
        grads = []
        for shards, pieces, flat in zip(self.shards, self.pieces, self.reducer.grad_shards, strict=True):
            for shard, (_, start, stop, offset) in zip(shards, pieces, strict=True):
                shard.grad = flat[offset: offset + stop - start]
                grads.append(shard.grad)
        return grads

    @torch.no_grad()
    def grad_norm_square(self, tp: int) -> torch.Tensor:
        """The squared L2 norm of the whole model's mean gradient, on the device, the same on every rank: each rank
        sums its shard's squares, then one all-reduce over the world, which the (pp, dp, tp) mesh spans, adds dp
        shards, tp shards and pp stages. A parameter the `tp` tensor-parallel ranks hold alike (embeddings, norms,
        the head, replicated DTensors) is weighed 1/tp there, so it counts once."""
        total = torch.zeros((), dtype=torch.float32, device=self.reducer.buckets[0].device)
        for grad, (p, *_) in zip(self.grads(), (piece for pieces in self.pieces for piece in pieces), strict=True):
            total += grad.float().square().sum() / (1 if tp_sharded(p) else tp)
        dist.all_reduce(total)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's shard, then bring every rank's updated shards into the whole parameters: at once, or,
        once `gather_in_forward` has hooked the model, overlapped with the next forward."""
        self.settle()  # a bucket no forward asked for (parameters it did not use) is still in flight
        self.grads()
        self.local_optimizer.step()
        self._to_gather = list(reversed(range(len(self.reducer.buckets))))  # forward's order: the first layers first
        if self._hooked:
            self._top_up()
        else:
            self.settle()

    def gather_in_forward(self, module: nn.Module) -> None:
        """Overlap the all-gathers that follow each step with the next forward (as FSDP2 prefetches): the step
        launches the first GATHERS_IN_FLIGHT buckets, and a forward pre-hook on each module that holds a bucket's
        parameters waits for that bucket, copies it in, and launches the next. Every rank launches them in one
        order (forward's), whatever asks first. Anything else that reads the parameters calls `settle` first
        (state_dict and load_template, the checkpoint's save and restore, do). Not for torch.compile'd blocks: a
        hook that waits on a collective inside a compiled call would break its graph."""
        needs: dict[nn.Module, set[int]] = {}
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if id(p) in self.reducer.bucket_of:
                    needs.setdefault(m, set()).add(self.reducer.bucket_of[id(p)])
        for m, buckets in needs.items():
            m.register_forward_pre_hook(lambda *_, b=frozenset(buckets): self.settle(b))
        self._hooked = True

    @torch.no_grad()
    def settle(self, buckets: frozenset[int] | None = None) -> None:
        """Finish the step's all-gathers of `buckets` (None: all) into the parameters, launching any not yet
        launched, in order."""
        while self._to_gather or self._in_flight:
            wanted = [i for i in (*self._in_flight, *self._to_gather) if buckets is None or i in buckets]
            if not wanted:
                return
            if wanted[0] not in self._in_flight:
                self._launch()
                continue
            work, flat = self._in_flight.pop(wanted[0])
            work.wait()
            bucket = self.reducer.buckets[wanted[0]]
            for p, whole in zip(bucket.params, bucket.unflatten(flat), strict=True):
                local(p.data).copy_(whole)
            self._top_up()

    def _top_up(self) -> None:
        while self._to_gather and len(self._in_flight) < GATHERS_IN_FLIGHT:
            self._launch()

    def _launch(self) -> None:
        i = self._to_gather.pop(0)
        flat, work = self._all_gather(i, self.shards[i], async_op=True)
        self._in_flight[i] = work, flat

    def _all_gather(self, i: int, mine: list[torch.Tensor], async_op: bool = False) -> tuple[torch.Tensor, object]:
        """Every rank's pieces of bucket i (`mine`: this rank's, one per piece) → the bucket's flat buffer (whole
        once the returned work is done; Bucket.unflatten gives each parameter's view)."""
        bucket = self.reducer.buckets[i]
        shard = torch.zeros(bucket.shard_numel, dtype=bucket.dtype, device=bucket.device)
        for t, (_, start, stop, offset) in zip(mine, self.pieces[i], strict=True):
            shard[offset: offset + stop - start].copy_(t)
        flat = shard.new_empty(bucket.numel)
        return flat, dist.all_gather_single(flat, shard, group=self.reducer.group, async_op=async_op)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local_optimizer.zero_grad(set_to_none=True)
        self.reducer.grad_shards = []
        for bucket in self.reducer.buckets:
            for p in bucket.params:
                p.grad = None

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.local_optimizer)

    @torch.no_grad()
    def state_dict(self, module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """Collective over dp: {parameter name: {state key: whole value}} for the parameters `save_owners` gives
        this dp rank, in host memory. Per-element state (tensors shaped like the piece) is all-gathered bucket by
        bucket and each parameter's kept by one rank, so a device holds one gathered bucket at a time and a host
        about 1/dp of the state; scalars (Adam's step count) are the same on every piece."""
        self.settle()
        if not self.local_optimizer.state:
            self._init_state()
        states = [self.local_optimizer.state[s] for shards in self.shards for s in shards]
        scalars = {k: v for k, v in states[0].items() if not is_per_element(v)}
        names = {id(p): name for name, p in module.named_parameters()}
        params = [p for bucket in self.reducer.buckets for p in bucket.params]
        mine = {id(p) for p, owner in zip(params, save_owners([p.numel() for p in params], self.reducer.size),
                                          strict=True) if owner == self.reducer.rank}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for i, bucket in enumerate(self.reducer.buckets):
            for p in bucket.params:
                if id(p) in mine:
                    out[names[id(p)]] = {k: v.cpu().clone() for k, v in scalars.items()}
            for key in (k for k, v in states[0].items() if is_per_element(v)):
                pieces = [self.local_optimizer.state[s][key] for s in self.shards[i]]
                for p, whole in zip(bucket.params, bucket.unflatten(self._all_gather(i, pieces)[0]), strict=True):
                    if id(p) in mine:
                        out[names[id(p)]][key] = like_param(whole.cpu().clone(), p)
        return out

    def load_template(self, module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """What `load_state_dict` reads, to be filled from a checkpoint: the whole state, in host memory, of the
        parameters with a piece in this rank's shard (about 1/dp of them). A step's gathers still in flight are
        settled first: they would overwrite the weights a restore loads."""
        self.settle()
        if not self.local_optimizer.state:
            self._init_state()
        names = {id(p): name for name, p in module.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for shards, pieces in zip(self.shards, self.pieces, strict=True):
            for shard, (p, *_) in zip(shards, pieces, strict=True):
                out[names[id(p)]] = {
                    k: like_param(torch.empty(local(p).shape, dtype=v.dtype), p) if is_per_element(v)
                    else v.cpu().clone() for k, v in self.local_optimizer.state[shard].items()}
        return out

    @torch.no_grad()
    def load_state_dict(self, module: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """`state`: whole per-parameter values as state_dict() gives them (any layout's, resharded by DCP); this
        rank keeps its pieces."""
        names = {id(p): name for name, p in module.named_parameters()}
        for shards, pieces in zip(self.shards, self.pieces, strict=True):
            for shard, (p, start, stop, _) in zip(shards, pieces, strict=True):
                self.local_optimizer.state[shard] = {  # from host memory to the shard's device
                    k: local(v).reshape(-1)[start:stop].to(shard.device, copy=True) if is_per_element(v)
                    else v.clone() for k, v in state[names[id(p)]].items()}

    def _init_state(self) -> None:
        """The optimizer's state appears at its first step: take one of zero gradients at learning rate 0, which
        leaves the parameters as they are (torch's get_optimizer_state_dict does the same)."""
        lrs = [g["lr"] for g in self.local_optimizer.param_groups]
        for g in self.local_optimizer.param_groups:
            g["lr"] = 0.0
            for shard in g["params"]:
                shard.grad = torch.zeros_like(shard)
        self.local_optimizer.step()
        for g, lr in zip(self.local_optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.local_optimizer.zero_grad(set_to_none=True)


def is_per_element(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def tp_sharded(p: torch.Tensor) -> bool:
    """Whether each tensor-parallel rank holds a different part of the parameter."""
    return isinstance(p, DTensor) and any(placement.is_shard() for placement in p.placements)


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t`, a whole local tensor of `p`'s shape, as `p` is held: a DTensor of `p`'s placements under tensor
    parallel, its local tensor `t` itself, where `t` is (host memory for a checkpoint's state). DTensor.from_local
    would move it to the mesh's device (a GPU); torch's own CPU-offloaded state dicts hold such DTensors too
    (distributed/_state_dict_utils: a DTensor's `.to("cpu")`), and DCP reads only their layout."""
    if not isinstance(p, DTensor):
        return t
    meta = TensorMeta(shape=p.shape, stride=p.stride(), dtype=t.dtype)
    return DTensor(t, DTensorSpec(p.device_mesh, p.placements, tensor_meta=meta), requires_grad=False)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
               and v.dim() > 0)
