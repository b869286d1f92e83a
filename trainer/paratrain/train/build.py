"""The engine a run trains with, assembled in one documented order (after torchtitan):

    build_model on the meta device → split_stage (pipeline) → parallelize → initialize → build_optimizer

ZeRO on data-parallel-only layouts goes to DeepSpeed instead (deepspeed_engine.py), as the spec promises;
`ParallelDims.uses_deepspeed` decides, here and only here.
"""

from __future__ import annotations

import torch

from ..api import Spec
from . import deepspeed_engine
from .engine import TorchEngine
from .models.registry import ModelConfig, build_model, model_config
from .models.weights import initialize
from .optim import build_optimizer
from .parallel.dims import ParallelDims
from .parallel.parallelize import parallelize
from .parallel.pipeline import build_schedule, split_stage
from .parallel.precision import LossScaler
from .parallel.tensor_parallel import HEADS_SEED_OFFSET, RNGStream
from .parallel.zero1 import ZeroOneOptimizer


def build_engine(spec: Spec, dims: ParallelDims, device: torch.device, vocab_size: int):
    """The engine the loop drives: DeepSpeed's for data-parallel-only ZeRO, TorchEngine for every other layout."""
    cfg = model_config(spec, vocab_size)
    if dims.uses_deepspeed:
        return deepspeed_engine.build_deepspeed_engine(spec, dims, device, cfg)
    return build_torch_engine(spec, dims, device, cfg)


def build_torch_engine(spec: Spec, dims: ParallelDims, device: torch.device, cfg: ModelConfig) -> TorchEngine:
    t, p = spec.training, spec.parallelism
    with torch.device("meta"):
        model = build_model(cfg)
    if dims.pp_enabled:
        split_stage(model, dims.pp_rank, dims.pp)
    heads_rng = None
    if dims.tp_enabled:
        heads_rng = RNGStream(dims.dropout_seed(t.seed) + HEADS_SEED_OFFSET + dims.coordinate("tp"), device)
    wrapped, dp_reducer = parallelize(model, dims, device, heads_rng, t.activation_checkpointing, spec.precision,
                                      spec.reduce_precision, t.compile)
    initialize(model, t.seed, spec.model.init)
    optimizer = build_optimizer(model, dims, t, dp_reducer)
    if isinstance(optimizer, ZeroOneOptimizer) and not t.compile:
        optimizer.gather_in_forward(model)  # its all-gathers after a step overlap the next forward
    engine = TorchEngine(
        model=wrapped, module=model, optimizer=optimizer, dims=dims,
        precision=spec.precision, grad_clip=t.grad_clip, dp_reducer=dp_reducer, accumulation=t.gradient_accumulation,
        microbatches=p.microbatches, scaler=LossScaler(enabled=spec.precision == "fp16"), heads_rng=heads_rng,
    )
    if dims.pp_enabled:
        engine.schedule = build_schedule(model, dims.get_mesh("pp"), device, p.microbatches, p.pipeline_schedule,
                                         engine.scaled_loss_fn(), spec.precision)
    return engine
