"""DeepSpeed ZeRO stages 1-3 for data-parallel-only layouts, behind the five calls the loop makes of TorchEngine.

The model is initialised exactly as for every other layout (`initialize`), then handed to `deepspeed.initialize`
with torch's AdamW over `param_groups` (optim.build_optimizer). Under ZeRO-3 it is built already partitioned
(`deepspeed.zero.Init`), so no rank ever holds it whole, and initialised one gathered parameter at a time
(parallel/tensors.copy_into). DeepSpeed then owns the
step: it averages gradients over the data-parallel ranks (ZeRO-1/2: bucketed reduce to each partition's owner;
ZeRO-3: reduce-scatter), clips at the *global* norm with torch's `clip_grad_norm_` coefficient
(max_norm / (norm + 1e-6), at most 1), steps its partition and all-gathers the parameters.

Precision is DeepSpeed's own: fp32; bf16 (`bf16.enabled`: bf16 weights and gradients, fp32 master partition);
fp16 (`fp16.enabled`: the same in fp16, with dynamic loss scaling set like `precision.LossScaler` — start at
2^16, halve on every overflow, double after 200 clean steps — where an overflow step is skipped on every rank).

What each rank holds (`state_bytes`, from the storages of the tensors it keeps, so padding counts), in fp32 with
Ψ parameters over N ranks, against the ZeRO paper's 4Ψ (params) + 4Ψ (grads) + 8Ψ (Adam) of plain data parallel:
- params (measured right after a step): ZeRO-1/2 the whole flat weight buffer, 4Ψ; ZeRO-3 this rank's partition
  plus the small "persistent" tensors every rank keeps whole (up to 10 x embedDim elements: norm gains, biases),
  4Ψ/N plus a few percent. What ZeRO-3 gathers ahead of use during forward/backward — and leaves gathered after an
  evaluation forward until the next training step — is working memory, not counted;
- grads (measured when the step starts): at gradient_accumulation_steps 1 DeepSpeed reduces gradients bucket by
  bucket during backward into the owner of each partition and frees the rest, at stage 1 exactly as at stage 2
  (stage 1 differs only under gradient accumulation): 4Ψ/N, not the paper's stage-1 4Ψ. ZeRO-1/2 keep whole the
  gradient of a parameter straddling a partition boundary (up to two per rank), so a rank may hold up to two
  tensors more than 4Ψ/N. Communication buckets (max(embedDim², 2^20) elements, freed after backward) are not
  model state;
- optimizer: Adam's two moments for this rank's partition *and* DeepSpeed's fp32 master copy of it, which it keeps
  even when the model itself is fp32 (a redundant copy then): 12Ψ/N, the paper's K = 12, not 8Ψ/N.
In bf16/fp16 the weights take 2 bytes, 2Ψ (2Ψ/N at ZeRO-3), and gradients accumulate in fp32 (`grad_accum_dtype`,
as torch-native layouts accumulate): 4Ψ/N of partitions at ZeRO-2/3 beside the 2-byte gradients backward produces.
At ZeRO-1 in bf16 DeepSpeed then uses its BF16_Optimizer, which keeps whole fp32 gradients (4Ψ) and Adam and masters
for its partition (12Ψ/N).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..api import Spec
from ..api.memory import DEEPSPEED_MAX_LIVE_PARAMETERS, deepspeed_buckets
from .checkpoint import CheckpointError
from .partial_read import FlatRange
from .engine import Batch, StepResult
from .loss import cross_entropy
from .models.registry import ModelConfig, build_model
from .models.weights import initialize
from .optim import build_optimizer
from .parallel.activation_checkpoint import apply_ac
from .parallel.compile import apply_compile
from .parallel.dims import ParallelDims
from .parallel.precision import DTYPES, LossScaler
from .parallel.tensors import in_batches, save_owners

# DeepSpeed's dynamic loss scaler state; the rest of it is configuration.
LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# A resume loads the parameters in parts of this many elements (each rank its share of them), each part one
# collective load.
LOAD_PART_ELEMENTS = 2**28


def deepspeed_config(spec: Spec, dp: int, device: torch.device, embed_dim: int) -> dict:
    t, p = spec.training, spec.parallelism
    # Buckets and the ZeRO-3 persistence threshold scale with the model, as Hugging Face's "auto" values do
    # (hidden², 0.9 x hidden², 10 x hidden; memory.deepspeed_buckets): DeepSpeed's fixed defaults would allocate a
    # 2 GB fp32 gradient bucket per rank and, for models under ~1e5-element tensors, keep every parameter whole
    # under ZeRO-3.
    bucket, prefetch = deepspeed_buckets(embed_dim)
    zero = {
        "stage": p.zero_stage,
        # DeepSpeed's defaults, pinned: 0.19 is reported to skip the gradient all-reduce on CPU tensors with both
        # off (not reproduced with 0.19.8 on gloo; tests/trainer/parallel/test_zero.py fails if a reduction goes
        # missing).
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": prefetch,
        "stage3_param_persistence_threshold": 10 * embed_dim,
        # DeepSpeed's defaults, pinned: the memory model bounds ZeRO-3's gathered parameters by them
        "stage3_max_live_parameters": DEEPSPEED_MAX_LIVE_PARAMETERS,
        "stage3_max_reuse_distance": DEEPSPEED_MAX_LIVE_PARAMETERS,
    }
    # Each gradient bucket's reduction runs on a stream of its own while backward fills the next bucket (a second
    # bucket buffer, which the memory model counts). DeepSpeed 0.19.8 turns it on for ZeRO-3 only; on every stage
    # and device here, so the CPU tests measure what a GPU runs (on CPU its streams are no-ops).
    zero["overlap_comm"] = True
    return {
        "train_batch_size": t.batch_size,
        "train_micro_batch_size_per_gpu": t.batch_size // dp // t.gradient_accumulation,
        "gradient_accumulation_steps": t.gradient_accumulation,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        # Gradients are reduced across data-parallel ranks in spec.reducePrecision (fp32 unless the spec asks for
        # 16 bits), as the torch-native layouts reduce them: DeepSpeed's default (the model's dtype) would sum
        # bf16/fp16 gradients of N ranks in 8/11-bit mantissas whatever the spec, and the same spec would train with
        # other numerics in another layout.
        "communication_data_type": spec.reduce_precision,
        # ... and accumulated over micro-steps in fp32, as torch-native layouts accumulate into fp32 gradients.
        "data_types": {"grad_accum_dtype": "fp32"},
        "bf16": {"enabled": spec.precision == "bf16"},
        "fp16": {
            "enabled": spec.precision == "fp16",
            "loss_scale": 0,  # dynamic
            "initial_scale_power": int(math.log2(LossScaler.scale)),
            "loss_scale_window": LossScaler.growth_interval,
            "hysteresis": 1,  # halve on the first overflow, as precision.LossScaler does
            "min_loss_scale": LossScaler.min_scale,
        },
        "steps_per_print": 2**31 - 1,  # progress is ours (progress.py)
        "wall_clock_breakdown": False,
    }


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: views into one flat buffer count the buffer once."""
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            s = t.untyped_storage()
            storages[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(storages.values())


@dataclass
class DeepSpeedEngine:
    ds: object  # deepspeed.DeepSpeedEngine
    module: nn.Module  # the model DeepSpeed wraps
    zero_stage: int
    dp: int  # data-parallel ranks (DeepSpeed's whole world)
    dp_rank: int
    last_param_bytes: int = 0
    last_grad_bytes: int = 0

    @property
    def zero(self):
        """DeepSpeed's ZeRO optimizer (stage 1/2: DeepSpeedZeroOptimizer; 3: DeepSpeedZeroOptimizer_Stage3; stage 1
        in bf16: BF16_Optimizer, DeepSpeed's choice for fp32 gradient accumulation there)."""
        return self.ds.optimizer

    @property
    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions, one flat tensor per group: what the inner AdamW steps."""
        if self.zero_stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        if hasattr(self.zero, "fp32_groups_flat_partition"):  # BF16_Optimizer
            return list(self.zero.fp32_groups_flat_partition)
        return list(self.zero.single_partition_of_fp32_groups)

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """DeepSpeed's own accumulation: backward scales each loss by 1/gradient_accumulation_steps (and the loss
        scale); step() after every micro-step but the last only counts it (optimizer_step takes the real one)."""
        self.ds.train()
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            loss = cross_entropy(self.ds(x), y)
            self.ds.backward(loss)  # reduces gradients into their owners' partitions (ZeRO-1: at the boundary)
            losses.append(loss.detach())
            if i < len(micro_batches) - 1:
                self.ds.step()
        return torch.stack(losses).double().mean()

    def grad_norm_square(self) -> None:
        """None: DeepSpeed computes and reads the norm inside its step (its overflow check and clip)."""
        return None

    def optimizer_step(self, lr: float, norm_square: float | None = None) -> StepResult:
        self.last_grad_bytes = self._grad_bytes()
        for group in self.zero.param_groups:
            group["lr"] = lr
        _step_then_update_loss_scale(self.ds, self.zero)
        self.last_param_bytes = self._param_bytes()
        norm = self.ds.get_global_grad_norm()
        return StepResult(applied=self.ds.was_step_applied(), grad_norm=float(norm))

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.ds.eval()
        return cross_entropy(self.ds(x), y).item()

    def state_dict(self) -> dict:
        """This rank's share of TorchEngine's checkpoint format (checkpoint.py), gathered from the ZeRO partitions
        (collective over dp): whole fp32 tensors keyed by parameter name — the master weights, Adam's moments and
        step count — of the parameters `tensors.save_owners` gives this rank. DCP writes each from its keeper.

        Each tensor is gathered alone and moved to host memory at once (or dropped by the ranks that do not keep
        it), so a device holds its partitions plus one gathered tensor, and a host 16Ψ/N bytes: never the whole
        fp32 model and Adam state (96 GB for 8B parameters) on every GPU.

        The low-precision weights are not saved: DeepSpeed keeps them equal to the cast of the masters.
        """
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._link_optimizer_state()
        # Torch's AdamW counts steps per parameter; DeepSpeed's per flat group. Every group steps together.
        step = self.zero.optimizer.state[self.masters[0]]["step"]
        params = list(self.module.named_parameters())
        owners = save_owners([_numel(p) for _, p in params], self.dp)
        model, optim = {}, {}
        for (name, p), owner in zip(params, owners, strict=True):
            mine = owner == self.dp_rank
            moments = {}
            for key in ADAM_MOMENTS:  # one gathered tensor at a time on the device
                moment = safe_get_full_optimizer_state(p, key)
                moments[key] = moment.cpu() if mine else None
            weights = safe_get_full_fp32_param(p)
            if mine:
                model[name] = weights.cpu()
                optim[name] = {**moments, "step": step.detach().cpu().clone()}
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def restore(self, load: Callable[[dict], None]) -> None:
        """Restore from a checkpoint of any layout and engine: `load(part)` fills `part`, a state_dict-shaped
        template, from it (a collective). Each rank asks only for the flat range of each tensor that its ZeRO
        partition holds (`_own_ranges`; partial_read reads just those bytes): a rank reads and holds 1/N of the fp32
        weights and Adam moments, not the whole state (96 GB per rank at 8B). The parameters come in parts of at
        most LOAD_PART_ELEMENTS elements, each one collective load."""
        self._link_optimizer_state()
        params = list(self.module.named_parameters())
        steps: set[float] = set()
        for part in in_batches([_numel(p) for _, p in params], LOAD_PART_ELEMENTS):
            state: dict = {"model": {}, "optim": {}}
            filled = []
            for name, p in (params[i] for i in part):
                shape = tuple(getattr(p, "ds_shape", p.shape))
                start, destinations, after = self._own_ranges(p)
                state["model"][name] = FlatRange(shape, start, destinations[None])
                state["optim"][name] = {key: FlatRange(shape, start, destinations[key]) for key in ADAM_MOMENTS}
                state["optim"][name]["step"] = torch.tensor(0.0)
                filled.append((name, after))
            load(state)
            for name, after in filled:
                after()
                steps.add(float(state["optim"][name]["step"]))
        if len(steps) != 1:
            raise CheckpointError(f"the checkpoint's parameters have taken different numbers of optimizer steps "
                                  f"({sorted(steps)}); DeepSpeed keeps one count for all of them")
        step = steps.pop()
        for master in self.masters:
            self.zero.optimizer.state[master]["step"].fill_(step)
        self._refresh_weights()

    def _own_ranges(self, p: nn.Parameter) -> tuple[int, dict[str | None, torch.Tensor], Callable[[], None]]:
        """Where this rank's share of `p` starts in the flattened parameter, the 1-D tensors its fp32 weights (key
        None) and Adam's moments are loaded into, and what to call once they are. ZeRO-1/2 (and bf16 ZeRO-1): the
        fragment of DeepSpeed's flat master partition and moments that holds `p`'s elements (`_hp_mapping`; none
        if the partition holds none of them), loaded in place. ZeRO-3: the parameter's own partition, padded past
        its end, loaded into host buffers and then set as DeepSpeed's local state."""
        if self.zero_stage < 3:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                empty = torch.empty(0)
                return 0, dict.fromkeys((None, *ADAM_MOMENTS), empty), lambda: None
            return (mapping.lp_fragment_address.start,
                    {key: mapping.get_hp_fragment(optim_state_key=key) for key in (None, *ADAM_MOMENTS)},
                    lambda: None)
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        size = p.ds_tensor.numel()
        start = self.zero._get_param_partition_rank(p) * size
        real = max(0, min(p.ds_numel - start, size))
        padded = {key: torch.zeros(size, dtype=torch.float32) for key in (None, *ADAM_MOMENTS)}

        def set_local() -> None:
            safe_set_local_fp32_param(p, padded[None])
            for key in ADAM_MOMENTS:
                safe_set_local_optimizer_state(p, padded[key], key)

        return min(start, p.ds_numel), {key: t[:real] for key, t in padded.items()}, set_local

    def _link_optimizer_state(self) -> None:
        """Make Adam's state exist and be reachable by parameter, for the safe_*_optimizer_state calls.

        torch's AdamW creates its state at the first step, so a resume has none to load into: create it as that
        step would (zeros, step 0). DeepSpeed 0.19.8's ZeRO-1/2 map each parameter to its fragments of the state
        once, right after the first group's first step, when the other groups have none yet: map again."""
        inner = self.zero.optimizer
        for master in self.masters:
            if not inner.state[master]:
                inner.state[master] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(master),
                                       "exp_avg_sq": torch.zeros_like(master)}
        if self.zero_stage < 3:
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()

    def extra_state(self) -> dict:
        return {"lossScaler": _loss_scaler_state(getattr(self.zero, "loss_scaler", None))}

    def load_extra_state(self, extra: dict, step: int, skipped_steps: int) -> None:
        scaler, saved = getattr(self.zero, "loss_scaler", None), extra.get("lossScaler", {})
        # A checkpoint of another precision holds another kind of scaler (fp16's dynamic one, or fp32/bf16's
        # constant 1), one of TorchEngine none of DeepSpeed's: this run keeps the one it started with.
        if saved.keys() == _loss_scaler_state(scaler).keys():
            for k, v in saved.items():
                setattr(scaler, k, type(getattr(scaler, k))(v))
        # DeepSpeed's counters follow from the step; micro_steps decides where gradient accumulation ends.
        ds = self.ds
        ds.global_steps, ds.skipped_steps = step, skipped_steps
        ds.micro_steps = step * ds.gradient_accumulation_steps()
        ds.global_samples = step * ds.train_batch_size()

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict | None, step: int) -> None:
        pass

    def _refresh_weights(self) -> None:
        """Weights from the master partitions, exactly as DeepSpeed's own step leaves them (collective)."""
        if self.zero_stage < 3:
            self.zero.update_lp_params()  # cast own partition, all-gather the flat buffers
            return
        for lp, master in zip(self.zero.fp16_partitioned_groups_flat, self.zero.fp32_partitioned_groups_flat,
                              strict=True):
            lp.copy_(master)
        persistent = self.zero.persistent_parameters
        if persistent:
            persistent[0].all_gather(persistent)

    def grad_accumulators(self) -> list[torch.Tensor]:
        """Where DeepSpeed accumulates the step's gradients over micro-steps (fp32): ZeRO-2/3 this rank's
        partitions; ZeRO-1 in bf16 (BF16_Optimizer) whole fp32 buffers."""
        if self.zero_stage == 3:
            return [self.zero.grad_partitions_flat_buffer]
        if hasattr(self.zero, "fp32_groups_gradients_flat"):  # BF16_Optimizer
            return list(self.zero.fp32_groups_gradients_flat)
        return [g for grads in self.zero.averaged_gradients.values() if grads for g in grads]

    def _grad_bytes(self) -> int:
        """Gradient storage held now (called just before the step): accumulators plus any whole .grad left."""
        return _storage_bytes([*self.grad_accumulators(), *(p.grad for p in self.module.parameters())])

    def _param_bytes(self) -> int:
        """Weight storage held now (called right after the step, when ZeRO-3 has released its gathers)."""
        weights = [p.data for p in self.module.parameters()]
        if self.zero_stage == 3:
            weights += [p.ds_tensor for p in self.module.parameters()]
        return _storage_bytes(weights)

    def state_bytes(self) -> dict[str, int]:
        moments = [v for m in self.masters for v in self.zero.optimizer.state[m].values()
                   if torch.is_tensor(v) and v.dim() > 0]
        return {"params": self.last_param_bytes, "grads": self.last_grad_bytes,
                "optimizer": _storage_bytes([*moments, *self.masters])}


