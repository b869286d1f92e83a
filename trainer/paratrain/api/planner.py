"""The layout planner: every legal layout of a job's model, batch and gang on an accelerator, each predicted for
memory (memory.largest_peak) and step time (`step_time`), the fastest that fits chosen, the rest ranked and every
rejection counted. `paratrain validate --explain` prints it (no torch; a 1,024-GPU search takes well under a
second).

A layout is data x tensor x pipeline degrees, the ZeRO stage, the pipeline schedule and microbatches, activation
checkpointing and gradient accumulation; the global batch (training.batchSize x blockSize tokens) stays fixed.
Tensor parallel stays within a node, or spans whole nodes of one NVLink fabric where the job is placed by its
domains (`nvlink_ranks`: a GB200 NVL72's 72 GPUs); the mesh is (pipeline, data, tensor), tensor innermost
(ParallelDims; rankOrder tp-dp-pp), or (data, pipeline, tensor) under tp-pp-dp, which a layout gets where it is
predicted faster by more than TIE; so a data-parallel or pipeline group leaves NVLink once it spans more ranks than
a node (or that fabric) has, and a topology domain (`domain_ranks`: ranksPerDomain, else the most ranks a domain of
the level holds by the nodes' labels) once it spans more than that, at the cross-domain bandwidth (the spine's: the
platform's planner.crossDomainBandwidth, else half the network's). Within 10% of the fastest
layout the simplest wins (fewer parallel dimensions, no pipeline, a lower ZeRO stage, less recompute): the time
model is not calibrated on a GPU yet, and the simpler plan costs less to get wrong.

The time model, per step and rank (docs/trainer.md, "Planner"): compute at the accelerator's measured compute
efficiency (the platform's planner.computeEfficiency), else COMPUTE_EFFICIENCY, of its peak for the precision, full
activation checkpointing adding a forward (x4/3), selective a few %; the pipeline bubble (p-1)/m of the compute;
tensor parallel's 4 all-reduces a layer and microbatch of its activations (6 with full recompute), ring volume
2(t-1)/t; pipeline sends of the activations and their gradients; data parallel's gradient reduction (fp32,
2(d-1)/d of the stage's shard; ZeRO-3 1.5x), exposed where it outlasts backward, and ZeRO-1/2's all-gather half
after DeepSpeed's step (composed ZeRO-1: where it outlasts the next forward); links at COMMUNICATION_EFFICIENCY;
AdamW's update, OPTIMIZER_BYTES_PER_PARAMETER of the parameters the rank steps (ZeRO: its 1/d) at the memory's
bandwidth; and each collective and pipeline send a fixed cost (Accelerator.collective_seconds, send_seconds: the α
of an α-β model) times how many a rank launches (`data_collectives`; tensor parallel's a layer and pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import product

from .hardware import CPU, NVLINK_DOMAIN_LABELS, Accelerator
from .memory import (CE_CHUNK_TOKENS, DDP_BUCKET_BYTES, DEEPSPEED_MAX_LIVE_PARAMETERS, Headroom, deepspeed_buckets,
                     human, largest_peak, parse_bytes)
from .shapes import parameter_count
from .spec import (DEFAULT_MEMORY_HEADROOM, PINNABLE, PLANNER_MODES, RANK_ORDERS, Spec, cross_field_problems,
                   stated_vocab_size)

# of the peak FLOP/s a step's matmuls reach: an uncalibrated prior (MFU of 35-50%), where the accelerator carries no
# measured one (Accelerator.compute_efficiency: the platform's planner.computeEfficiency)
COMPUTE_EFFICIENCY = 0.4
SELECTIVE_RECOMPUTE = 0.03  # selective AC recomputes the cheap ops (norms, activations): a few % of the compute
COMMUNICATION_EFFICIENCY = 0.7  # of a link's bandwidth a ring collective reaches
OPTIMIZER_BYTES_PER_PARAMETER = 32  # AdamW's step: reads weight, gradient, two moments; writes three; the norm
# Within this of the fastest, the simplest layout wins: how far apart two layouts' predicted steps must be for the
# ranking to be trusted over simplicity. bench/planner.py measured the time model's relative errors between layouts
# at 10-30% on CPU; a choice within 10% of the fastest is the planner's own target.
TIE = 0.10
MEMORY_BAND = 0.15  # the memory model's error, held by tests/trainer/test_memory_model.py
TIME_BAND = 0.5  # the time model's: uncalibrated until a GPU run measures it
AC_MODES = ("none", "selective", "full")
MODES = PLANNER_MODES


@dataclass(frozen=True)
class Candidate:
    """A layout, what it changes of the spec, and its predictions."""

    spec: Spec
    peak_bytes: int
    time: dict[str, float]  # the step time's parts, and "total"

    @property
    def step_seconds(self) -> float:
        return self.time["total"]

    def describe(self) -> str:
        p, t = self.spec.parallelism, self.spec.training
        pipe = f", {p.pipeline_schedule} with {p.microbatches} microbatches" if p.pipeline > 1 else ""
        zero = f", ZeRO-{p.zero_stage}" if p.zero_stage else ""
        ac = f", {t.activation_checkpointing} activation checkpointing" if t.activation_checkpointing != "none" \
            else ""
        acc = f", {t.gradient_accumulation} micro-steps" if t.gradient_accumulation > 1 else ""
        order = ", ranks tp-pp-dp" if p.replicas_outermost else ""
        nodes = f" on {self.spec.nodes} node(s)" if self.spec.nodes else ""
        return f"data {p.data} x tensor {p.tensor} x pipeline {p.pipeline}{pipe}{zero}{ac}{acc}{order}{nodes}"

    def simplicity(self) -> tuple:
        p, t = self.spec.parallelism, self.spec.training
        return (sum(d > 1 for d in (p.data, p.tensor, p.pipeline)), p.pipeline > 1, p.zero_stage,
                AC_MODES.index(t.activation_checkpointing), t.gradient_accumulation, p.tensor)

    def layout(self) -> dict[str, object]:
        """The layout's fields by their spec names (status.plan keeps them; with_layout applies them)."""
        return {k.rsplit(".", 1)[1]: v for k, v in self.overrides().items()}

    def overrides(self) -> dict[str, object]:
        """The spec fields the plan sets, as `--set` paths take them."""
        p, t = self.spec.parallelism, self.spec.training
        return {"spec.nodes": self.spec.nodes, "spec.parallelism.data": p.data, "spec.parallelism.tensor": p.tensor,
                "spec.parallelism.pipeline": p.pipeline, "spec.parallelism.zeroStage": p.zero_stage,
                "spec.parallelism.pipelineSchedule": p.pipeline_schedule,
                "spec.parallelism.microbatches": p.microbatches, "spec.parallelism.rankOrder": p.rank_order,
                "spec.training.activationCheckpointing": t.activation_checkpointing,
                "spec.training.gradientAccumulation": t.gradient_accumulation}


