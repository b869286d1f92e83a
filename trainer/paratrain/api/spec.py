"""The typed ParallelTrainJob spec: the single source of truth for the CLI, trainer, operator and CRD schema.

Field names are the user-facing camelCase names (aliases); Python code uses snake_case attributes.
Per-field bounds live on the fields (they become OpenAPI constraints in the CRD); cross-field rules live in
`cross_field_problems`, each mirrored by a CEL rule in `paratrain.api.crd`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel, to_snake

from .memory import memory_problem
from .shapes import PRESETS, derive, resolve

API_GROUP = "paratrain.dev"
API_VERSION = "v1alpha1"
API_GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"  # a job's apiVersion
KIND = "ParallelTrainJob"
PLURAL = "paralleltrainjobs"
SHORT_NAME = "ptj"

# A job name becomes the Service name and the prefix of pod names (`<name>-<rank>`) and of DNS labels,
# so it must be an RFC 1035 label (Service names start with a letter) with room for the suffix.
MAX_NAME_LENGTH = 50
JOB_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Names of PVCs, ConfigMaps, Secrets and PriorityClasses may contain dots (e.g. `example.com-tls`).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Env names of the rendezvous contract (torchrun's and paratrain's): a user env var with one of these names would
# break rendezvous. Fabric tuning (NCCL_*, TORCH_NCCL_*, GLOO_*, UCX_*, FI_*) is the user's: it replaces
# paratrain's defaults of the same name.
RESERVED_ENV_NAMES = frozenset(
    {
        "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "POD_IP", "POD_NAME",
    }
)
RESERVED_ENV_PREFIXES = ("PET_", "PARATRAIN_", "TORCHELASTIC_")
# Mount paths, volume names and label/annotation keys the renderer owns in every pod.
RESERVED_MOUNT_PATHS = ("/dev/shm", "/etc/paratrain")
RESERVED_VOLUME_PREFIX = "paratrain-"
RESERVED_KEY_PREFIX = f"{API_GROUP}/"
# Kueue reads its keys from the pods, where the operator writes them from the job's own labels (api/kueue.py): on
# spec.pod they would make each pod a Workload of its own, admitted one by one.
KUEUE_KEY_PREFIX = "kueue.x-k8s.io/"
KUEUE_KEY_MEANING = ("Kueue's keys go on the job's metadata.labels (kueue.x-k8s.io/queue-name, "
                     "kueue.x-k8s.io/priority-class), from which paratrain labels the pods as one group")
TRAINER_CONTAINER = "trainer"  # the container every pod runs the trainer in
QUEUED_GANGS = ("volcano", "kai")  # gang schedulers with queues of their own (spec.scheduling.queue)
# The sections only the built-in trainer reads: a job with its own spec.entrypoint leaves them at their defaults.
ELASTIC_NEEDS_THE_TRAINER = ("elastic resizes the built-in trainer's data parallelism and batch: a program of its own "
                             "(spec.entrypoint) keeps a fixed gang")
ELASTIC_NEEDS_A_CHECKPOINT = ("elastic restarts the gang at each resize from its newest checkpoint: set "
                              "spec.checkpoint.path (on a volume every pod mounts)")
ELASTIC_NOT_WITH_MIN_GPUS = ("objective minGPUs chooses the gang's size itself: an elastic gang is planned for "
                             "throughput at each size it takes")
TRAINER_SECTIONS = ("model", "data", "training", "checkpoint", "logging")
# The API server refuses a pod whose annotations (keys and values) exceed 256 KiB; paratrain adds a few of its own.
MAX_ANNOTATION_BYTES = 256 * 1024 - 1024
BYTES = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$"  # a quantity of bytes paratrain.api.memory parses
QUANTITY = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
IMAGE = r"^[A-Za-z0-9][A-Za-z0-9._\-/:@]*$"
ABS_PATH = r"^/[^\x00\n\r]*$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret or ConfigMap
EXTENDED_RESOURCE_MEANING = "DOMAIN/NAME, e.g. nvidia.com/gpu or rdma/ib"
KUBERNETES_OWNED_RESOURCE = r"^([-a-z0-9.]*\.)?kubernetes\.io/"
KUBERNETES_OWNED_MEANING = "resources under kubernetes.io are Kubernetes' own, not a device plugin's"
# An extended resource (a device plugin's): a domain-prefixed name such as rdma/ib or vpc.amazonaws.com/efa.
EXTENDED_RESOURCE = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
# The pod fields the downward API hands to env (Kubernetes' own list).
ENV_FIELD_PATH = (r"^(metadata\.(name|namespace|uid)|metadata\.(labels|annotations)\['[^'\]]+'\]|"
                  r"spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$")
LABEL_KEY_MAX_LENGTH = 316  # a 253-character DNS subdomain, '/', a 62-character name
LABEL_KEY_MEANING = ("[DNS-subdomain/]name, the name up to 63 of A-Z a-z 0-9 - _ . and alphanumeric at both "
                     "ends")
LabelKey = Annotated[str, Field(pattern=LABEL_KEY, max_length=LABEL_KEY_MAX_LENGTH)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE, max_length=63)]
ExtendedResource = Annotated[str, Field(pattern=EXTENDED_RESOURCE, max_length=253)]


class _Model(BaseModel):
    """Strict camelCase model: unknown fields are errors (a misspelt field must not be silently ignored)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, validate_default=True
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null on a field that cannot be null is the field left out, as the API server treats it (it
        fills in the default); a nullable (Optional) field keeps its null."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _accepts_null(cls, k)}

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


def _accepts_null(model: type[BaseModel], key: str) -> bool:
    field = next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)
    return field is None or not field.is_required() and field.default is None


# What `parallelism.mode: auto` may use (allow) and keep as the job gives it (pin): paratrain.api.planner.
PLANNER_MODES = ("data", "tensor", "pipeline", "zero", "activationCheckpointing", "gradientAccumulation")
PINNABLE = ("data", "tensor", "pipeline", "zeroStage", "pipelineSchedule", "microbatches", "rankOrder",
            "activationCheckpointing", "gradientAccumulation")
# How global ranks map to the mesh, innermost first (Megatron-LM's names): replicas of a stage inside, or whole
# pipelines inside (its --use-tp-pp-dp-mapping).
RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")
PLANNER_FIELDS = ("objective", "pin", "allow", "memoryHeadroom")  # read only under mode auto
DEFAULT_MEMORY_HEADROOM = 0.15  # the memory model's tested error band


