"""Pipeline parallel with torch.distributed.pipelining: contiguous layers per stage, GPipe or 1F1B schedules."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """Layers of `stage`: an even split, earlier stages taking the remainder (they also hold no head)."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep only this stage's parts of the model (in place). Parameter names stay those of the full model."""
    keep = {str(i) for i in stage_layers(len(model.layers), stages, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    parts = ([] if stage == 0 else list(model.embeddings)) + ([] if stage == stages - 1 else list(model.final))
    for part in parts:
        setattr(model, part, None)
    return model


def build_schedule(stage_module: nn.Module, pp_mesh: DeviceMesh, device: torch.device, microbatches: int,
                   schedule: str, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   precision: str):
    """A schedule whose loss_fn already weighs each microbatch (engine.loss_weight). Not scale_grads: it divides
    every gradient the stage holds after each run, so would divide earlier micro-steps' gradients again."""
    if precision == "bf16" and not isinstance(stage_module, FSDPModule):
        _send_in_bf16(stage_module, first=pp_mesh.get_local_rank() == 0, last=pp_mesh.get_local_rank() ==
                      pp_mesh.size() - 1)
    stage = PipelineStage(stage_module, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    _keep_rng_streams_through_metadata_forward(stage)
    _forget_evaluated_outputs(stage)
    return SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def _send_in_bf16(stage_module: nn.Module, first: bool, last: bool) -> None:
    """Under bf16 autocast the residual stream is fp32 (each block adds its 16-bit output to it): a stage sends it
    on in bf16, half the bytes each way (its gradient comes back in bf16 too), and the next stage carries it on in
    fp32; Megatron-LM sends its pipeline's activations in the training dtype as well. One rounding per stage
    boundary, inside autocast's own error. Not fp16: a value past its 65,504 would overflow in forward, which no
    loss scale mends. FSDP2's stages send bf16 already (its policy casts the blocks' inputs)."""
    if not last:
        stage_module.register_forward_hook(lambda module, args, out: out.to(torch.bfloat16))
    if not first:
        stage_module.register_forward_pre_hook(
            lambda module, args: tuple(a.float() if a.is_floating_point() else a for a in args))


def _forget_evaluated_outputs(stage: PipelineStage) -> None:
    """torch keeps each microbatch's output in the stage's fwd_cache for its backward, and in a forward-only run
    (evaluation, under no_grad) until the next run starts: on the last stage, every microbatch's logits at once,
    m x tokens x vocabulary, the job's peak at a large vocabulary. The last stage sends nothing on (the schedules
    still ask it for its sends, from the cache) and its loss is computed from what forward returns: there, under
    no_grad, the entry goes once its sends were asked for."""
    if not stage.is_last:
        return
    send_ops = stage.get_fwd_send_ops

    def get_fwd_send_ops(fwd_chunk_id: int):
        ops = send_ops(fwd_chunk_id)
        if not torch.is_grad_enabled():
            stage.fwd_cache.pop(fwd_chunk_id, None)
        return ops

    stage.get_fwd_send_ops = get_fwd_send_ops


def _keep_rng_streams_through_metadata_forward(stage: PipelineStage) -> None:
    """torch runs a metadata forward through the stage (`_prepare_forward_infra`: on the first step and after each
    switch between training and evaluation) under fork_rng, which puts torch's generators back but not tensor
    parallel's per-rank dropout streams (RNGStream): they would advance, and a resumed pp×tp run with dropout
    would draw other masks than the uninterrupted one. Put them back as well."""
    streams = list({id(m.heads_rng): m.heads_rng for m in stage.submod.modules()
                    if getattr(m, "heads_rng", None) is not None}.values())
    if not streams:
        return
    prepare = stage._prepare_forward_infra

    def prepare_keeping_streams(*args, **kwargs):
        states = [stream.state for stream in streams]
        try:
            return prepare(*args, **kwargs)
        finally:
            for stream, state in zip(streams, states, strict=True):
                stream.state = state

    stage._prepare_forward_infra = prepare_keeping_streams