@dataclass
class Rejection:
    count: int = 0
    example: str = ""


@dataclass
class Plan:
    accelerator: Accelerator
    memory_budget: int | None  # bytes a rank's predicted peak may use; None: not judged
    objective: str
    node_counts: tuple[int, ...] = ()
    considered: int = 0
    feasible: list[Candidate] = field(default_factory=list)  # ranked, the chosen first
    rejected: dict[str, Rejection] = field(default_factory=dict)
    own: Candidate | None = None  # the job's own layout, where legal and within the budget
    own_problem: str = ""  # else why not
    oversubscription: float = 1.0  # step_time's

    @property
    def chosen(self) -> Candidate | None:
        return self.feasible[0] if self.feasible else None

    def reject(self, reason: str, example: str) -> None:
        entry = self.rejected.setdefault(reason, Rejection())
        entry.count += 1
        entry.example = entry.example or example


def step_time(spec: Spec, vocab_size: int, gpu: Accelerator, gpus_per_node: int,
              oversubscription: float = 1.0) -> dict[str, float]:
    """Seconds per step, by part, for the spec's layout (see the module docstring). `oversubscription`: the threads
    the ranks run per core they share, where over 1 (more local ranks than cores): the ranks then compute in turn,
    their busy time stretched by it, and a rank idle in a pipeline bubble lends its core to the others where some
    are busy."""
    p, t, m = spec.parallelism, spec.training, spec.model
    world, tokens = spec.world_size, t.batch_size * m.block_size
    act = 2 if spec.precision in ("bf16", "fp16") else 4
    tables = vocab_size * m.embed_dim + (m.block_size * m.embed_dim if m.family == "gpt" else 0)
    matmul_params = parameter_count(m, vocab_size) - tables
    flops = tokens * (6 * matmul_params + 12 * m.layers * m.embed_dim * m.block_size)
    if t.activation_checkpointing == "full":
        flops *= 4 / 3  # the forward again
    elif t.activation_checkpointing == "selective":
        flops *= 1 + SELECTIVE_RECOMPUTE
    compute = flops / (world * gpu.flops(spec.precision, spec.tf32) * (gpu.compute_efficiency or COMPUTE_EFFICIENCY))
    shared = max(1.0, oversubscription)
    slots = pipeline_slots(p.microbatches, p.pipeline, shared)
    compute, bubble = compute * shared, compute * (slots / p.microbatches - shared)

    nvlink, domain = nvlink_ranks(spec, gpu, gpus_per_node), domain_ranks(spec, gpu)

    def link(span: int) -> float:  # a group of `span` consecutive ranks: on NVLink, within a domain, or across
        bw = gpu.node_bytes_per_second if span <= nvlink else gpu.network_bytes_per_second \
            if not domain or span <= domain else min(gpu.network_bytes_per_second, gpu.cross_domain)
        return bw * COMMUNICATION_EFFICIENCY

    rank_tokens = tokens / p.data
    stage_layers = m.layers / p.pipeline
    passes = p.microbatches * t.gradient_accumulation  # forwards and backwards a rank runs a step
    tensor = 0.0
    if p.tensor > 1:
        all_reduces = 6 if t.activation_checkpointing == "full" else 4
        volume = all_reduces * stage_layers * rank_tokens * m.embed_dim * act * 2 * (p.tensor - 1) / p.tensor
        # and each all-reduce's fixed cost, with the vocabulary-parallel loss's two a piece (on the last stage)
        loss = 2 * math.ceil(rank_tokens / passes / CE_CHUNK_TOKENS)
        tensor = volume / link(p.tensor) + (all_reduces * stage_layers + loss) * passes * gpu.collective_seconds
    # consecutive ranks a group spans: under tp-pp-dp a replica's stages are adjacent and replicas farthest apart
    pipeline_span, data_span = (p.pipeline * p.tensor, world) if p.replicas_outermost else \
        (world, p.data * p.tensor)
    pipeline = 2 * rank_tokens * m.embed_dim * act / link(pipeline_span) + 2 * passes * gpu.send_seconds \
        if p.pipeline > 1 else 0.0
    data = 0.0
    if p.data > 1:
        shard = parameter_count(m, vocab_size) / (p.tensor * p.pipeline)
        # one reduce-scatter or all-gather of the shard's elements, per byte of each: n(N-1)/N on a ring
        ring = shard * (p.data - 1) / p.data / link(data_span)
        grads = 4 if spec.reduce_precision == "fp32" else 2  # spec.reducePrecision
        # the weights ZeRO gathers: DeepSpeed's and FSDP2's in the training dtype, composed ZeRO-1's fp32 masters
        weights = 4 if spec.precision == "fp32" or p.zero_stage == 1 and not p.on_deepspeed else 2
        # An all-reduce (DDP, the composed reducer) is a reduce-scatter and an all-gather of the gradients.
        # DeepSpeed's ZeRO-1/2 all-reduce each bucket whole and keep their partition (use_multi_rank_bucket_allreduce,
        # bench/communication.py's 1.5x), then gather the updated weights in its step, exposed. Composed ZeRO-1
        # reduce-scatters in backward and overlaps its gather with the next forward
        # (zero1.ZeroOneOptimizer.gather_in_forward); FSDP2 gathers within the passes (ZeRO-3: its parameters twice,
        # for forward and again for backward; DeepSpeed's ZeRO-3 is priced alike).
        if p.zero_stage in (1, 2) and p.on_deepspeed:
            reduce, gather = 2 * grads * ring, weights * ring
        elif p.zero_stage == 1:
            reduce, gather = grads * ring, max(0.0, weights * ring - compute / 3)
        elif p.zero_stage == 0:
            reduce, gather = 2 * grads * ring, 0.0
        else:
            reduce, gather = (grads + weights * (p.zero_stage - 1)) * ring, 0.0
        data = max(0.2 * reduce, reduce - compute * 2 / 3) + gather  # backward hides all but its last bucket
        # their fixed costs exposed: microseconds each on a GPU; on shared CPU cores measured not hidden
        data += data_collectives(spec, shard, passes) * gpu.collective_seconds
    # AdamW's update streams each parameter it steps (weights, gradient, two moments read; three written; the
    # gradient again for the norm): ZeRO shards the update over the data-parallel ranks.
    updated = parameter_count(m, vocab_size) / (p.tensor * p.pipeline) / (p.data if p.zero_stage else 1)
    optimizer = updated * OPTIMIZER_BYTES_PER_PARAMETER / gpu.memory_bytes_per_second
    if oversubscription > 1:  # gloo's copies and reductions and the update are the shared cores' work too
        tensor, pipeline, data, optimizer = (x * oversubscription for x in (tensor, pipeline, data, optimizer))
    total = compute + bubble + tensor + pipeline + data + optimizer
    return {"compute": compute, "bubble": bubble, "tensor": tensor, "pipeline": pipeline, "data": data,
            "optimizer": optimizer, "total": total}