class Parallelism(_Model):
    mode: Literal["manual", "auto"] = Field("manual", description=(
        "manual: the fields below are the layout. auto: paratrain plans it for the model, the global batch and the "
        "gang (nodes x procsPerNode on the cluster's GPU): data, tensor and pipeline degrees, zeroStage, "
        "pipelineSchedule, microbatches, training.activationCheckpointing and training.gradientAccumulation, "
        "keeping the fields named in pin; status.plan shows the plan, its predictions and, once trained, what was "
        "measured (`paratrain validate --explain` prints it before any pod exists)."))
    objective: Literal["throughput", "minGPUs"] | None = Field(None, description=(
        "With mode auto: throughput (default), the shortest predicted step on all the nodes; minGPUs, the fewest "
        "nodes (up to spec.nodes) that fit, then the shortest step."))
    pin: list[Literal[PINNABLE]] | None = Field(None, max_length=len(PINNABLE), description=(
        "With mode auto: the fields the plan keeps as this spec gives them, e.g. [tensor] with tensor: 2."))
    allow: list[Literal[PLANNER_MODES]] | None = Field(None, max_length=len(PLANNER_MODES), description=(
        "With mode auto: the modes the plan may use (default all): data, tensor, pipeline, zero, "
        "activationCheckpointing, gradientAccumulation."))
    memory_headroom: float | None = Field(None, ge=0.0, le=0.9, description=(
        "With mode auto: the share of a rank's usable device memory the plan leaves free (default 0.15, the "
        "memory model's tested error)."))
    data: int = Field(1, ge=1, le=4096, description="Data-parallel degree (model replicas).")
    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel degree (attention heads and MLP split).")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree (stages of consecutive layers).")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="0: plain DDP; 1: shard optimizer state; 2: also gradients; 3: also parameters."
    )
    pipeline_schedule: Literal["GPipe", "1F1B"] = Field("1F1B", description="Pipeline schedule.")
    microbatches: int = Field(1, ge=1, le=1024, description="Microbatches per step on each pipeline.")
    rank_order: Literal[RANK_ORDERS] = Field("tp-dp-pp", description=(  # type: ignore[valid-type]
        "How ranks map to the layout, innermost first (consecutive ranks share a node, then a topology domain). "
        "tp-dp-pp (Megatron-LM's and torchtitan's): a stage's data-parallel replicas on consecutive ranks, stages "
        "outermost: a domain of data x tensor ranks keeps each stage's gradient reduce inside it, only the "
        "pipeline's activations cross. tp-pp-dp (Megatron-LM's --use-tp-pp-dp-mapping): each replica's stages on "
        "consecutive ranks, replicas outermost: a domain of pipeline x tensor ranks holds whole pipelines, their "
        "sends inside it, only the data-parallel reduce crosses. Under mode auto the planner chooses it."))

    @property
    def mesh_dims(self) -> tuple[str, str, str]:
        """The mesh's dimensions, outermost first: ("pp", "dp", "tp") for tp-dp-pp, ("dp", "pp", "tp") for
        tp-pp-dp (ParallelDims.mesh). The two differ only where data and pipeline are both above 1."""
        return ("dp", "pp", "tp") if self.rank_order == "tp-pp-dp" else ("pp", "dp", "tp")

    @property
    def replicas_outermost(self) -> bool:
        """Whether the layout runs tp-pp-dp where it differs from tp-dp-pp (data and pipeline both above 1)."""
        return self.rank_order == "tp-pp-dp" and self.data > 1 and self.pipeline > 1

    @property
    def on_deepspeed(self) -> bool:
        """ZeRO without tensor or pipeline parallel: the trainer runs it on DeepSpeed (ParallelDims.uses_deepspeed),
        every other layout on torch's own modes."""
        return self.zero_stage > 0 and self.tensor == 1 and self.pipeline == 1


class ModelSpec(_Model):
    # Shape fields (shapes.SHAPE_FIELDS) default to None in the schema: `_resolve_shape` fills them from the preset,
    # else the family's default (`_derive_shape` kvHeads and ffnDim from the validated heads and embedDim), so after
    # validation they hold plain values (ropeTheta None for gpt).
    family: Literal["gpt", "llama"] | None = Field(None, description=(
        "gpt: GPT-2 style (learned positions, LayerNorm, GELU MLP); llama: RoPE, RMSNorm, SwiGLU, grouped-query "
        "attention. Default: the preset's, else gpt."))
    preset: Literal[tuple(PRESETS)] | None = Field(None, description=(  # type: ignore[valid-type]
        "Named shape (family, layers, heads, kvHeads, embedDim, ffnDim, ropeTheta); fields set here override it."))
    layers: int | None = Field(None, ge=1, le=512, description="Default: the preset's, else 4.")
    heads: int | None = Field(None, ge=1, le=512, description="Attention (query) heads. Default: the preset's, else 4.")
    kv_heads: int | None = Field(None, ge=1, le=512, description=(
        "Key/value heads (grouped-query attention, llama); heads must be a multiple. Default: the preset's, else "
        "heads."))
    embed_dim: int | None = Field(None, ge=8, le=65536, description="Default: the preset's, else 128.")
    ffn_dim: int | None = Field(None, ge=1, le=262144, description=(
        "MLP width. Default: the preset's, else 4*embedDim (gpt) or 8/3*embedDim rounded up to 256 (llama)."))
    rope_theta: float | None = Field(None, gt=0.0, le=1e9, description=(
        "RoPE base frequency (llama only). Default: the preset's, else 10000."))
    norm_eps: float | None = Field(None, gt=0.0, le=0.1, description=(
        "Epsilon of LayerNorm (gpt) or RMSNorm (llama). Default: 1e-5."))
    bias: bool | None = Field(None, description=(
        "Family gpt: biases in the MLP and the LayerNorms (GPT-2's layout); false drops them, as nanoGPT's "
        "train.py does (a little faster, trains as well). Default: true for gpt. Llama has no biases: true is "
        "refused there."))
    block_size: int = Field(64, ge=2, le=131072, description="Context length in tokens.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability in attention and residual paths; 0 for pretraining.")
    vocab_size: int = Field(256, ge=2, le=1_000_000, description="Vocabulary of the synthetic source only.")
    init: str | None = Field(None, max_length=4096, pattern=r"^[^\x00\n\r]+$", description=(
        "A Hugging Face model directory (config.json, model.safetensors) to start from instead of random weights; "
        "its shapes must match this spec."))

    @model_validator(mode="before")
    @classmethod
    def _resolve_shape(cls, data: Any) -> Any:
        return resolve(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _derive_shape(self) -> ModelSpec:
        for name, value in derive(self).items():
            object.__setattr__(self, name, value)  # frozen: set once, while validating
        return self


class DataSpec(_Model):
    source: Literal["synthetic", "text", "tokens"] = Field("synthetic", description=(
        "synthetic: a generated stream of model.vocabSize ids; text: a UTF-8 file, one token per character; "
        "tokens: a directory written by `paratrain prepare` (memory-mapped shards; the vocabulary and the "
        "validation split are its own)."))
    path: str | None = Field(None, max_length=4096, pattern=r"^[^\x00\n\r]+$", description=(
        "The text file (source: text) or token directory (source: tokens); relative to the working directory."))
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description=(
        "source text and synthetic: the last fraction of the stream held out for validation (a token directory "
        "carries its own split)."))
    vocab_size: int | None = Field(None, ge=2, le=1_000_000, description=(
        "The data's vocabulary, where it is known before the data is read (e.g. 128256 for Llama 3's tokenizer): "
        "the operator then checks resources.gpuMemory before any pod exists. Every rank refuses a job whose data "
        "has another vocabulary. Unset: read from the data (synthetic: model.vocabSize)."))


class TrainingSpec(_Model):
    steps: int = Field(100, ge=1, le=100_000_000, description="Optimizer steps to train.")
    batch_size: int = Field(8, ge=1, le=1_000_000, description="Sequences per optimizer step, over all DP ranks.")
    gradient_accumulation: int = Field(1, ge=1, le=1024, description=(
        "Micro-steps per optimizer step, each of batchSize/gradientAccumulation sequences; gradients are reduced "
        "once per optimizer step."))
    activation_checkpointing: Literal["none", "full", "selective"] = Field("none", description=(
        "Recompute activations in backward instead of keeping them, per block: full keeps only each block's "
        "input; selective keeps matmul and attention outputs and recomputes the cheap ops between them."))
    compile: bool = Field(False, description=(
        "torch.compile each transformer block (TorchInductor): fewer, fused kernels per step, after the first "
        "steps spend seconds to minutes compiling. The loss curve matches eager's (tested). Inductor needs a C++ "
        "compiler on CPU. Not with DeepSpeed ZeRO-3 (zeroStage 3 on a data-parallel-only layout)."))
    learning_rate: float = Field(1e-3, gt=0.0, le=10.0, description="Peak learning rate, reached after warmupSteps.")
    min_learning_rate: float = Field(1e-4, ge=0.0, le=10.0, description=(
        "Learning rate at the last step: cosine decay from learningRate after warmup; at most learningRate."))
    warmup_steps: int = Field(10, ge=0, le=100_000_000, description="Steps of linear warmup from 0; at most steps.")
    weight_decay: float = Field(0.1, ge=0.0, le=10.0, description=(
        "AdamW weight decay, on matrices and embeddings only (not biases or norm gains)."))
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW's first-moment decay.")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="AdamW's second-moment decay.")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Max global gradient norm; 0 disables clipping.")
    eval_interval: int = Field(50, ge=1, le=100_000_000, description=(
        "Steps between validation-loss evaluations (and at the last step)."))
    eval_steps: int = Field(10, ge=1, le=100_000, description="Validation batches averaged per evaluation.")
    seed: int = Field(1337, ge=0, le=2**31 - 1, description=(
        "Seeds weights, data order and dropout: the same seed and data give the same loss curve in every layout."))