def _numel(p: torch.Tensor) -> int:
    """A parameter's whole size; ZeRO-3 leaves a partitioned parameter's tensor empty (ds_numel is its size)."""
    return getattr(p, "ds_numel", p.numel())


def _loss_scaler_state(scaler) -> dict[str, float]:
    """The scaler's state; none for BF16_Optimizer, which keeps no loss scale."""
    return {k: float(getattr(scaler, k)) for k in LOSS_SCALER_STATE if hasattr(scaler, k)}


def _step_then_update_loss_scale(ds, zero) -> None:
    """`ds.step()`, with the loss scale updated after the gradients are unscaled rather than before.

    DeepSpeed's ZeRO optimizers (0.19.8, stages 1-3) update the dynamic loss scale and then unscale with the
    updated one: on every step that doubles the scale, gradients are divided by twice the scale their loss was
    multiplied by, so half the gradient is applied (unless clipping binds), and ZeRO-3 reports half the norm.
    """
    overflows: list[bool] = []
    zero._update_scale = overflows.append  # the instance attribute shadows the method for this one step
    try:
        ds.step()
    finally:
        del zero._update_scale
    for overflow in overflows:
        zero._update_scale(overflow)


def skip_the_shm_op(device: torch.device) -> None:
    """Before DeepSpeed sets up its comm backend: on CPU its TorchBackend JIT-compiles a shared-memory all-reduce op
    (20 s to minutes, again in every new environment or pod, and a compiler in every image) that only its inference
    all-reduce uses; training never calls it."""
    if device.type == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def build_deepspeed_engine(spec: Spec, dims: ParallelDims, device: torch.device, cfg: ModelConfig) -> DeepSpeedEngine:
    skip_the_shm_op(device)
    import deepspeed

    t = spec.training
    config = deepspeed_config(spec, dims.dp, device, cfg.embed_dim)
    model = _build_model(cfg, dims, device, config, DTYPES[spec.precision])
    initialize(model, t.seed, spec.model.init)
    apply_ac(model, t.activation_checkpointing)
    if t.compile:  # ZeRO-1/2 only: ZeRO-3's gathers hook every module (refused in spec.cross_field_problems)
        apply_compile(model)
    ds, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, dims, t), config=config)
    return DeepSpeedEngine(ds=ds, module=model, zero_stage=dims.zero_stage, dp=dims.dp, dp_rank=dims.dp_rank)


