"""TorchEngine: one training step for every torch-native layout (DDP, TP, PP, FSDP2/ZeRO-1, and their mixes).

The loop talks to an engine through forward_backward, grad_norm_square, optimizer_step, evaluate, state_bytes and
the checkpoint calls — state_dict / restore (the model and optimizer, FQN-keyed tensors that any layout can read
back), extra_state / load_extra_state (the loss scaler, JSON), rank_state / load_rank_state (this rank's own RNG
stream, not reshardable) — so the DeepSpeed engine (deepspeed_engine.py) can stand in for it unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from .loss import cross_entropy
from .parallel.data_parallel import OverlappedGradReducer
from .parallel.dims import ParallelDims
from .parallel.precision import LossScaler, autocast
from .parallel.tensor_parallel import RNGStream
from .parallel.tensors import local, local_bytes, norm_of_square
from .parallel.zero1 import ZeroOneOptimizer, optimizer_state_bytes


@torch.no_grad()
def global_grad_norm_square(params: list[nn.Parameter], dims: ParallelDims) -> torch.Tensor:
    """The squared L2 norm of the whole model's gradient, on the device, the same on every rank: the squares of
    each rank's own shards summed locally (one foreach kernel per group, not three small ones per parameter), then
    one all-reduce per (mesh, sharded mesh dim) group of DTensor gradients (not a collective per parameter:
    llama3-1b under FSDP2 has 147), pipeline stages summed over "pp"."""
    device = params[0].device if params else "cpu"
    plain: list[torch.Tensor] = []
    sharded: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):  # a sum still owed: settle it first
                grad = grad.redistribute(placements=[Replicate() if placement.is_partial() else placement
                                                     for placement in grad.placements])
            # Every placement but Replicate splits the tensor over that mesh dim (Shard, and FSDP2's _StridedShard
            # under TP, which is_shard() does not count).
            key = (grad.device_mesh, tuple(d for d, placement in enumerate(grad.placements)
                                           if not placement.is_replicate()))
            sharded.setdefault(key, []).append(grad.to_local())
        else:
            plain.append(grad)
    total_sq = _sum_of_squares(plain, device)
    for (mesh, shard_dims), shards in sharded.items():
        square = _sum_of_squares(shards, device)
        for mesh_dim in shard_dims:  # a shard's square is summed over the ranks holding the other shards
            dist.all_reduce(square, group=mesh.get_group(mesh_dim))
        total_sq += square
    if dims.pp_enabled:
        dist.all_reduce(total_sq, group=dims.group("pp"))
    return total_sq


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The sum of the tensors' squared L2 norms, in fp32."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def loss_weight(accumulation: int, microbatches: int) -> float:
    """What each (micro-step, microbatch) loss is multiplied by before backward: their gradients then sum to the
    gradient of the whole step's mean loss, whatever the split."""
    return 1.0 / (accumulation * microbatches)


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    applied: bool  # False when fp16 overflowed and the step was skipped
    grad_norm: float  # unscaled global norm before clipping