class CheckpointSpec(_Model):
    # Relative paths are relative to the working directory (local runs); pods want a shared volume's path.
    path: str | None = Field(None, max_length=4096, pattern=r"^[^\x00\n\r]+$",
                             description="Directory for checkpoints; resume picks the latest complete one.")
    interval: int | None = Field(None, ge=0, le=100_000_000, description=(
        "Steps between checkpoints; 0: only at the end. Unset: every intervalMinutes of training."))
    interval_minutes: float = Field(30.0, gt=0, le=10_080, description=(
        "Minutes of training between checkpoints when interval is unset (the default): a step takes milliseconds "
        "on a laptop and seconds for an 8B model, so a default in steps would either save constantly or lose "
        "hours to a crash; minutes bound the work a crash loses for every job alike. Rank 0's clock decides."))
    keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")
    async_save: bool = Field(False, description="Write checkpoints in the background while training goes on; a "
                                                "checkpoint exists once written, by the next save or the end.")


class LoggingSpec(_Model):
    tensorboard: str | None = Field(None, max_length=4096, pattern=r"^[^\x00\n\r]+$", description=(
        "Directory for TensorBoard event files (loss, learning rate, gradient norm, throughput, validation loss, "
        "MFU and peak memory), written by rank 0; unset: none."))


