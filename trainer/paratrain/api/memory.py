"""A per-rank memory model: the peak bytes of live tensors each rank of a job holds, split into terms, from the spec
alone (no torch). `paratrain validate --memory` prints it; the operator and `validate` refuse a job whose peak
exceeds `spec.resources.gpuMemory`. docs/trainer.md gives the formulas; tests/trainer/test_memory_model.py holds
them to measurement (`paratrain run --measure-memory`) within ±15% on CPU.

Terms, for Ψ parameters held by the rank (its pipeline stage, its tensor-parallel shard) over dp ranks:
- params: fp32 weights, 4Ψ (the optimizer steps them; autocast computes in 16 bits from a cached copy); FSDP2 ZeRO-3
  4Ψ/dp; DeepSpeed keeps its weights in the training dtype (2Ψ in bf16/fp16), ZeRO-3 2-4Ψ/dp.
- grads: 4Ψ, ZeRO-2/3 4Ψ/dp (DeepSpeed accumulates in fp32; its ZeRO-1 in bf16 keeps whole fp32 gradients, and
  its ZeRO-1/2 under gradient accumulation whole gradients in the parameters' dtype until the boundary's reduction).
- optimizer: AdamW's two fp32 moments, 8Ψ (ZeRO: 8Ψ/dp), and DeepSpeed's fp32 master copy 4Ψ/dp.
- activations: what a block saves for backward per token (`block_bytes`), times the tokens of the microbatches in
  flight (all of a step's for GPipe, p - stage for 1F1B), for the rank's layers; activation checkpointing keeps
  only each block's input (full) or its matmul and attention outputs (selective), plus one block rebuilt in backward.
- loss: the last stage's logits and the gradient buffer the loss fills as it runs (loss.ChunkedCrossEntropy),
  plus one piece of 4,096 tokens' fp32 copy over the vocabulary (exponentiated in place); under tensor
  parallel the head, its logits and the loss's buffers are split by vocabulary (V/tp columns per rank).
- buffers: DDP's gradient buckets (4Ψ), DeepSpeed's reduce bucket (ZeRO-3: its gathered parameters and the flat
  buffer they are cut from), pipeline receive buffers (one per microbatch),
  bf16 autocast's weight copies (2Ψ of matmul weights).
The peak is taken at the start of backward (states + activations + loss + buffers, gradients already there under
accumulation or a pipeline), or at the optimizer step (states + gradients + AdamW's temporaries), whichever is
larger. A checkpoint save adds at most one gathered tensor (DeepSpeed) or bucket (composed ZeRO-1): `checkpoint`.
Composed ZeRO-1's all-gathers after a step hold two buckets' flat buffers into the next forward's first layers,
where the activations are not yet there: below either peak, not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .shapes import parameter_count

FP32 = 4
CE_CHUNK_TOKENS = 4096  # loss.CE_CHUNK_TOKENS: the loss's fp32 pieces
DDP_BUCKET_BYTES = 25 * 2**20  # torch's default bucket_cap_mb; the buckets together hold every gradient once
# DeepSpeed ZeRO-3 keeps at most this many gathered parameters alive (stage3_max_live_parameters, DeepSpeed's
# default, pinned in deepspeed_engine's config), and releases none it will reuse within as many (max_reuse_distance).
DEEPSPEED_MAX_LIVE_PARAMETERS = 10**9
# A checkpoint holds fp32 weights and AdamW's two fp32 moments, whatever the layout (ZeRO shards them, DCP writes
# each tensor once); saving costs a fixed part too (the collective plan, the manifest, the commit).
CHECKPOINT_BYTES_PER_PARAMETER = 12
SAVE_FIXED_SECONDS = 10
UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def deepspeed_buckets(embed_dim: int) -> tuple[int, int]:
    """DeepSpeed's reduce (and all-gather) bucket and ZeRO-3's prefetch bucket, in elements, as paratrain configures
    them (deepspeed_engine.deepspeed_config): Hugging Face's "auto" values (hidden², 0.9 x hidden²), at least 2^20
    (4 MB in fp32) so that small models do not pay one collective per tensor; even, as DeepSpeed wants."""
    bucket = max(2**20, 2 * math.ceil(embed_dim**2 / 2))
    return bucket, int(0.9 * bucket)


def parse_bytes(quantity: str) -> int:
    """A quantity of bytes ("80Gi", "80GiB", "80G", "85899345920") as an int; ValueError if it is not one."""
    text = str(quantity).strip().removesuffix("B")
    number = text.rstrip("KMGTi")
    unit = text[len(number):]
    try:
        return int(float(number) * UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"{quantity!r} is not a quantity of bytes (e.g. 80Gi, 40G)") from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Shape:
    family: str
    layers: int
    embed_dim: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    block_size: int
    bias: bool = False  # gpt's MLP and LayerNorm biases (spec.model.bias)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.embed_dim // self.heads)

    def block_params(self) -> tuple[int, int]:
        """(split by tensor parallel, replicated) parameters of one block."""
        c, f, kv = self.embed_dim, self.ffn_dim, self.kv_dim
        if self.family == "gpt":  # q/k/v/o, fc (+bias), proj; ln1, ln2 (+biases), proj's bias
            b = int(self.bias)
            return 4 * c * c + 2 * c * f + b * f, (2 + 3 * b) * c
        return 2 * c * c + 2 * c * kv + 3 * c * f, 2 * c  # q/o, k/v, gate/up/down; two RMSNorms

    def matmul_params(self, tp: int) -> int:
        split, _ = self.block_params()
        return split // tp  # biases are few

    def embedding_params(self) -> int:
        return self.vocab * self.embed_dim + (self.block_size * self.embed_dim if self.family == "gpt" else 0)

    def vocab_columns(self, tp: int) -> int:
        """The head's rows (logits' columns) on a tensor-parallel rank: rank 0's, the largest part."""
        return -(-self.vocab // tp)

    def final_params(self, tp: int) -> int:
        """The final norm and this tensor-parallel rank's part of the head."""
        return (1 + int(self.bias)) * self.embed_dim + self.embed_dim * self.vocab_columns(tp)


def block_bytes(shape: Shape, tp: int, half: bool, mode: str, residual_bytes: int = FP32, device: str = "cpu"
                ) -> float:
    """Bytes one block saves for backward per token (tensor-parallel shard `tp`), counted from the model's ops:
    the residual stream in `residual_bytes` (fp32, or 16 bits where FSDP2's mixed precision casts each block's
    input), the norms' statistics in fp32, the rest in the compute dtype (2 bytes under bf16/fp16 autocast, which
    also saves the 16-bit copy of each norm output the matmuls read, in place of the fp32 one).

    GPT: block input and mid-block residual (2C), two norm outputs (2C, one copy each that the projections reading
    it share: models.gpt.matmul_input), q/k/v (3C/tp), attention output (C/tp) and its log-sum-exp (heads/tp,
    fp32), MLP input projection and GELU output (2F/tp). Llama (RMSNorm, RoPE, SwiGLU): q/k/v after RoPE, gate and
    up outputs, SiLU and product (4F/tp); on CPU, RMSNorm is a composite of ops that keeps its normalised input in
    fp32 for its gain's gradient (2C·4), where CUDA's fused kernel (torch's `_fused_rms_norm`) keeps only its input
    (the residual, counted) and one statistic a token. On CUDA, fp32 grouped-query attention repeats k and v to the
    query heads for the memory-efficient kernel (`repeated_kv_bytes`).

    Selective AC keeps the matmul and attention outputs and tensor parallel's collectives: the row-parallel
    projections' (attention's o, the MLP's down) outputs are full width, partial sums, and under tp > 1 each is
    all-reduced into another full-width tensor, both kept (activation_checkpoint.SAVED_OPS)."""
    c, f, h, kv = shape.embed_dim, shape.ffn_dim, shape.heads, shape.kv_dim
    act = 2 if half else FP32
    stats = 4 * FP32 if shape.family == "gpt" else 2 * FP32
    residual = 2 * c * residual_bytes
    attention = repeated_kv_bytes(shape, half, device)
    if shape.family == "gpt":
        norms = 2 * c * act
        split = (3 * c + c + 2 * f) * act + h * FP32
    else:
        norms = 2 * c * (act + (FP32 if device == "cpu" else 0))
        split = (c + 2 * kv + c + 4 * f) * act + h * FP32
    if mode == "full":
        return c * residual_bytes  # the block's input
    if mode == "selective":
        column = (c + 2 * kv + c + (2 * f if shape.family == "llama" else f)) * act  # q/k/v, attention, MLP input
        # (repeated k and v are an op's output selective AC recomputes: not kept)
        return c * residual_bytes + (column + h * FP32) / tp + row_parallel_outputs(shape, tp, half)
    return residual + norms + stats + (split + attention) / tp


def row_parallel_outputs(shape: Shape, tp: int, half: bool) -> float:
    """What selective AC keeps a token of the row-parallel projections (attention's o, the MLP's down): their
    outputs, full width (partial sums under tensor parallel), and under tp > 1 their all-reduces' outputs, also
    full width. A block without checkpointing keeps none of them (the residual adds that read them need nothing)."""
    return 2 * shape.embed_dim * (2 if half else FP32) * (2 if tp > 1 else 1)


def repeated_kv_bytes(shape: Shape, half: bool, device: str) -> float:
    """What attention saves per token beyond the grouped k and v where `models.gpt.attend` repeats them to every
    query head: on CUDA, in fp32 (or TF32) with fewer key/value heads than query heads, where no fused kernel takes
    grouped heads (flash needs 16-bit inputs, the memory-efficient kernel no `enable_gqa`; torch's math kernel, which
    it would otherwise fall to, would hold the whole attention matrix). The memory-efficient kernel then keeps the
    repeated k and v: 2C in place of 2·kv, in fp32. 0 elsewhere: CPU's flash kernel takes fp32 and grouped heads."""
    if device != "cuda" or half or shape.kv_heads == shape.heads:
        return 0.0
    return (2 * shape.embed_dim - 2 * shape.kv_dim) * FP32


@dataclass
class RankMemory:
    rank: int
    stage: int
    terms: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0

    def biggest(self) -> tuple[str, int]:
        return max(((k, v) for k, v in self.terms.items() if not k.startswith("_")), key=lambda kv: kv[1])


def device_of(spec) -> str:
    """The device the job's ranks compute on: "cuda" where its pods get GPUs, else "cpu" (gloo)."""
    return "cuda" if spec.resources.gpus_per_node else "cpu"


def predict(spec, vocab_size: int, device: str | None = None) -> list[RankMemory]:
    """Every rank's predicted peak, in rank order (each rank's stage as ParallelDims lays the mesh out: stage-major
    under rankOrder tp-dp-pp, tp ranks of each stage in turn within a replica under tp-pp-dp), on `device` ("cpu" or
    "cuda"; default: the spec's, `device_of`), where some kernels keep other tensors."""
    p = spec.parallelism
    shape, device = _shape(spec, vocab_size), device or device_of(spec)
    stages = [_stage(spec, shape, s, device) for s in range(p.pipeline)]

    def stage_of(rank: int) -> int:
        return rank // p.tensor % p.pipeline if p.mesh_dims[0] == "dp" else rank // (p.data * p.tensor)
    return [RankMemory(rank, stage, dict(stages[stage]), _peak(stages[stage], p.pipeline > 1))
            for rank, stage in enumerate(map(stage_of, range(spec.world_size)))]


def largest_peak(spec, vocab_size: int, device: str) -> int:
    """The largest rank's predicted peak, computed for the stages that can hold it only (the planner asks for
    thousands of layouts): the first (the embedding, the most microbatches in flight under 1F1B), the second (as many
    layers or one fewer, but receive buffers the first lacks; every later middle stage holds no more than it) and
    the last (the loss)."""
    pp, shape = spec.parallelism.pipeline, _shape(spec, vocab_size)
    return max(_peak(_stage(spec, shape, s, device), pp > 1) for s in sorted({0, min(1, pp - 1), pp - 1}))


def _shape(spec, vocab_size: int) -> Shape:
    m = spec.model
    return Shape(m.family, m.layers, m.embed_dim, m.heads, m.kv_heads, m.ffn_dim, vocab_size, m.block_size, m.bias)


def _stage_layers(layers: int, stages: int, stage: int) -> int:
    base, extra = divmod(layers, stages)
    return base + (1 if stage < extra else 0)


def _stage(spec, shape: Shape, stage: int, device: str) -> dict[str, int]:
    p, t = spec.parallelism, spec.training
    dp, tp, pp, zero = p.data, p.tensor, p.pipeline, p.zero_stage
    first, last = stage == 0, stage == pp - 1
    half = spec.precision in ("bf16", "fp16")
    deepspeed = p.on_deepspeed
    fsdp = zero >= 2 and not deepspeed
    layers = _stage_layers(shape.layers, pp, stage)
    split, replicated = shape.block_params()
    psi = layers * (split // tp + replicated) + (shape.embedding_params() if first else 0) + \
        (shape.final_params(tp) if last else 0)

    # Tokens of one microbatch on this rank, and how many microbatches' activations are alive at once.
    micro_tokens = t.batch_size // dp // t.gradient_accumulation // p.microbatches * shape.block_size
    if pp == 1:
        in_flight = 1
    elif p.pipeline_schedule == "GPipe":
        in_flight = p.microbatches
    else:
        in_flight = min(p.microbatches, pp - stage)
    tokens = micro_tokens * in_flight

    terms: dict[str, int] = {}
    weight_bytes = 2 if deepspeed and half else FP32
    if deepspeed:
        terms["params"] = psi * weight_bytes // (dp if zero == 3 else 1)
        whole_fp32_grads = zero == 1 and spec.precision == "bf16"  # BF16_Optimizer
        terms["grads"] = psi * FP32 // (1 if whole_fp32_grads else dp)
        terms["optimizer"] = 12 * psi // dp
    else:
        terms["params"] = psi * FP32 // (dp if fsdp and zero == 3 else 1)
        terms["grads"] = psi * FP32 // (dp if fsdp else 1)
        terms["optimizer"] = 8 * psi // (dp if zero >= 1 else 1)

    mode = t.activation_checkpointing
    # FSDP2's MixedPrecisionPolicy casts each sharded block's inputs to the 16-bit type: the residual stream too.
    residual_bytes = 2 if fsdp and half else FP32
    terms["activations"] = int(tokens * layers * block_bytes(shape, tp, half, mode, residual_bytes, device))
    # What a pipeline stage sends and receives: the residual stream in bf16 under bf16 (pipeline._send_in_bf16) or
    # FSDP2's 16-bit policy, else fp32.
    message_bytes = 2 if residual_bytes == 2 or spec.precision == "bf16" else FP32
    if pp > 1 and not last:  # the stage's output, kept for its backward
        terms["activations"] += tokens * shape.embed_dim * message_bytes
    # Backward of one block: the gradients of its MLP's hidden activations, and under checkpointing what it
    # rebuilds of the block beyond what it saved.
    kept = block_bytes(shape, tp, half, mode, residual_bytes, device)
    if mode == "selective":  # what selective AC keeps that no plain backward keeps is not rebuilt
        kept -= row_parallel_outputs(shape, tp, half)
    rebuilt = max(0.0, block_bytes(shape, tp, half, "none", residual_bytes, device) - kept)
    terms["_block_backward"] = int(micro_tokens * (2 * shape.ffn_dim * (2 if half else FP32) / tp + rebuilt))
    # The root group (embeddings, final norm, head: apply_fsdp's last fully_shard) is gathered as forward starts and
    # stays whole, beside the loss too, until backward ends; the step's reshard frees it. (ZeRO-2: in `buffers`.)
    root = (shape.embedding_params() if first else 0) + (shape.final_params(tp) if last else 0)
    terms["_whole_root"] = root * (2 if half else FP32) if fsdp and zero == 3 else 0

    if last:
        # loss.ChunkedCrossEntropy: while the loss runs, the logits, the gradient buffer it fills (fp32 for fp16
        # logits, else the logits' type) and one piece's fp32 copy (exponentiated in place)
        columns = shape.vocab_columns(tp)
        piece = min(micro_tokens, CE_CHUNK_TOKENS) * columns * FP32
        logits = micro_tokens * columns * (2 if half else FP32)
        grad = micro_tokens * columns * (2 if spec.precision == "bf16" else FP32)
        loss = logits + grad + piece
        # ... and the final norm's input, output (its 16-bit copy under autocast) and statistics, which are freed
        # with them, before the first block's backward
        loss += micro_tokens * in_flight * (shape.embed_dim * (FP32 + (2 if half else FP32)) + 2 * FP32)
        if pp > 1:  # the schedule keeps the other in-flight microbatches' logits, each with its gradient buffer
            loss += (in_flight - 1) * (logits + grad)
        terms["loss"] = int(loss)

    buffers = 0
    if dp > 1 and zero == 0 and tp == 1 and pp == 1:
        # DDP's buckets, allocated once. (Composed layouts' OverlappedGradReducer flattens every gradient into
        # buckets too, but only from the end of backward to its finish: beside the gradients, as the optimizer
        # step's temporaries of the same size are, which `_peak`'s step counts.)
        buffers += psi * FP32
    if deepspeed:
        bucket, prefetch = deepspeed_buckets(shape.embed_dim)
        gathered = min(psi, DEEPSPEED_MAX_LIVE_PARAMETERS)  # ZeRO-3's gathers, at most its live parameters
        # the reduce bucket, twice at ZeRO-1/2 (overlap_comm's second buffer; ZeRO-3's reduce works in place)
        buffers += bucket * FP32 * (2 if zero < 3 else 1)
        if zero == 3:
            # Its gathered parameters, and the flat buffer of the coalesced all-gather in flight (up to a prefetch
            # bucket): each parameter is a copy cut from it (partition_parameters.AllGatherCoalescedHandle.wait:
            # torch.cat), the buffer alive beside them while the handle is (measured: bench/planner.py's ZeRO-3
            # under accumulation was 15% over its prediction without it)
            buffers += (gathered + min(gathered, prefetch)) * weight_bytes
    if pp > 1:  # receive buffers for every microbatch: activations (not stage 0), gradients (not the last)
        buffers += ((0 if first else 1) + (0 if last else 1)) * p.microbatches * micro_tokens * shape.embed_dim * \
            message_bytes
    if half and not deepspeed and not fsdp:
        # autocast's 16-bit copies of the matmuls' fp32 weights (FSDP2 gathers its parameters in 16 bits already:
        # autocast has nothing to cast, and the gathers are counted below)
        buffers += layers * shape.matmul_params(tp) * 2 + (shape.embed_dim * shape.vocab_columns(tp) * 2 if last else 0)
    if fsdp:  # whole 16/32-bit parameters gathered for compute: all of them at ZeRO-2, about two blocks at ZeRO-3
        gathered = psi if zero == 2 else 2 * (split // tp + replicated)
        buffers += gathered * (2 if half else FP32)
    terms["buffers"] = int(buffers)
    # Under accumulation or a pipeline, backward starts with the gradients of earlier micro-steps there. Under
    # DeepSpeed's own accumulation ZeRO-1 and ZeRO-2 keep whole gradients in param.grad (the parameters' dtype)
    # through the micro-steps and reduce them into partitions at the boundary (measured: bench/planner.py found
    # ZeRO-1 17% and ZeRO-2 17% over their predictions before this term).
    accumulating = t.gradient_accumulation > 1 or pp > 1
    whole_in_backward = deepspeed and zero in (1, 2) and t.gradient_accumulation > 1
    terms["_grads_in_backward"] = (max(terms["grads"], psi * weight_bytes) if whole_in_backward else
                                   terms["grads"] if accumulating else 0)
    terms["_step_temporaries"] = (psi // (dp if zero >= 1 else 1)) * FP32
    return terms


def _peak(terms: dict[str, int], pipelined: bool) -> int:
    """Backward starts with the loss's buffers alive and then rebuilds and differentiates one block at a time:
    whichever is larger sets its peak, both at once in a pipeline, where one microbatch's backward overlaps the
    next one's loss."""
    states = terms["params"] + terms["optimizer"]
    loss, block = terms.get("loss", 0), terms["_block_backward"]
    working = loss + block if pipelined else max(loss, block)
    backward = states + terms["activations"] + working + terms["buffers"] + terms["_grads_in_backward"] + \
        terms["_whole_root"]
    step = states + terms["grads"] + terms["buffers"] + terms["_step_temporaries"]
    return max(backward, step)


@dataclass(frozen=True)
class Headroom:
    """What of a device's memory the model's peak may use: the device less `reserve_bytes` (the CUDA context and
    kernels, about 0.5-1 GiB on H100-class GPUs; NCCL's buffers, NCCL_BUFFSIZE's 4 MiB per channel and peer; cuBLAS
    and cuDNN workspaces), less `fragmentation` of the rest (memory the caching allocator holds but cannot hand
    out). spec.resources.gpuMemoryReserve and gpuMemoryFragmentation; the platform's jobDefaults may set both."""

    reserve_bytes: int
    fragmentation: float

    @classmethod
    def of(cls, spec) -> Headroom:
        return cls(parse_bytes(spec.resources.gpu_memory_reserve), spec.resources.gpu_memory_fragmentation)

    def usable(self, device_bytes: int) -> int:
        return max(0, int((device_bytes - self.reserve_bytes) * (1 - self.fragmentation)))

    def describe(self, device_bytes: int) -> str:
        return (f"{human(self.usable(device_bytes))} usable of {human(device_bytes)}: {human(self.reserve_bytes)} "
                f"reserved (gpuMemoryReserve), then {self.fragmentation:.0%} for fragmentation "
                "(gpuMemoryFragmentation)")


def memory_problem(spec, vocab_size: int, limit: int | None = None) -> str | None:
    """Why the job does not fit `limit` bytes per device (default: spec.resources.gpuMemory) less the spec's
    headroom, naming the rank and its biggest term; None if it fits or no limit is set."""
    limit = limit if limit is not None else (parse_bytes(spec.resources.gpu_memory) if spec.resources.gpu_memory
                                             else None)
    return None if limit is None else fit_problem(predict(spec, vocab_size), limit, Headroom.of(spec))


def fit_problem(ranks: list[RankMemory], device_bytes: int, headroom: Headroom) -> str | None:
    """Why `ranks` (predict's) do not fit what `headroom` leaves usable of `device_bytes` per device, naming the
    worst rank and its biggest term."""
    usable = headroom.usable(device_bytes)
    over = [r for r in ranks if r.peak_bytes > usable]
    if not over:
        return None
    worst = max(over, key=lambda r: r.peak_bytes)
    term, size = worst.biggest()
    return (f"rank {worst.rank} is predicted to need {human(worst.peak_bytes)} of device memory, more than the "
            f"{headroom.describe(device_bytes)}; its biggest term is {term} ({human(size)}). `paratrain validate "
            "--memory` shows every term; more tensor or pipeline parallelism, ZeRO, activation checkpointing or "
            "smaller micro-steps (gradientAccumulation) shrink them")


def stop_save_seconds(spec, vocab_size: int, bytes_per_second: int) -> tuple[float, float]:
    """(seconds, bytes per node) a stopped gang is estimated to need to save its step: the checkpoint is spread
    over the nodes (DCP writes each tensor once and balances replicated ones over the ranks), each node writing
    and then hashing its share at `bytes_per_second`."""
    per_node = CHECKPOINT_BYTES_PER_PARAMETER * parameter_count(spec.model, vocab_size) / spec.nodes
    return SAVE_FIXED_SECONDS + per_node / bytes_per_second, per_node