@dataclass
class TorchEngine:
    model: nn.Module  # what forward runs: the stage module, possibly wrapped by DDP
    module: nn.Module  # the unwrapped (stage) module: parameters and checkpoint state
    optimizer: object  # torch.optim.Optimizer or zero1.ZeroOneOptimizer
    dims: ParallelDims
    precision: str
    grad_clip: float
    dp_reducer: OverlappedGradReducer | None  # averages gradients over dp where DDP cannot (composed layouts)
    accumulation: int = 1  # micro-steps per optimizer step
    microbatches: int = 1  # pipeline microbatches per micro-step
    schedule: object | None = None  # pipelining schedule when pp > 1
    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))
    heads_rng: RNGStream | None = None  # tensor parallel's stream for attention dropout
    last_grad_bytes: int = 0

    @functools.cached_property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters (fixed once the model is parallelised; read twice a step)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def loss_multiplier(self) -> float:
        """The fp16 loss scale times this split's loss weight; reported losses are divided by it again."""
        return self.scaler.factor * loss_weight(self.accumulation, self.microbatches)

    def scaled_loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda logits, targets: cross_entropy(logits, targets) * self.loss_multiplier

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor | None:
        """Accumulate this rank's gradients over one optimizer step's micro-batches, reducing them over dp once,
        in the last micro-step; return their mean loss where this rank computes it, on the device (read once per
        step with the other ranks', loop.mean_over_reporters)."""
        if not self.model.training:  # train() walks every module: only after an evaluation
            self.model.train()
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            with self._dp_gradient_sync(i == len(micro_batches) - 1):
                losses.append(self._micro_step(x, y))
        if self.dp_reducer:
            self.dp_reducer.finish()
        return torch.stack(losses).double().mean() if losses[0] is not None else None

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        with autocast(self.precision, x.device.type):
            if self.schedule is not None:
                return self._run_schedule(self.schedule.step, x, y)
            loss = cross_entropy(self.model(x), y)
        (loss * self.loss_multiplier).backward()
        return loss.detach()

    @contextmanager
    def _dp_gradient_sync(self, enabled: bool) -> Iterator[None]:
        """DDP, FSDP2 and the composed layouts' reducer reduce gradients in backward: in the last micro-step only.
        (Under pipeline parallel, torch's PipelineStage drives FSDP2 itself and reduce-scatters after every schedule
        run: still correct, FSDP2 adds each to the sharded gradient, but once per micro-step.)"""
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled)
        if self.dp_reducer and enabled:
            self.dp_reducer.expect(passes=self.microbatches)
        with self.model.no_sync() if isinstance(self.model, DDP) and not enabled else nullcontext():
            yield

    def _run_schedule(self, run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Call a schedule's step/eval with what this stage feeds it (inputs on the first, targets on the last);
        return the mean microbatch loss on the last stage. The loss_fn multiplied by loss_multiplier; undo it.
        The last stage's outputs are not kept for a merged return (torch's default): that would hold every
        microbatch's logits to the end of the step, m x tokens x vocabulary, where 1F1B needs one at a time."""
        losses: list[torch.Tensor] = []
        first, last = self.dims.pp_rank == 0, self.dims.is_last_stage
        args = (x,) if first else ()
        run(*args, return_outputs=False, **({"target": y, "losses": losses} if last else {}))
        return torch.stack([loss.detach() for loss in losses]).mean() / self.loss_multiplier if last else None

    @torch.no_grad()
    def grad_norm_square(self) -> torch.Tensor:
        """The step's squared gradient norm (fp16: of the scaled gradients) on the device, the same on every rank
        once its collectives ran: the loop reads it with the loss and the ranks' flags (loop.train_step), the
        step's one host read."""
        if isinstance(self.optimizer, ZeroOneOptimizer):
            return self.optimizer.grad_norm_square(self.dims.tp)
        return global_grad_norm_square(self.params, self.dims)

    @torch.no_grad()
    def optimizer_step(self, lr: float, norm_square: float | None = None) -> StepResult:
        """Skip (a norm that is not finite), unscale and clip, then step. `norm_square`: grad_norm_square() as the
        loop read it; None reads it here (a host read of its own)."""
        grads = self._step_grads()
        if norm_square is None:
            norm_square = self.grad_norm_square().item()
        scaled_norm = norm_of_square(norm_square)
        loss_scale = self.scaler.factor  # what this step's loss was multiplied by; update() may grow the scale
        grad_norm = scaled_norm / loss_scale
        applied = self.scaler.update(scaled_norm)
        if applied:
            # One multiply both unscales (fp16) and clips: clip_grad_norm_'s coefficient, clamped at 1.
            clip = min(1.0, self.grad_clip / (grad_norm + 1e-6)) if self.grad_clip > 0 else 1.0
            coef = clip / loss_scale
            if coef != 1.0 and grads:
                torch._foreach_mul_(grads, coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.last_grad_bytes = sum(local_bytes(g) for g in grads)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(applied, grad_norm)

    def _step_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps: the parameters' (local shards), or ZeRO-1's shard of them."""
        if isinstance(self.optimizer, ZeroOneOptimizer):
            return self.optimizer.grads()
        return [local(p.grad) for p in self.params if p.grad is not None]

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        self.model.eval()
        device_type = x.device.type
        with autocast(self.precision, device_type):
            if self.schedule is None:
                return cross_entropy(self.model(x), y).item()
            loss = self._run_schedule(self.schedule.eval, x, y)
            return None if loss is None else loss.item()

    def state_dict(self) -> dict:
        """Keyed by the full model's parameter names; tensors plain (replicated) or DTensors (this rank's shard):
        what DCP needs to store each piece once and to reshard it into another layout. ZeRO-1's optimizer gives
        the same format (zero1.ZeroOneOptimizer.state_dict). The optimizer's param_groups are not saved: the spec
        sets them (the LR every step)."""
        if isinstance(self.optimizer, ZeroOneOptimizer):
            optim = self.optimizer.state_dict(self.module)
        else:
            optim = get_optimizer_state_dict(self.module, self.optimizer)["state"]
        return {"model": get_model_state_dict(self.module), "optim": optim}

    def restore(self, load: Callable[[dict], None]) -> None:
        """Restore from a checkpoint of any layout: `load(template)` fills a state_dict-shaped template in place (a
        collective). Under composed ZeRO-1 the template holds the optimizer state of this rank's pieces only."""
        optim = (self.optimizer.load_template(self.module) if isinstance(self.optimizer, ZeroOneOptimizer)
                 else get_optimizer_state_dict(self.module, self.optimizer)["state"])
        state = {"model": get_model_state_dict(self.module), "optim": optim}
        load(state)
        set_model_state_dict(self.module, state["model"])
        if isinstance(self.optimizer, ZeroOneOptimizer):
            self.optimizer.load_state_dict(self.module, state["optim"])
            return
        groups = get_optimizer_state_dict(self.module, self.optimizer)["param_groups"]
        set_optimizer_state_dict(self.module, self.optimizer, {"state": state["optim"], "param_groups": groups})

    def extra_state(self) -> dict:
        return {"scaler": self.scaler.state_dict()}

    def load_extra_state(self, extra: dict, step: int, skipped_steps: int) -> None:
        # DeepSpeed's checkpoints hold its own scaler (deepspeed_engine.py): this run keeps the one it started with.
        if "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])

    def rank_state(self) -> dict:
        return {"headsRng": self.heads_rng.state} if self.heads_rng else {}

    def load_rank_state(self, state: dict | None, step: int) -> None:
        """`state`: this rank's rank_state() of the same layout, or None after a layout change: then tensor
        parallel's heads stream restarts at a seed derived from its own and `step`."""
        if self.heads_rng:
            if state is None:
                self.heads_rng.restart(step)
            else:
                self.heads_rng.state = state["headsRng"]

    def state_bytes(self) -> dict[str, int]:
        opt_bytes = (self.optimizer.state_bytes() if hasattr(self.optimizer, "state_bytes")
                     else optimizer_state_bytes(self.optimizer))
        return {"params": sum(local_bytes(p) for p in self.module.parameters()), "grads": self.last_grad_bytes,
                "optimizer": opt_bytes}