class ResourceClaim(_Model):
    """A Dynamic Resource Allocation claim each pod makes from a ResourceClaimTemplate (resource.k8s.io/v1)."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="The claim's name in the pod.")
    resource_claim_template_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "The ResourceClaimTemplate in the job's namespace: each pod gets its own claim made from it."))
    provides_gpus: bool = Field(False, description=(
        "The claim holds the pod's gpusPerNode GPUs: the pods then request no gpuResource (one claim at most)."))


class ResourcesSpec(_Model):
    gpus_per_node: int = Field(0, ge=0, le=64, description=(
        "GPUs (gpuResource) per pod; 0 trains on CPU with gloo."))
    gpu_resource: str = Field("nvidia.com/gpu", pattern=EXTENDED_RESOURCE, max_length=253, description=(
        "The device plugin's resource gpusPerNode counts: nvidia.com/gpu, amd.com/gpu, or a MIG profile such "
        "as nvidia.com/mig-3g.40gb."))
    extra: dict[ExtendedResource, Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=dict, max_length=16, description=(
            "Other device-plugin resources per pod, e.g. {rdma/ib: 1} or {vpc.amazonaws.com/efa: 4} for "
            "GPUDirect RDMA (requests = limits)."))
    claims: list[ResourceClaim] = Field(default_factory=list, max_length=16, description=(
        "DRA claims every pod makes (pod resourceClaims, each given to the trainer container): devices a "
        "DeviceClass describes, instead of or beside gpusPerNode."))
    cpu: str = Field("1", pattern=QUANTITY, max_length=32, description="CPU per pod (requests = limits).")
    memory: str = Field("2Gi", pattern=QUANTITY, max_length=32, description=(
        "Memory per pod (requests = limits), /dev/shm included."))
    shm_size: str = Field("1Gi", pattern=QUANTITY, max_length=32, description="Size of the /dev/shm emptyDir.")
    gpu_memory: str | None = Field(None, pattern=BYTES, max_length=32, description=(
        "Memory of one device (e.g. 80Gi). The job is refused when paratrain's memory model predicts a rank needs "
        "more (`paratrain validate --memory` shows the terms): by the operator before any pod exists where the "
        "spec gives the vocabulary (data.vocabSize, or synthetic data), else by every rank once it has read the "
        "data, before the model is built. Unset: not checked."))
    gpu_memory_reserve: str = Field("2Gi", pattern=BYTES, max_length=32, description=(
        "Device memory the check keeps out of gpuMemory for what is not the trainer's tensors: the CUDA context "
        "and its kernels, NCCL's buffers, cuBLAS and cuDNN workspaces. The platform's jobDefaults may set it."))
    gpu_memory_fragmentation: float = Field(0.05, ge=0, le=0.5, description=(
        "The share of what is left that the check keeps for the allocator's fragmentation (reserved but not "
        "allocated memory). The platform's jobDefaults may set it."))


class RunPolicy(_Model):
    backoff_limit: int = Field(3, ge=0, le=1000, description="Gang restarts allowed before the job fails.")
    max_uncounted_restarts: int = Field(100, ge=0, le=100000, description=(
        "Gang restarts not counted against backoffLimit (stops from outside: a drain, a preemption, a pod deleted; "
        "failures an Ignore rule matches) allowed before the job fails: a gang stopped over and over, or a failure "
        "ignored in a loop, ends instead of restarting forever."))
    active_deadline_seconds: int | None = Field(None, ge=1, le=10 * 365 * 86400, description=(
        "Fail the job once it has run this long (from its gang's start; a resume restarts the clock)."))
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=10 * 365 * 86400, description=(
        "Delete the job (and its pods) this long after it succeeded or failed; unset: keep it."))
    suspend: bool = Field(False, description="Stop the gang (delete its pods) and keep the job; false again resumes it.")
    stall_timeout_seconds: int = Field(
        900, ge=10, le=7 * 86400, description="Progress silent this long sets the Stalled condition."
    )
    collective_timeout_seconds: int = Field(
        600, ge=5, le=86400, description="A collective that waits longer fails the job instead of hanging."
    )


class FailurePolicyRule(_Model):
    """A failure this rule matches gets its action (the first matching rule's), as in a Job's podFailurePolicy."""

    action: Literal["FailJob", "RestartInPlace", "RestartGang", "Ignore"] = Field(description=(
        "FailJob: the job fails at once, no restart. RestartInPlace: every pod's agent restarts its workers in the "
        "same pods (restartPolicy.inPlaceLimit times per gang, then as RestartGang; exit codes only). RestartGang: "
        "the whole gang restarts from the newest checkpoint, counted against runPolicy.backoffLimit. Ignore: the "
        "gang restarts, not counted."))
    exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(default_factory=list, max_length=16, description=(
        "The trainer container's exit codes this rule matches (`paratrain node` passes its workers' codes "
        "through; a signal is 128 + its number)."))
    # Evicted: for kubelets that set no DisruptionTarget condition on the pods they evict (before Kubernetes 1.26).
    pod_conditions: list[Literal["DisruptionTarget", "OOMKilled", "Evicted"]] = Field(
        default_factory=list, max_length=3, description=(
            "What happened to the pod: DisruptionTarget (its condition: preempted, evicted, its node drained or shut "
            "down), OOMKilled (the trainer container's terminated reason: the kernel's OOM killer), Evicted (the "
            "pod's reason)."))

    @model_validator(mode="after")
    def _one_matcher(self) -> FailurePolicyRule:
        if bool(self.exit_codes) == bool(self.pod_conditions):
            raise ValueError("a rule matches either exitCodes or podConditions: give exactly one")
        if self.action == "RestartInPlace" and self.pod_conditions:
            raise ValueError("RestartInPlace matches exitCodes only: a pod with a condition is gone or going")
        return self

    def matches(self, exit_code: int | None, conditions: Iterable[str]) -> bool:
        return exit_code in self.exit_codes or any(c in self.pod_conditions for c in conditions)

    def describe(self) -> str:
        field, values = ("exitCodes", self.exit_codes) if self.exit_codes else ("podConditions", self.pod_conditions)
        return f"{field} [{', '.join(map(str, values))}]: {self.action}"


def first_rule(rules: Iterable[FailurePolicyRule], exit_code: int | None,
               conditions: Iterable[str] = ()) -> tuple[int, FailurePolicyRule] | None:
    """The first rule matching a failure, with its index: the one whose action applies."""
    conditions = list(conditions)
    return next(((i, rule) for i, rule in enumerate(rules) if rule.matches(exit_code, conditions)), None)


class FailurePolicy(_Model):
    rules: list[FailurePolicyRule] = Field(default_factory=list, max_length=8, description=(
        "Checked in order; the first rule that matches a failed pod decides. Where none does: exit codes 2 (the "
        "trainer refused the spec or its data), 78 (out of device memory, building or in a step), 126 and 127 (the image "
        "cannot run the command) fail the job; a DisruptionTarget is ignored; any other exit restarts the workers "
        "in place while restartPolicy.inPlaceLimit allows, and then the gang, counted."))


# Each round of in-place restarts reuses node 0's rendezvous store, which still holds the last round's keys; the
# built-in trainer keys each round apart (preflight.join), a program of its own would meet them.
IN_PLACE_NEEDS_THE_TRAINER = ("in-place restarts need the built-in trainer, which keys each round's rendezvous apart "
                              "from the last one's: leave inPlaceLimit at 0 with spec.entrypoint")


class RestartPolicy(_Model):
    in_place_limit: int = Field(0, ge=0, le=100, description=(
        "In-place restarts per gang: when a rank fails and its pod is alive, every pod's agent restarts its workers "
        "in the same pods (a new rendezvous round, resuming from the newest checkpoint; no pod is deleted, created "
        "or scheduled), up to this many times; after that the pod fails and the whole gang restarts. A pod lost "
        "(deleted, evicted, its node gone), other than pod 0, is then recreated alone while the others' ranks wait "
        "for it in such a round. 0: every failure restarts the whole gang."))
    hang_seconds: int | None = Field(None, ge=10, le=86400, description=(
        "A rank that makes no progress for this many seconds while alive (no step, evaluation batch or checkpoint "
        "save finished: a deadlock, a stuck read, a collective that never returns) is stopped by its pod's agent "
        "and its round fails with exit 79, restarted in place within inPlaceLimit, else as a gang. Counted from "
        "the first step of each round (building and resuming are the start timeout's); larger than the longest "
        "step, evaluation batch and checkpoint save. Unset: no hang detection (a hung collective still ends at "
        "runPolicy.collectiveTimeoutSeconds). A program of its own (spec.entrypoint) beats by writing "
        "$PARATRAIN_HEARTBEAT_DIR/rank-$RANK."))


class Toleration(_Model):
    key: str | None = Field(None, max_length=LABEL_KEY_MAX_LENGTH, pattern=LABEL_KEY, description="The taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Equal (the default) or Exists.")
    value: str | None = Field(None, max_length=63, pattern=LABEL_VALUE, description="The taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect tolerated; unset: all.")
    toleration_seconds: int | None = Field(None, description="NoExecute only: how long the pod stays after the taint.")

    @model_validator(mode="after")
    def _api_server_rules(self) -> Toleration:
        # The API server's own toleration rules: a pod breaking one would be refused at creation.
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty (an empty key matches every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class TopologySpec(_Model):
    level: str = Field(pattern=LABEL_KEY, max_length=LABEL_KEY_MAX_LENGTH, description=(
        "A node label whose values are the domains (a rack, a network block, an NVLink domain label such as "
        "Topograph's): the gang, or each group of ranksPerDomain ranks, is placed within one domain of it."))
    mode: Literal["required", "preferred"] = Field("required", description=(
        "required: a gang (or group) that fits no single domain waits; preferred: it spreads over domains "
        "instead."))
    ranks_per_domain: int | None = Field(None, ge=1, le=1_048_576, description=(
        "Ranks kept in one domain: a multiple of procsPerNode (a domain holds whole pods) and of tensor (a "
        "tensor-parallel group never crosses one), dividing the gang's ranks; consecutive node ranks share a domain. "
        "Ranks run tensor innermost, then by parallelism.rankOrder: a multiple of data x tensor holds whole "
        "pipeline stages (tp-dp-pp), of pipeline x tensor whole pipelines (tp-pp-dp). Unset: the whole gang in one "
        "domain."))


class SchedulingSpec(_Model):
    gang: Literal["none", "kubernetes", "volcano", "kai", "coscheduling"] = Field("none", description=(
        "All-or-nothing scheduling of the gang: kubernetes (the native Workload and PodGroup APIs, 1.37 with the "
        "GenericWorkload gate), volcano, kai (NVIDIA's KAI Scheduler, v0.15 or later), coscheduling "
        "(scheduler-plugins), or none."))
    queue: str | None = Field(None, pattern=DNS_LABEL, max_length=63, description=(
        "Volcano's or KAI's queue (gang 'volcano' or 'kai'; KAI's default-queue where unset). For Kueue, label "
        "the job kueue.x-k8s.io/queue-name instead."))
    topology: TopologySpec | None = Field(None, description=(
        "Where the gang is placed by the nodes' topology labels, for every gang scheduler: under Kueue its "
        "topology-aware scheduling (the pod group's podset-*-topology annotations, ranks filling domains in "
        "order); under gang 'kubernetes' the PodGroup's topology constraint (required, whole gang: Kubernetes "
        "1.37 with TopologyAwareWorkloadScheduling); otherwise, and for what those cannot say, pod affinity by "
        "domain among each group's pods."))
    topology_key: str | None = Field(None, pattern=LABEL_KEY, max_length=LABEL_KEY_MAX_LENGTH, description=(
        "Deprecated: topology.level (mode required, the whole gang). Read as that; not both."))
    priority_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "The pods' PriorityClass (and the native PodGroup's)."))
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64, description=(
        "Node labels every pod of the gang requires."))
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description=(
        "Taints the pods tolerate (e.g. a GPU pool's)."))
    # Affinity is Kubernetes' own structure; it is passed through as data (never as text) and
    # validated by the API server's pod schema.
    affinity: dict[str, Any] | None = Field(None, description=(
        "A Kubernetes Affinity, passed to every pod as it is (checked by the API server)."))
    @model_validator(mode="before")
    @classmethod
    def _topology_key_is_topology(cls, data: Any) -> Any:
        # The field before scheduling.topology: the same request, kept readable for jobs written with it.
        if not isinstance(data, dict):
            return data
        given = [k for k in ("topologyKey", "topology_key") if data.get(k) is not None]
        if given and data.get("topology") is not None:
            raise ValueError("topologyKey is the deprecated form of topology.level: give topology only")
        level = data[given[0]] if given else None
        # A bad value stays where it was given, for its own field's error to name it.
        if isinstance(level, str) and len(level) <= LABEL_KEY_MAX_LENGTH and re.fullmatch(LABEL_KEY, level):
            data = {k: v for k, v in data.items() if k not in ("topologyKey", "topology_key")}
            data["topology"] = {"level": level}
        return data

    start_timeout_seconds: int = Field(1200, ge=30, le=7 * 86400, description=(
        "How long an attempt's whole gang may take to be running, from the first create of its pods (under Kueue, "
        "from admission): past it, the attempt ends with the waiting pods' reason (Unschedulable, an image pull, a "
        "refused create such as exceeded quota), its pods are deleted and the gang starts afresh, startAttempts "
        "times in all, then the job fails; no restart is counted against backoffLimit. "
        "Each pod's torchrun waits as long for the rendezvous. The default, 20 min, leaves room for a large gang's "
        "image pulls."))
    start_attempts: int = Field(3, ge=1, le=100, description=(
        "Attempts whose gang did not start in startTimeoutSeconds allowed before the job fails: each one that times "
        "out is ended (its pods deleted) and the gang is created afresh, as Kueue requeues a workload whose pods "
        "were not ready in time (a brief capacity gap need not fail the job). 1: the first timeout fails it."))


class ElasticSpec(_Model):
    """A gang that shrinks instead of waiting for capacity, and grows back when it returns (docs/operator.md)."""

    min_nodes: int = Field(ge=1, le=4096, description=(
        "The fewest pods the gang shrinks to. A pod that cannot be placed (Unschedulable, or held by Kueue) for "
        "waitSeconds makes the operator restart the gang at the largest size at or below what was placed that keeps "
        "tensor x pipeline and the global batch (gradient accumulation grows as data-parallel replicas go; under "
        "mode auto, a size the planner finds a layout for); the new gang resumes from the newest checkpoint, "
        "resharded. At most nodes."))
    max_nodes: int | None = Field(None, ge=1, le=4096, description=(
        "The most pods it grows to when capacity shows (placeholder pods that hold no rank are placed): at a "
        "checkpoint of the step in flight, never mid-step. At least nodes; unset: nodes."))
    wait_seconds: int = Field(300, ge=10, le=86400, description=(
        "How long a pod may wait for a place before the gang shrinks; also the least time between two resizes."))


class KeyRef(_Model):
    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The Secret's or ConfigMap's name.")
    key: str = Field(pattern=CONFIG_KEY, max_length=253, description="The key whose value the variable takes.")
    optional: bool = Field(False, description="Leave the variable unset when the key is missing, instead of the "
                                              "pod failing to start.")


class FieldRef(_Model):
    field_path: str = Field(pattern=ENV_FIELD_PATH, max_length=512, description=(
        "A pod field the downward API gives env, e.g. spec.nodeName or metadata.labels['team']."))


class EnvSource(_Model):
    secret_key_ref: KeyRef | None = Field(None, description="A key of a Secret in the job's namespace.")
    config_map_key_ref: KeyRef | None = Field(None, description="A key of a ConfigMap in the job's namespace.")
    field_ref: FieldRef | None = Field(None, description="A field of the pod.")

    @model_validator(mode="after")
    def _one_source(self) -> EnvSource:
        if sum(s is not None for s in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError("exactly one of secretKeyRef, configMapKeyRef, fieldRef must be set")
        return self


class EnvVar(_Model):
    name: str = Field(pattern=ENV_NAME, max_length=128, description="The variable's name.")
    value: str = Field("", max_length=32768, description="Its value, as plain text in the pod (secrets: valueFrom).")
    value_from: EnvSource | None = Field(None, description=(
        "Where the value comes from instead: a Secret's or ConfigMap's key, or a pod field."))

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError("value and valueFrom are exclusive")
        return self


class Volume(_Model):
    """A volume mounted into every pod: a PVC (data, checkpoints), a ConfigMap, a Secret or an emptyDir."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="The volume's name in the pod.")
    mount_path: str = Field(pattern=ABS_PATH, max_length=4096, description=(
        "Where the trainer container sees it (an absolute path, e.g. /data or /checkpoints)."))
    read_only: bool = Field(False, description="Mount it read-only.")
    persistent_volume_claim: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "Source: this PersistentVolumeClaim (shared by every pod: ReadWriteMany for checkpoints)."))
    config_map: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description="Source: this ConfigMap.")
    secret: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description="Source: this Secret.")
    empty_dir: bool = Field(False, description="Source: an empty directory per pod (gone with the pod).")

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        sources = [self.persistent_volume_claim, self.config_map, self.secret, self.empty_dir or None]
        if sum(s is not None for s in sources) != 1:
            raise ValueError("exactly one of persistentVolumeClaim, configMap, secret, emptyDir must be set")
        return self