def pipeline_slots(m: int, p: int, shared: float) -> float:
    """A step's length in one microbatch's time on one stage: m microbatches pass p stages in m + p - 1 slots, a(s)
    stages busy in slot s (1, 2, .. up to min(m, p), held, and down again). Where ranks share cores (`shared` threads
    a core when all are busy) a slot stretches as its busy ranks, a(s)/p of them, outnumber the cores: m + p - 1
    where nothing is shared (the bubble (p-1)/m), m x shared where nothing is pipelined (every rank's turn), and
    between the two the filling and draining slots that leave cores idle."""
    k, q = shared / p, min(m, p)

    def stretched(a: int) -> float:  # the sum of max(1, a' k) over a' = 1..a
        below = min(a, int(1 / k))  # these fit the cores
        return below + k * (a * (a + 1) - below * (below + 1)) / 2
    return 2 * stretched(q - 1) + (m + p - 2 * q + 1) * max(1.0, q * k)


def data_collectives(spec: Spec, shard: float, passes: int) -> int:
    """The data-parallel collectives a rank launches a step, each paying Accelerator.collective_seconds, as
    bench/communication.py's recorder counts them (llama 4 x 128, 2026-12-07). Torch's engines reduce once a schedule
    run (no_sync over the micro-steps; a pipeline's stage once a run): DDP and the composed reducer a 25 MiB bucket,
    composed ZeRO-1 a reduce-scatter a bucket and a gather of the updated shards, FSDP2 a reduce-scatter a unit (a
    block, and the root); FSDP2's ZeRO-3 gathers 2 units short of twice the units in every pass (the root and the
    last block stay whole for backward), its ZeRO-2 each unit once a pass (under a pipeline once a run: kept
    gathered for backward). DeepSpeed reduces a reduce bucket (ZeRO-1 at the accumulation boundary, ZeRO-2 and 3
    every micro-step) and ZeRO-1/2 gather a parameter group (two: decayed and not) in the step; ZeRO-3 gathers its
    prefetch bucket's worth of parameters together in forward (again in backward only past its reuse distance) and
    each norm's weight on its own, every pass."""
    p, t, m = spec.parallelism, spec.training, spec.model
    stage_layers = m.layers / p.pipeline
    runs = t.gradient_accumulation if p.pipeline > 1 else 1
    if p.on_deepspeed:
        reduce_bucket, prefetch_bucket = deepspeed_buckets(m.embed_dim)
        reductions = math.ceil(shard / reduce_bucket) * (1 if p.zero_stage == 1 else t.gradient_accumulation)
        if p.zero_stage < 3:
            return reductions + 2
        coalesced = math.ceil(shard / prefetch_bucket) * (2 if shard > DEEPSPEED_MAX_LIVE_PARAMETERS else 1)
        return reductions + (coalesced + round(2 * stage_layers) + 1) * passes
    units = math.ceil(stage_layers) + 1
    if p.zero_stage == 3:
        return units * runs + 2 * math.ceil(stage_layers) * passes
    if p.zero_stage == 2:
        return units * runs + units * (runs if p.pipeline > 1 else passes)
    buckets = math.ceil(shard * 4 / DDP_BUCKET_BYTES)
    return buckets * runs + (buckets if p.zero_stage == 1 else 0)