def _build_model(cfg: ModelConfig, dims: ParallelDims, device: torch.device, config: dict,
                 dtype: torch.dtype) -> nn.Module:
    """The model on `device`, its weights allocated but not written: `initialize` then writes each one. ZeRO-1/2
    build on the meta device and allocate on `device` (a GPU build then never holds the whole fp32 model in host
    memory: 32 GB per rank at 8B; initialize draws one full tensor at a time). ZeRO-3 partitions as it builds
    (deepspeed.zero.Init: each module's weights are split over the dp ranks as soon as its constructor returns),
    so no rank ever holds the whole model, and each weight is written through a gather of that one parameter
    (parallel/tensors.copy_into).

    zero.Init makes the weights the config's dtype (bf16/fp16 under DeepSpeed's mixed precision, else fp32) right
    away: DeepSpeed casts a model it did not partition itself, but not one built partitioned."""
    import deepspeed

    if dims.zero_stage < 3:
        with torch.device("meta"):
            model = build_model(cfg)
        return model.to_empty(device=device)
    # zero.Init reads the world size from deepspeed.comm, which deepspeed.initialize would only set up later (over
    # the torch process group already running), and otherwise takes it for 1.
    deepspeed.init_distributed()
    # No `dtype=` argument: DeepSpeed 0.19.8's Init._set_dtype reads an explicit dtype as
    # `(dtype or fp16) if accelerator.is_fp16_supported() else bf16 if ...`, so on a CPU without native fp16
    # (an AMD EPYC) every dtype asked for, fp32 included, became bf16. Given none, it takes the config's.
    with deepspeed.zero.Init(config_dict_or_path=config, data_parallel_group=dims.group("dp")):
        model = build_model(cfg)
    held = {p.ds_tensor.dtype for p in model.parameters()}
    if held != {dtype}:  # any other DeepSpeed whose zero.Init picks a dtype of its own
        raise RuntimeError(f"deepspeed.zero.Init built the model in {sorted(map(str, held))}, not {dtype}: this "
                           f"DeepSpeed ({deepspeed.__version__}) does not hold the job's spec.precision")
    return model