class TopologySpread(_Model):
    """A TopologySpreadConstraint over the gang's own pods (the renderer selects them by the job's label)."""

    topology_key: str = Field(pattern=LABEL_KEY, max_length=LABEL_KEY_MAX_LENGTH, description=(
        "The node label whose values are the domains, e.g. topology.kubernetes.io/zone."))
    max_skew: int = Field(1, ge=1, le=4096, description="The most the gang's pod counts of two domains may differ.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field("DoNotSchedule", description=(
        "DoNotSchedule: a hard rule; ScheduleAnyway: a preference."))
    min_domains: int | None = Field(None, ge=1, le=4096, description=(
        "DoNotSchedule only: fewer eligible domains than this count as skew."))


class InitContainer(_Model):
    """A container that runs to completion before the trainer starts (fetch data, warm a cache), under the trainer's
    security context and CPU and memory, with the job's volumes mounted."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="The container's name (not 'trainer').")
    image: str = Field(pattern=IMAGE, max_length=512, description="Its image.")
    command: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=64, description=(
        "Its entrypoint; unset: the image's."))
    args: list[Annotated[str, Field(max_length=32768)]] = Field(default_factory=list, max_length=256, description=(
        "Its arguments."))
    env: list[EnvVar] = Field(default_factory=list, max_length=256, description="Its environment variables.")


class PodSpec(_Model):
    """What real clusters need from the user, merged into every pod as data."""

    env: list[EnvVar] = Field(default_factory=list, max_length=256, description=(
        "Extra environment variables of the trainer container."))
    volumes: list[Volume] = Field(default_factory=list, max_length=64, description=(
        "Volumes mounted into the trainer container: absolute data and checkpoint paths live on these in a cluster."))
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the trainer image from a private registry.")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64, description=(
        "Extra labels on every pod (paratrain's own win)."))
    annotations: dict[LabelKey, Annotated[str, Field(max_length=65536)]] = Field(default_factory=dict, max_length=64,
                                                                                description="Extra annotations on every pod.")
    service_account_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "The pods' ServiceAccount, for workload identity (cloud storage, registries); its token is mounted only "
        "when one is named. Unset: the namespace's default account, no token."))
    runtime_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253, description=(
        "The pods' RuntimeClass (e.g. nvidia, where the GPU runtime is not the node's default)."))
    topology_spread_constraints: list[TopologySpread] = Field(default_factory=list, max_length=8, description=(
        "Spread the gang's pods over the domains of node labels (zones, racks, hosts)."))
    init_containers: list[InitContainer] = Field(default_factory=list, max_length=8, description=(
        "Containers run in order before the trainer, in every pod."))
    termination_grace_period_seconds: int = Field(60, ge=10, le=86_400, description=(
        "How long a stopped pod (a drain, a preemption, a suspend) has before it is killed: its ranks finish the step "
        "in flight, write a checkpoint of it and exit, so the job resumes there. Allow for a checkpoint's write."))
    ipc_lock: bool = Field(False, description=(
        "Add the IPC_LOCK capability to the trainer (GPUDirect RDMA pins memory). Outside the restricted Pod "
        "Security profile: refused unless the platform allows it (Helm value platform.allowIpcLock)."))
    host_network: bool = Field(False, description=(
        "Run the pods in the node's network namespace (RDMA fabrics a CNI does not carry; one pod per node). "
        "Outside the restricted Pod Security profile: refused unless the platform allows it (Helm value "
        "platform.allowHostNetwork)."))

    @field_validator("annotations")
    @classmethod
    def _annotations_fit_a_pod(cls, annotations: dict[str, str]) -> dict[str, str]:
        size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
        if size > MAX_ANNOTATION_BYTES:
            raise ValueError(f"annotations total {size} bytes; a pod's may not exceed {MAX_ANNOTATION_BYTES} "
                             "(the API server's 256 KiB, less paratrain's own)")
        return annotations


class Entrypoint(_Model):
    """Your own training program instead of the built-in trainer: the pods run it in spec.image under the same env
    contract (torchrun's PET_* flags, so `torchrun train.py` needs no flags; the layout as PARATRAIN_DATA,
    PARATRAIN_TENSOR, PARATRAIN_PIPELINE, PARATRAIN_ZERO_STAGE, PARATRAIN_PRECISION), gang, restarts and status."""

    command: list[Annotated[str, Field(max_length=4096)]] = Field(min_length=1, max_length=64, description=(
        "The program and its first arguments, e.g. [torchrun, train.py] (no shell: use [sh, -c, ...] for one)."))
    args: list[Annotated[str, Field(max_length=32768)]] = Field(default_factory=list, max_length=256, description=(
        "More arguments, after command."))
    working_dir: str | None = Field(None, pattern=ABS_PATH, max_length=4096, description=(
        "Where it runs in the pod; unset: the image's working directory (the current directory in a local run)."))


class Spec(_Model):
    image: str = Field("ghcr.io/paratrain/trainer:0.1.0", pattern=IMAGE, max_length=512, description=(
        "The trainer image every pod runs (cluster only; a local run uses this checkout)."))
    nodes: int = Field(1, ge=1, le=4096, description="Pods in the gang.")
    procs_per_node: int = Field(1, ge=1, le=64, description="Processes (GPUs) per pod.")
    parallelism: Parallelism = Field(default_factory=Parallelism, description=(
        "The parallel layout: data x tensor x pipeline degrees (their product is nodes x procsPerNode), the ZeRO "
        "stage and the pipeline schedule."))
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "Mixed precision: bf16 or fp16 autocast with fp32 master weights (fp16 with dynamic loss scaling)."))
    reduce_precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "The type gradients are summed in across data-parallel ranks (DDP, the composed layouts' reducer, ZeRO's "
        "reduce-scatters, FSDP2, DeepSpeed): fp32 (the default, torchtitan's and Megatron-LM's), or the job's "
        "16-bit precision, which halves the gradient traffic and rounds each gradient and each partial sum to 8 "
        "(bf16) or 11 (fp16) mantissa bits (under fp16 a scaled gradient past 65,504 overflows, and the loss "
        "scaler skips the step and halves the scale). The optimizer still steps in fp32; micro-steps still "
        "accumulate in fp32 except under FSDP2 (ZeRO-2/3 with tensor or pipeline parallel), which then "
        "accumulates them in the 16-bit type, as Megatron-LM's --grad-reduce-in-bf16 does."))
    tf32: bool = Field(False, description=(
        "On GPUs of Ampere or newer, fp32 matmuls run on TF32 tensor cores (a 10-bit mantissa; several times "
        "faster): what fp32 jobs usually want for speed. Off by default, as in PyTorch: fp32 means fp32. No effect "
        "on CPUs."))
    model: ModelSpec = Field(default_factory=ModelSpec, description=(
        "The model to train: a GPT or Llama shape, from a preset or field by field."))
    data: DataSpec = Field(default_factory=DataSpec, description=(
        "What the model trains on: a text file, a token directory from `paratrain prepare`, or synthetic ids."))
    training: TrainingSpec = Field(default_factory=TrainingSpec, description=(
        "The optimisation: steps, global batch, learning-rate schedule, AdamW, gradient clipping, evaluation."))
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description=(
        "Where and how often to save; a restarted or re-applied job resumes from the newest complete checkpoint."))
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description=(
        "Metrics written beside the logs: TensorBoard event files."))
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description=(
        "What each pod gets: GPUs, CPU, memory, shared memory, other devices."))
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description=(
        "Restarts, deadlines, suspension and timeouts of the job as a whole."))
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy, description=(
        "How a failed rank is restarted: in place (the same pods) before the whole gang."))
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description=(
        "What a failed pod's exit code or condition does to the job: fail it at once, restart the gang (counted "
        "against runPolicy.backoffLimit), or restart it uncounted."))
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description=(
        "Where and how the gang is placed: all-or-nothing gang scheduling, node selection, priority, start timeout."))
    elastic: ElasticSpec | None = Field(None, description=(
        "Let the gang shrink when pods cannot be placed and grow back when capacity returns, resuming from the "
        "checkpoint each time (the built-in trainer, spec.checkpoint.path set; not with objective minGPUs). Unset: "
        "the gang keeps its size."))
    pod: PodSpec = Field(default_factory=PodSpec)
    entrypoint: Entrypoint | None = Field(None, description=(
        "Run your own training program instead of the built-in trainer (model, data, training, checkpoint and "
        "logging are then the program's business: leave them out)."))

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Spec:
        # `paratrain.api.load.parse_job` runs these itself to report each problem under its own field path.
        if info.context and info.context.get("defer_cross_field"):
            return self
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(f"{path}: {msg}" for path, msg in problems))
        return self


def fixes(spec: Spec) -> dict[str, str]:
    """For a cross-field problem, by field path, the nearest values that would work, as a person would try them:
    keep the model parallel degrees (tensor, pipeline) and size data parallelism to the gang, or keep the layout
    and size the gang to it."""
    p, out = spec.parallelism, {}
    if p.mode == "auto":
        return out
    product, world, model_parallel = p.data * p.tensor * p.pipeline, spec.world_size, p.tensor * p.pipeline
    if product != world:
        tries = []
        if world % model_parallel == 0:
            tries.append(f"parallelism.data: {world // model_parallel} (for this gang)")
        if product % spec.procs_per_node == 0:
            tries.append(f"nodes: {product // spec.procs_per_node} (for this layout)")
        elif product % spec.nodes == 0:
            tries.append(f"procsPerNode: {product // spec.nodes} (for this layout)")
        if tries:
            out["spec.parallelism"] = "set " + ", or ".join(tries)
    return out


def stated_vocab_size(spec: Spec) -> int | None:
    """The vocabulary the spec itself states (data.vocabSize, or a synthetic source's model.vocabSize); None where
    only the data knows it."""
    return spec.data.vocab_size or (spec.model.vocab_size if spec.data.source == "synthetic" else None)


def cluster_problems(spec: Spec) -> list[tuple[str, str]]:
    """What only matters in pods (a local run accepts it): checked by the operator and `paratrain render`. The
    memory check is here too: a laptop's CPU run is not held to the GPU memory the job states."""
    out: list[tuple[str, str]] = []
    for field, path, what in (("spec.checkpoint.path", spec.checkpoint.path, "checkpoints"),
                              ("spec.logging.tensorboard", spec.logging.tensorboard, "event files")):
        if path and not path.startswith("/"):
            out.append((field, f"{path!r} is relative: in a cluster it must be an absolute path on a volume every pod "
                        f"mounts (spec.pod.volumes), or the {what} are lost with the pod; relative paths are for "
                        "local runs"))
    vocab = stated_vocab_size(spec)
    if vocab is None and spec.parallelism.mode == "auto":
        out.append(("spec.data.vocabSize", f"mode auto sizes the model's embedding by its vocabulary, and the "
                    f"operator plans before any rank has read the {spec.data.source} data: give it here (65 for "
                    "examples/data/tinyshakespeare.txt)"))
    # Under mode auto gpuMemory is the planner's budget (a layout is chosen to fit it), not a check.
    if spec.resources.gpu_memory and vocab and spec.parallelism.mode == "manual":  # else the ranks check
        if problem := memory_problem(spec, vocab):
            out.append(("spec.resources.gpuMemory", problem))
    return out


def cross_field_problems(spec: Spec) -> list[tuple[str, str]]:
    """Constraints between fields, as (field path, message). Each has a CEL twin in the CRD (see crd.py)."""
    p, m, t = spec.parallelism, spec.model, spec.training
    out: list[tuple[str, str]] = []
    # Under mode auto the layout fields are the planner's to choose (each layout it tries passes these rules).
    manual = p.mode == "manual"
    product = p.data * p.tensor * p.pipeline
    if manual and product != spec.world_size:
        out.append(("spec.parallelism", f"data({p.data}) x tensor({p.tensor}) x pipeline({p.pipeline}) = {product} "
                    f"must equal nodes({spec.nodes}) x procsPerNode({spec.procs_per_node}) = {spec.world_size}"))
    if manual and p.zero_stage > 0 and p.data == 1:
        out.append(("spec.parallelism.zeroStage", f"zeroStage {p.zero_stage} shards over data-parallel ranks and "
                    "needs parallelism.data >= 2"))
    # The built-in trainer's own constraints (its model, batch, schedule, data): a program of its own
    # (spec.entrypoint) leaves those sections at their defaults, which must not constrain its layout.
    if spec.entrypoint is None:
        if m.embed_dim % m.heads:
            out.append(("spec.model.embedDim", f"embedDim({m.embed_dim}) must be divisible by heads({m.heads})"))
        if manual and m.heads % p.tensor:
            out.append(("spec.model.heads", f"heads({m.heads}) must be divisible by parallelism.tensor({p.tensor})"))
        if m.heads % m.kv_heads:
            out.append(("spec.model.kvHeads", f"heads({m.heads}) must be divisible by kvHeads({m.kv_heads})"))
        if manual and m.kv_heads != m.heads and m.kv_heads % p.tensor:
            out.append(("spec.model.kvHeads", f"kvHeads({m.kv_heads}) must be divisible by "
                        f"parallelism.tensor({p.tensor})"))
        if manual and m.ffn_dim % p.tensor:
            out.append(("spec.model.ffnDim", f"ffnDim({m.ffn_dim}) must be divisible by "
                        f"parallelism.tensor({p.tensor})"))
        if m.family == "llama" and m.embed_dim % m.heads == 0 and m.embed_dim // m.heads % 2:
            out.append(("spec.model.embedDim", f"RoPE rotates pairs: the head dimension embedDim/heads = "
                        f"{m.embed_dim // m.heads} must be even"))
        if m.family == "gpt" and m.kv_heads != m.heads:
            out.append(("spec.model.kvHeads", f"family gpt has no grouped-query attention: kvHeads({m.kv_heads}) must "
                        f"equal heads({m.heads})"))
        if m.family == "llama" and m.bias:
            out.append(("spec.model.bias", "family llama has no biases: bias is for family gpt"))
        if m.family == "gpt" and m.rope_theta is not None:
            out.append(("spec.model.ropeTheta", "family gpt learns position embeddings: ropeTheta is for family "
                        "llama"))
        if manual and m.layers < p.pipeline:
            out.append(("spec.model.layers", f"layers({m.layers}) must be >= parallelism.pipeline({p.pipeline}): "
                        "every stage needs at least one layer"))
        if manual and t.batch_size % p.data:
            out.append(("spec.training.batchSize", f"batchSize({t.batch_size}) must be divisible by "
                        f"parallelism.data({p.data})"))
        elif manual and (t.batch_size // p.data) % t.gradient_accumulation:
            out.append(("spec.training.gradientAccumulation", f"per-rank batch batchSize/data = "
                        f"{t.batch_size // p.data} must be divisible by "
                        f"gradientAccumulation({t.gradient_accumulation})"))
        elif manual and (t.batch_size // p.data // t.gradient_accumulation) % p.microbatches:
            out.append(("spec.parallelism.microbatches", "per-rank micro-step batch "
                        f"batchSize/data/gradientAccumulation = {t.batch_size // p.data // t.gradient_accumulation} "
                        f"must be divisible by microbatches({p.microbatches})"))
        if manual and t.compile and p.zero_stage == 3 and p.tensor == 1 and p.pipeline == 1:
            out.append(("spec.training.compile", "compile does not go with DeepSpeed ZeRO-3 (zeroStage 3 with "
                        "tensor and pipeline 1), whose gathers hook every module: use zeroStage 1 or 2, or add "
                        "tensor or pipeline parallelism (ZeRO-3 then runs on FSDP2)"))
        if manual and p.microbatches > 1 and p.pipeline == 1:
            out.append(("spec.parallelism.microbatches", "microbatches > 1 needs parallelism.pipeline > 1"))
        if manual and p.pipeline > 1 and p.microbatches < p.pipeline and p.pipeline_schedule == "1F1B":
            out.append(("spec.parallelism.microbatches", f"1F1B needs microbatches({p.microbatches}) >= "
                        f"pipeline({p.pipeline})"))
        if t.min_learning_rate > t.learning_rate:
            out.append(("spec.training.minLearningRate", f"minLearningRate({t.min_learning_rate}) must be <= "
                        f"learningRate({t.learning_rate})"))
        if t.warmup_steps > t.steps:
            out.append(("spec.training.warmupSteps", f"warmupSteps({t.warmup_steps}) must be <= steps({t.steps})"))
        if spec.data.source != "synthetic" and not spec.data.path:
            out.append(("spec.data.path", f"data.source '{spec.data.source}' needs data.path"))
    if manual:
        for name in PLANNER_FIELDS:
            if getattr(p, to_snake(name)) is not None:
                out.append((f"spec.parallelism.{name}", f"{name} is for parallelism.mode auto (the planner's); this "
                            "job's mode is manual"))
    elif spec.entrypoint:
        out.append(("spec.parallelism.mode", "mode auto plans the built-in trainer's model: a program of its own "
                    "(spec.entrypoint) gives its layout (mode manual)"))
    if spec.reduce_precision not in ("fp32", spec.precision):
        out.append(("spec.reducePrecision", f"reducePrecision({spec.reduce_precision}) must be fp32 or the job's "
                    f"precision({spec.precision}): gradients are summed in fp32 or in the 16-bit type they are "
                    "computed in"))
    if spec.resources.gpus_per_node and spec.resources.gpus_per_node != spec.procs_per_node:
        out.append(("spec.resources.gpusPerNode", f"gpusPerNode({spec.resources.gpus_per_node}) must equal "
                    f"procsPerNode({spec.procs_per_node}) (one process per GPU), or be 0 for CPU"))
    if spec.scheduling.queue and spec.scheduling.gang not in QUEUED_GANGS:
        out.append(("spec.scheduling.queue", "queue is Volcano's or KAI's and needs scheduling.gang 'volcano' or "
                    "'kai'"))
    if (topology := spec.scheduling.topology) and (per := topology.ranks_per_domain):
        path = "spec.scheduling.topology.ranksPerDomain"
        if per % spec.procs_per_node:
            out.append((path, f"ranksPerDomain({per}) must be a multiple of procsPerNode({spec.procs_per_node}): "
                        "a domain holds whole pods"))
        if spec.world_size % per:
            out.append((path, f"ranksPerDomain({per}) must divide the gang's nodes({spec.nodes}) x "
                        f"procsPerNode({spec.procs_per_node}) = {spec.world_size} ranks"))
        if manual and per % p.tensor:
            out.append((path, f"ranksPerDomain({per}) must be a multiple of tensor({p.tensor}): a tensor-parallel "
                        "group, whose all-reduces run in every layer, never crosses a domain"))
    out += elastic_problems(spec)
    for dup in _repeated(v.name for v in spec.pod.volumes):
        out.append(("spec.pod.volumes", f"volume name {dup!r} is used more than once"))
    mounts = [v.mount_path for v in spec.pod.volumes]
    for dup in _repeated(mounts):
        out.append(("spec.pod.volumes", f"mountPath {dup} is used by more than one volume"))
    for reserved in RESERVED_MOUNT_PATHS:
        if reserved in mounts:
            out.append(("spec.pod.volumes", f"mountPath {reserved} is reserved by paratrain"))
    for i, vol in enumerate(spec.pod.volumes):
        if vol.name.startswith(RESERVED_VOLUME_PREFIX):
            out.append((f"spec.pod.volumes[{i}].name", f"volume names starting with {RESERVED_VOLUME_PREFIX!r} "
                        "are reserved by paratrain"))
    for field, keys in (("labels", spec.pod.labels), ("annotations", spec.pod.annotations)):
        for key in sorted(k for k in keys if k.startswith(RESERVED_KEY_PREFIX)):
            out.append((f"spec.pod.{field}", f"key {key!r}: keys under {RESERVED_KEY_PREFIX} are reserved by paratrain"))
        for key in sorted(k for k in keys if k.startswith(KUEUE_KEY_PREFIX)):
            out.append((f"spec.pod.{field}", f"key {key!r}: {KUEUE_KEY_MEANING}"))
    for i, env in enumerate(spec.pod.env):
        if is_reserved_env(env.name):
            out.append((f"spec.pod.env[{i}].name", f"{env.name} is reserved: torchrun's rendezvous contract, which "
                        "paratrain sets"))
    for dup in _repeated(e.name for e in spec.pod.env):
        out.append(("spec.pod.env", f"env name {dup!r} is set more than once"))
    r = spec.resources
    if r.gpu_resource in r.extra:
        out.append(("spec.resources.extra", f"{r.gpu_resource} is resources.gpuResource: request it with "
                    "gpusPerNode"))
    if re.match(KUBERNETES_OWNED_RESOURCE, r.gpu_resource):
        out.append(("spec.resources.gpuResource", f"{r.gpu_resource}: {KUBERNETES_OWNED_MEANING}"))
    if owned := [k for k in r.extra if re.match(KUBERNETES_OWNED_RESOURCE, k)]:
        out.append(("spec.resources.extra", f"{owned[0]}: {KUBERNETES_OWNED_MEANING}"))
    if sum(c.provides_gpus for c in r.claims) > 1:
        out.append(("spec.resources.claims", "only one claim can provide the GPUs"))
    for i, spread in enumerate(spec.pod.topology_spread_constraints):
        if spread.min_domains is not None and spread.when_unsatisfiable != "DoNotSchedule":
            out.append((f"spec.pod.topologySpreadConstraints[{i}].minDomains", "minDomains needs "
                        "whenUnsatisfiable DoNotSchedule"))
    if any(c.provides_gpus for c in r.claims) and not r.gpus_per_node:
        out.append(("spec.resources.gpusPerNode", "a claim provides GPUs: gpusPerNode says how many (one per "
                    "process), not 0"))
    for dup in _repeated(c.name for c in r.claims):
        out.append(("spec.resources.claims", f"claim name {dup!r} is used more than once"))
    if spec.entrypoint:
        for section in TRAINER_SECTIONS:
            if getattr(spec, section) != Spec.model_fields[section].default_factory():
                out.append((f"spec.{section}", f"{section} is read only by the built-in trainer: with spec.entrypoint "
                            "your program trains (it gets the layout as PARATRAIN_* env); leave it out"))
        if spec.resources.gpu_memory:
            out.append(("spec.resources.gpuMemory", "the memory model is the built-in trainer's: leave gpuMemory out "
                        "with spec.entrypoint"))
        if spec.restart_policy.in_place_limit:
            out.append(("spec.restartPolicy.inPlaceLimit", IN_PLACE_NEEDS_THE_TRAINER))
    for clash in failure_policy_clashes(spec.failure_policy.rules):
        out.append(("spec.failurePolicy.rules", clash))
    for dup in _repeated(c.name for c in spec.pod.init_containers):
        out.append(("spec.pod.initContainers", f"container name {dup!r} is used more than once"))
    for i, container in enumerate(spec.pod.init_containers):
        if container.name == TRAINER_CONTAINER:
            out.append((f"spec.pod.initContainers[{i}].name", f"{TRAINER_CONTAINER} is the trainer container's name"))
    return out


def elastic_problems(spec: Spec) -> list[tuple[str, str]]:
    """spec.elastic's bounds against the gang (each has a CEL twin)."""
    e, out = spec.elastic, []
    if e is None:
        return out
    if e.min_nodes > spec.nodes:
        out.append(("spec.elastic.minNodes", f"minNodes({e.min_nodes}) must be at most nodes({spec.nodes}): the gang "
                    "starts at nodes and shrinks to minNodes"))
    if e.max_nodes is not None and e.max_nodes < spec.nodes:
        out.append(("spec.elastic.maxNodes", f"maxNodes({e.max_nodes}) must be at least nodes({spec.nodes}): the gang "
                    "starts at nodes and grows to maxNodes"))
    if spec.entrypoint is not None:
        out.append(("spec.elastic", ELASTIC_NEEDS_THE_TRAINER))
    elif not spec.checkpoint.path:
        out.append(("spec.elastic", ELASTIC_NEEDS_A_CHECKPOINT))
    if spec.parallelism.objective == "minGPUs":
        out.append(("spec.elastic", ELASTIC_NOT_WITH_MIN_GPUS))
    return out


def failure_policy_clashes(rules: list[FailurePolicyRule]) -> list[str]:
    """Rules giving one exit code (or pod condition) different actions: for each matcher field, the first rule in
    such a pair, named with the first rule it clashes with (as the CRD's CEL twin names them)."""
    out: list[str] = []
    for field, what in (("exit_codes", "exit code"), ("pod_conditions", "pod condition")):
        def clash(a: FailurePolicyRule, b: FailurePolicyRule) -> bool:
            return a.action != b.action and any(v in getattr(b, field) for v in getattr(a, field))

        first = next((y for y in rules if any(clash(x, y) for x in rules)), None)
        if first is not None:
            other = next(x for x in rules if clash(x, first))
            out.append(f"rules[{rules.index(first)}] and rules[{rules.index(other)}] give one {what} different "
                       f"actions ({first.action} and {other.action}): a failure takes one action")
    return out


def _repeated(items: Iterable[str]) -> list[str]:
    """The values occurring more than once, sorted."""
    seen = list(items)
    return sorted({x for x in seen if seen.count(x) > 1})


class ObjectMeta(BaseModel):
    """Kubernetes' ObjectMeta: name and namespace checked as the operator needs them; its other fields typed only as
    the API server decodes them, and any other key refused, as `kubectl apply` (strict field validation) refuses
    it."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=JOB_NAME, max_length=MAX_NAME_LENGTH)
    namespace: str | None = Field(None, pattern=DNS_LABEL, max_length=63)
    generate_name: str | None = Field(None, alias="generateName")
    uid: str | None = None
    resource_version: str | None = Field(None, alias="resourceVersion")
    generation: int | None = None
    self_link: str | None = Field(None, alias="selfLink")
    creation_timestamp: str | None = Field(None, alias="creationTimestamp")
    deletion_timestamp: str | None = Field(None, alias="deletionTimestamp")
    deletion_grace_period_seconds: int | None = Field(None, alias="deletionGracePeriodSeconds")
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    owner_references: list[dict[str, Any]] | None = Field(None, alias="ownerReferences")
    finalizers: list[str] | None = None
    managed_fields: list[dict[str, Any]] | None = Field(None, alias="managedFields")


class ParallelTrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["paratrain.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["ParallelTrainJob"]
    metadata: ObjectMeta
    spec: Spec  # required, as in the CRD: `spec: {}` is the all-defaults job
    status: dict[str, Any] | None = None

    def dump(self) -> dict[str, Any]:
        return {"apiVersion": self.api_version, "kind": self.kind,
                "metadata": self.metadata.model_dump(mode="json", by_alias=True, exclude_none=True),
                "spec": self.spec.dump()}


def layout_label(spec: Spec) -> str:
    """The layout as a key, e.g. `dp2·tp2·pp2 z1 bf16`: a checkpoint's manifest (parsed back by its sharding) and
    metrics. People read `describe_layout`'s words."""
    p = spec.parallelism
    order = f" {p.rank_order}" if p.replicas_outermost else ""  # tp-dp-pp's labels as before it existed
    return f"dp{p.data}·tp{p.tensor}·pp{p.pipeline} z{p.zero_stage}{order} {spec.precision}"


def describe_layout(spec: Spec) -> str:
    """The layout in words, for `kubectl get ptj` and first lines: `data 2 × tensor 2 × pipeline 2, ZeRO-1, bf16`
    (no ZeRO named where its stage is 0; `bf16, reduced in bf16` where spec.reducePrecision is); `planned (mode
    auto), bf16` until the planner has chosen it."""
    p = spec.parallelism
    precision = spec.precision + (f", reduced in {spec.reduce_precision}" if spec.reduce_precision != "fp32" else "")
    if p.mode == "auto":
        return f"planned (mode auto), {precision}"
    zero = f", ZeRO-{p.zero_stage}" if p.zero_stage else ""
    order = ", ranks tp-pp-dp" if p.replicas_outermost else ""
    return f"data {p.data} × tensor {p.tensor} × pipeline {p.pipeline}{zero}{order}, {precision}"


def is_reserved_env(name: str) -> bool:
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def describe_checkpoints(spec: Spec) -> str:
    """Where and how often a job checkpoints, for its first line."""
    c = spec.checkpoint
    if not c.path:
        return "no checkpoints (spec.checkpoint.path unset): a crash restarts from step 0"
    if c.interval == 0:
        every = "only at the end"
    elif c.interval:
        every = f"every {c.interval} steps"
    else:
        every = f"every {c.interval_minutes:g} minutes of training"
    return f"checkpoints in {c.path} {every}, keeping {c.keep}"