def nvlink_ranks(spec: Spec, gpu: Accelerator, gpus_per_node: int) -> int:
    """Consecutive ranks one NVLink fabric joins: a node's; where the GPU's fabric spans nodes (Accelerator.nvlink_gpus,
    e.g. a GB200 NVL72) and the job is placed by an NVLink-domain label (spec.scheduling.topology, required), each
    group of ranksPerDomain ranks, else the whole gang, up to the domain's size."""
    topology = spec.scheduling.topology
    if (gpu.nvlink_gpus > gpus_per_node and topology and topology.mode == "required"
            and topology.level in NVLINK_DOMAIN_LABELS):
        return max(gpus_per_node, min(gpu.nvlink_gpus, topology.ranks_per_domain or spec.world_size))
    return gpus_per_node


def domain_ranks(spec: Spec, gpu: Accelerator) -> int | None:
    """Consecutive ranks kept in one domain of spec.scheduling.topology.level, where a group spanning more crosses
    the spine: ranksPerDomain, else the most a domain holds (Accelerator.domain_gpus, from the nodes' labels); None
    where nothing says (no topology, or an NVLink-domain level, whose outside is the network itself)."""
    topology = spec.scheduling.topology
    if topology is None or topology.level in NVLINK_DOMAIN_LABELS:
        return None
    return topology.ranks_per_domain or gpu.domain_gpus or None


def cross_domain_seconds(spec: Spec, vocab_size: int, gpu: Accelerator, gpus_per_node: int,
                         cross_domain_bytes_per_second: float) -> tuple[float, float]:
    """(seconds a step, seconds more a step) where the gang's inter-node traffic crosses topology domains at
    `cross_domain_bytes_per_second`: a ring runs at its slowest hop, and every rank waits for every ring each step,
    so one group split across domains slows the step as if all its inter-node links were that slow."""
    base = step_time(spec, vocab_size, gpu, gpus_per_node)["total"]
    slow = step_time(spec, vocab_size, replace(gpu, network_bytes_per_second=min(
        gpu.network_bytes_per_second, cross_domain_bytes_per_second)), gpus_per_node)["total"]
    return base, max(0.0, slow - base)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(spec: Spec, vocab_size: int, gpu: Accelerator, memory_budget: int | None, device: str,
         node_counts: list[int], objective: str = "throughput", allow: tuple[str, ...] = MODES,
         pin: tuple[str, ...] = (), oversubscription: float = 1.0) -> Plan:
    """Every layout of `spec`'s model and batch over `node_counts` nodes of spec.procsPerNode ranks each,
    judged by the spec's own rules (cross_field_problems, as `validate` and the CRD's CEL judge a job) and by
    `memory_budget`, ranked by `objective`: throughput (the shortest step) or minGPUs (the fewest nodes that fit,
    then the shortest step: node counts are searched from the fewest up, and the search ends at the first that has
    a feasible layout). `allow`: the modes it may use (MODES); `pin`: the fields it keeps as the spec has them
    (PINNABLE)."""
    result = Plan(gpu, memory_budget, objective, tuple(node_counts), oversubscription=oversubscription)
    par, train = spec.parallelism, spec.training
    procs, layers = spec.procs_per_node, spec.model.layers
    kept = {name: getattr(par, _attr(name), None) if name not in ("activationCheckpointing", "gradientAccumulation")
            else getattr(train, _attr(name)) for name in pin}

    def options(name: str, allowed: bool, values: list) -> list:
        if name in kept:
            if kept[name] in values:
                return [kept[name]]
            result.reject(f"--pin {name}: the job's value cannot be used here",
                          f"{name} {kept[name]}, where {', '.join(map(str, values))} could")
            return []
        return values if allowed else values[:1]

    for nodes in sorted(node_counts):
        if objective == "minGPUs" and result.feasible:
            break
        world = nodes * procs
        # tensor parallel within a node, or over whole nodes of one NVLink fabric
        nvlink = nvlink_ranks(spec.model_copy(update={"nodes": nodes}), gpu, procs)
        tensors = [d for d in _divisors(world) if d <= procs or (d % procs == 0 and d <= nvlink)]
        for tp in options("tensor", "tensor" in allow, tensors):
            for pp in options("pipeline", "pipeline" in allow, [d for d in _divisors(world // tp) if d <= layers]):
                dp = world // (tp * pp)
                if "data" in kept and kept["data"] != dp:
                    continue
                if dp > 1 and "data" not in allow:
                    result.reject("data parallel not allowed", f"data {dp} x tensor {tp} x pipeline {pp}")
                    continue
                zeros = options("zeroStage", "zero" in allow, [0, 1, 2, 3] if dp > 1 else [0])
                schedules = options("pipelineSchedule", True, ["1F1B", "GPipe"] if pp > 1 else [par.pipeline_schedule])
                micro = options("microbatches", True, [pp * k for k in (1, 2, 4, 8)] if pp > 1 else [1])
                acs = options("activationCheckpointing", "activationCheckpointing" in allow, list(AC_MODES))
                # both orders lay out the same mesh unless data and pipeline are both above 1
                orders = options("rankOrder", True, list(RANK_ORDERS)) if dp > 1 and pp > 1 else \
                    [kept.get("rankOrder", RANK_ORDERS[0])]
                for zero, schedule, m, ac in product(zeros, schedules, micro, acs):
                    _fit_accumulation(spec, vocab_size, gpu, device, result, nodes, dp, tp, pp, zero, schedule, m,
                                      ac, options("gradientAccumulation", "gradientAccumulation" in allow,
                                                  [1, 2, 4, 8, 16, 32]), orders)
    _rank(result)
    _judge_own(spec, vocab_size, gpu, device, result)
    return result


@dataclass(frozen=True)
class Target:
    """What a job is planned for: its ranks' accelerator (hardware.CPU for CPU pods and local runs), the device
    memory a rank has where known better than the catalogue (a GPU Feature Discovery label), and where both came
    from, in words."""

    accelerator: Accelerator
    source: str
    memory_bytes: int | None = None
    oversubscription: float = 1.0  # step_time's: a local run of more ranks' threads than the machine has cores

    @property
    def device(self) -> str:
        return "cpu" if self.accelerator is CPU else "cuda"


class NoPlan(ValueError):
    """No layout of the job's model and batch is feasible on its target: the message names the rejections."""


def memory_budget(spec: Spec, target: Target, headroom: float) -> int | None:
    """The bytes a rank's predicted peak may use: a GPU's memory (spec.resources.gpuMemory, else the target's) less
    the spec's reserve and fragmentation (memory.Headroom), less `headroom` of the rest; CPU ranks share their pod's
    memory (spec.resources.memory; unset: not judged, None)."""
    keep = 1 - headroom
    if target.accelerator is CPU:
        memory = spec.resources.memory
        return int(parse_bytes(memory) / spec.procs_per_node * keep) if memory else None
    device = parse_bytes(spec.resources.gpu_memory) if spec.resources.gpu_memory else \
        target.memory_bytes or target.accelerator.memory_bytes
    return int(Headroom.of(spec).usable(device) * keep)


def plan_job(spec: Spec, vocab_size: int, target: Target, nodes: int | None = None, objective: str | None = None,
             allow: tuple[str, ...] | None = None, pin: tuple[str, ...] | None = None,
             headroom: float | None = None) -> Plan:
    """`plan` for a job as `paratrain validate`, `paratrain run` and the operator plan it: the settings a mode
    auto spec gives (parallelism.objective, allow, pin, memoryHeadroom), each overridden where given here (the CLI's
    flags), over `nodes` nodes (default spec.nodes; objective minGPUs: 1 to that many)."""
    p = spec.parallelism
    auto = p.mode == "auto"
    objective = objective or (p.objective if auto else None) or "throughput"
    allow = allow if allow is not None else tuple(p.allow) if auto and p.allow is not None else MODES
    pin = pin if pin is not None else tuple(p.pin or ()) if auto else ()
    headroom = headroom if headroom is not None else \
        p.memory_headroom if auto and p.memory_headroom is not None else DEFAULT_MEMORY_HEADROOM
    most = nodes or spec.nodes
    counts = list(range(1, most + 1)) if objective == "minGPUs" else [most]
    return plan(spec, vocab_size, target.accelerator, memory_budget(spec, target, headroom), target.device, counts,
                objective, allow, pin, target.oversubscription)


def planned(spec: Spec, vocab_size: int, target: Target) -> tuple[Spec, Plan]:
    """A mode auto spec's chosen layout, as a manual spec (what the ranks run), and the plan; NoPlan where nothing
    is feasible."""
    result = plan_job(spec, vocab_size, target)
    if result.chosen is None:
        raise NoPlan(no_plan_message(result, target))
    return result.chosen.spec, result


def stated_vocab(spec: Spec) -> int:
    """The vocabulary a plan sizes the embedding by, where the data is not read (the operator, `paratrain
    render`): spec.data.vocabSize, or a synthetic source's model.vocabSize; NoPlan where neither says it."""
    vocab = stated_vocab_size(spec)
    if vocab is None:
        raise NoPlan(f"mode auto sizes the model's embedding by its vocabulary, which is read from the "
                     f"{spec.data.source} data only by the ranks: give spec.data.vocabSize")
    return vocab


def no_plan_message(result: Plan, target: Target) -> str:
    budget = (f"{human(result.memory_budget)} a rank" if result.memory_budget is not None else "no memory limit")
    worst = sorted(result.rejected.items(), key=lambda kv: -kv[1].count)[:3]
    why = "; ".join(f"{r.count} by {reason} (e.g. {r.example})" for reason, r in worst)
    return (f"no layout fits on {target.source} ({result.accelerator.name}, {budget}): of {result.considered} "
            f"considered, {why}. `paratrain validate --explain` shows the search; more nodes, a smaller model or "
            "batch, or a smaller memoryHeadroom may fit")


def with_layout(spec: Spec, layout: dict) -> Spec:
    """`spec` with a recorded plan's layout (status.plan's fields, as Candidate.layout gives them): the same
    manual spec the plan chose, for a gang whose pods already run it."""
    return _layout(spec, layout["nodes"], layout["data"], layout["tensor"], layout["pipeline"], layout["zeroStage"],
                   layout["pipelineSchedule"], layout["microbatches"], layout["activationCheckpointing"],
                   layout["gradientAccumulation"], layout.get("rankOrder", RANK_ORDERS[0]))


def _attr(name: str) -> str:
    return {"zeroStage": "zero_stage", "pipelineSchedule": "pipeline_schedule", "rankOrder": "rank_order",
            "activationCheckpointing": "activation_checkpointing",
            "gradientAccumulation": "gradient_accumulation"}.get(name, name)


def _layout(spec: Spec, nodes: int, dp: int, tp: int, pp: int, zero: int, schedule: str, m: int, ac: str,
            accumulation: int, order: str = RANK_ORDERS[0]) -> Spec:
    """The spec with this layout, as a manual one (not validated: cross_field_problems judges it; copies are
    cheap)."""
    par = spec.parallelism.model_copy(update={"mode": "manual", "objective": None, "pin": None, "allow": None,
                                              "memory_headroom": None, "data": dp, "tensor": tp, "pipeline": pp,
                                              "zero_stage": zero, "pipeline_schedule": schedule, "microbatches": m,
                                              "rank_order": order})
    train = spec.training.model_copy(update={"activation_checkpointing": ac, "gradient_accumulation": accumulation})
    return spec.model_copy(update={"nodes": nodes, "parallelism": par, "training": train})


def _fit_accumulation(spec, vocab_size, gpu, device, result: Plan, nodes, dp, tp, pp, zero, schedule, m, ac,
                      accumulations: list[int], orders: list[str]) -> None:
    """The layout with the fewest micro-steps that passes the spec's rules and fits: more micro-steps only trade
    speed for memory. Each layout tried counts once, as rejected or feasible. Its rank order (`orders`: which it
    may use, the spec's default first) changes which links a group crosses, not memory: the first unless another
    is predicted faster by more than TIE."""
    for accumulation in accumulations:
        candidate = _layout(spec, nodes, dp, tp, pp, zero, schedule, m, ac, accumulation, orders[0])
        result.considered += 1
        if problems := cross_field_problems(candidate):
            path, message = problems[0]
            result.reject(f"{path}: the spec's rules", message)
            continue
        peak = largest_peak(candidate, vocab_size, device)
        if result.memory_budget is not None and peak > result.memory_budget:
            result.reject("memory: the predicted peak exceeds the budget",
                          f"{Candidate(candidate, peak, {}).describe()} needs {peak / 2**30:.1f} GiB")
            continue
        timed = [(step_time(c, vocab_size, gpu, spec.procs_per_node, result.oversubscription), c) for c in
                 [candidate, *(_layout(spec, nodes, dp, tp, pp, zero, schedule, m, ac, accumulation, order)
                               for order in orders[1:])]]
        timing, chosen = min(timed, key=lambda tc: tc[0]["total"] * (1 if tc[1] is candidate else 1 + TIE))
        result.feasible.append(Candidate(chosen, peak, timing))
        return


def _rank(result: Plan) -> None:
    """Ranked by the objective; the first within TIE of the best by simplicity."""
    if not result.feasible:
        return
    if result.objective == "minGPUs":
        fewest = min(c.spec.nodes for c in result.feasible)
        result.feasible = [c for c in result.feasible if c.spec.nodes == fewest] + \
            [c for c in result.feasible if c.spec.nodes != fewest]
        pool = [c for c in result.feasible if c.spec.nodes == fewest]
    else:
        pool = result.feasible
    best = min(c.step_seconds for c in pool)
    chosen = min((c for c in pool if c.step_seconds <= best * (1 + TIE)), key=lambda c: (c.simplicity(),
                                                                                         c.step_seconds))
    rest = sorted((c for c in result.feasible if c is not chosen),
                  key=lambda c: (c.spec.nodes if result.objective == "minGPUs" else 0, c.step_seconds))
    result.feasible = [chosen, *rest]


def _judge_own(spec: Spec, vocab_size: int, gpu: Accelerator, device: str, result: Plan) -> None:
    """The job's own layout, judged the same way: its rank among the feasible, or why it is not (under mode auto
    it has none)."""
    if spec.parallelism.mode == "auto":
        return
    if problems := cross_field_problems(spec):
        result.own_problem = f"{problems[0][0]}: {problems[0][1]}"
        return
    peak = largest_peak(spec, vocab_size, device)
    if result.memory_budget is not None and peak > result.memory_budget:
        result.own_problem = f"its predicted peak, {peak / 2**30:.1f} GiB, exceeds the budget"
        return
    result.own = Candidate(spec, peak, step_time(spec, vocab_size, gpu, spec.procs_per_node,
                                                 result.oversubscription))


def _seconds(s: float) -> str:
    return f"{s:.3g} s"


def explain(result: Plan, job_spec: Spec, tokens_per_step: int, alternatives: int = 3) -> list[str]:
    """`paratrain validate --explain`'s lines: the plan, its predictions with their bands and parts, the next best
    layouts and what each loses by, the job's own layout, and the rejections with an example each."""
    gpu, chosen = result.accelerator, result.chosen
    budget = (f"budget {result.memory_budget / 2**30:.1f} GiB a rank" if result.memory_budget is not None
              else "memory not judged (no device memory known)")
    out = [f"plan on {gpu.name} (objective {result.objective}; the global batch, {tokens_per_step:,} tokens a step, "
           f"kept): {result.considered} layouts considered, {len(result.feasible)} feasible; {budget}"]
    if chosen is None:
        out.append("  no layout is feasible: see the rejections below")
    else:
        out += [f"  chosen: {chosen.describe()}", *_predicted(chosen, tokens_per_step, gpu)]
        if job_spec.parallelism.mode == "manual":
            own = Candidate(job_spec, 0, {}).overrides()
            changed = [f"--set {k}={v}" for k, v in chosen.overrides().items() if own[k] != v]
            out.append(f"    as the job's own: {' '.join(changed)}" if changed else "    the job's own layout")
        for i, alt in enumerate(result.feasible[1:alternatives + 1], 2):
            out.append(f"  {i}. {alt.describe()}: {_loses(alt, chosen, result.objective)}")
    if job_spec.parallelism.mode == "manual":
        out.append(_own_line(result))
    for reason, rejection in sorted(result.rejected.items(), key=lambda kv: -kv[1].count):
        out.append(f"  rejected {rejection.count}: {reason}; e.g. {rejection.example}")
    return out


def _own_line(result: Plan) -> str:
    """Where a manual job's own layout stands: ranked, not planned here, or why it is not feasible."""
    own, chosen = result.own, result.chosen
    if own is None:
        return f"  this job's own layout: not feasible: {result.own_problem}"
    if own.spec.nodes not in result.node_counts:
        return (f"  this job's own layout ({own.describe()}), not planned here: "
                f"peak memory {own.peak_bytes / 2**30:.2f} GiB a rank, step {_seconds(own.step_seconds)}")
    rank = next((i for i, c in enumerate(result.feasible, 1) if c.overrides() == own.overrides()), None)
    where = (f"ranked {rank} of {len(result.feasible)}" if rank else
             "feasible, not ranked (each layout is ranked with the fewest micro-steps that fit)")
    return (f"  this job's own layout ({own.describe()}): {where}, "
            f"{_loses(own, chosen, result.objective) if chosen else ''}".rstrip(", "))


def _predicted(c: Candidate, tokens_per_step: int, gpu: Accelerator) -> list[str]:
    parts = ", ".join(f"{name} {_seconds(c.time[name])}" for name in ("compute", "bubble", "tensor", "pipeline",
                                                                         "data", "optimizer") if c.time[name])
    calibration = (f"compute at the measured {gpu.compute_efficiency:.0%} of peak (the platform's "
                   "planner.computeEfficiency), the links not measured" if gpu.compute_efficiency else
                   f"the time model is not calibrated on a GPU yet: compute at {COMPUTE_EFFICIENCY:.0%} of peak")
    return [f"    peak memory {c.peak_bytes / 2**30:.2f} GiB a rank (±{MEMORY_BAND:.0%}, the memory model's tested "
            "error)",
            f"    step {_seconds(c.step_seconds)} (±{TIME_BAND:.0%}: {calibration}), "
            f"{tokens_per_step / c.step_seconds:,.0f} tokens/s: {parts}"]


def _loses(alt: Candidate, chosen: Candidate, objective: str) -> str:
    """Why `alt` was not chosen: more nodes, a longer step (and where the time goes), or, within TIE, simplicity."""
    if objective == "minGPUs" and alt.spec.nodes > chosen.spec.nodes:
        return f"{alt.spec.nodes} nodes, not {chosen.spec.nodes}"
    if alt is chosen or alt.overrides() == chosen.overrides():
        return "the chosen plan"
    longer = alt.step_seconds / chosen.step_seconds - 1
    if longer <= TIE:
        return (f"step {_seconds(alt.step_seconds)} ({longer:+.1%}), within {TIE:.0%} of the chosen one, which is "
                "simpler")
    part = max(("compute", "bubble", "tensor", "pipeline", "data", "optimizer"),
               key=lambda k: alt.time[k] - chosen.time[k])
    return (f"step {_seconds(alt.step_seconds)} ({longer:+.1%}), {_seconds(alt.time[part] - chosen.time[part])} more "
            f"in {part}")


def as_json(result: Plan) -> dict:
    def one(c: Candidate | None) -> dict | None:
        return None if c is None else {"layout": c.describe(), "set": c.overrides(), "peak_bytes": c.peak_bytes,
                                       "step_seconds": c.time}
    return {"accelerator": result.accelerator.name, "objective": result.objective,
            "memory_budget_bytes": result.memory_budget, "considered": result.considered,
            "feasible": len(result.feasible), "memory_band": MEMORY_BAND, "time_band": TIME_BAND,
            "chosen": one(result.chosen), "alternatives": [one(c) for c in result.feasible[1:4]],
            "own": one(result.own), "own_problem": result.own_problem,
            "rejected": {k: {"count": v.count, "example": v.example} for k, v in result.rejected.items()}}


def record(result: Plan, target: Target, tokens_per_step: int, attempt: int) -> dict:
    """status.plan for the chosen layout (api.status.Plan): what, for what, predicted, and the next best."""
    chosen = result.chosen
    assert chosen is not None, "record() is for a plan with a chosen layout"
    return {"summary": chosen.describe(), "layout": chosen.layout(), "accelerator": result.accelerator.name,
            "source": target.source, "attempt": attempt, "objective": result.objective,
            "considered": result.considered, "feasible": len(result.feasible),
            **({"memoryBudgetBytes": result.memory_budget} if result.memory_budget is not None else {}),
            "predictedPeakBytes": chosen.peak_bytes, "predictedStepSeconds": round(chosen.step_seconds, 6),
            "predictedTokensPerSecond": round(tokens_per_step / chosen.step_seconds),
            "memoryBand": MEMORY_BAND, "timeBand": TIME_BAND,
            "alternatives": [f"{alt.describe()}: {_loses(alt, chosen, result.objective)}"
                             for alt in result.feasible[1:4]]}


def with_measurements(plan_record: dict, progress: dict | None, measure_after: int) -> dict:
    """status.plan with what the gang measured beside the predictions, once it has trained `measure_after` steps
    of its attempt, or all it trains (rank 0's progress: tokens/s, and on GPUs the largest rank's peak); as it
    was before that."""
    if not progress:
        return plan_record
    start = progress.get("startStep") or 0
    trained = progress.get("step", 0) - start
    if trained <= 0 or trained < min(measure_after, progress.get("totalSteps", measure_after) - start):
        return plan_record
    out = dict(plan_record, measuredAtStep=progress["step"])
    for measured, predicted, error, key in (
            ("measuredTokensPerSecond", "predictedTokensPerSecond", "tokensPerSecondError", "tokensPerSecond"),
            ("measuredPeakBytes", "predictedPeakBytes", "peakError", "peakMemoryBytes")):
        if progress.get(key):
            out[measured] = progress[key]
            if plan_record.get(predicted):
                out[error] = round(progress[key] / plan_record[predicted] - 1, 4)
    return out
