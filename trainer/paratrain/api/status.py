"""The ParallelTrainJob status: what the operator writes and `kubectl get ptj` shows.

The CRD's status schema is generated from these models (paratrain.api.crd), so the operator and the CRD cannot
disagree on a field name: build a `JobStatus` and patch `status` with `JobStatus.dump()`. Every field is optional
and has no default, so a patch carries only what it sets (a merge patch leaves the rest alone).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[str, ...] = typing.get_args(Phase)
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, SUSPENDED = PHASES


class _StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


class Condition(_StatusModel):
    """Kubernetes' condition shape (metav1.Condition); one entry per type, e.g. Running, Stalled, Failed."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(None, max_length=1024, description="CamelCase, e.g. GangRestarted.")
    message: str | None = Field(None, max_length=32768)
    last_transition_time: datetime | None = None
    observed_generation: int | None = Field(None, ge=0)


class PodCounts(_StatusModel):
    """The current gang attempt's pods by phase."""

    expected: int | None = Field(None, ge=0, description=(
        "Pods in the gang: spec.nodes, or an elastic gang's size now (status.nodes)."))
    pending: int | None = Field(None, ge=0)
    running: int | None = Field(None, ge=0)
    succeeded: int | None = Field(None, ge=0)
    failed: int | None = Field(None, ge=0)
    terminating: int | None = Field(None, ge=0, description="Pods of any attempt being deleted.")


class Failure(_StatusModel):
    """Why the job (or the last gang attempt) failed: the first pod that failed, or the job-level reason."""

    pod: str | None = Field(None, max_length=253, description="Name of the first pod that failed.")
    exit_code: int | None = Field(None, description="Exit code of its trainer container.")
    reason: str | None = Field(None, max_length=1024,
                               description="e.g. OOMKilled, Error, DeadlineExceeded, BackoffLimitExceeded.")
    message: str | None = Field(None, max_length=32768)


class RankFailure(_StatusModel):
    """A rank whose exit ended an in-place round, as rank 0 of the next round reports it."""

    rank: int | None = Field(None, ge=0)
    node_rank: int | None = Field(None, ge=0, description="Its pod's rank in the gang.")
    exit_code: int | None = None


class ReplacingPod(_StatusModel):
    """A lost pod being recreated alone (its peers' ranks wait in place): its rank, and the uid of the pod lost, so
    that its replacement (same name, another uid) is told apart from it."""

    node_rank: int = Field(ge=1)
    lost_uid: str = Field("", max_length=64, description="Empty where the pod was gone before it was seen lost.")


class Resize(_StatusModel):
    """One resize of an elastic gang (spec.elastic): when, from and to how many pods, why, and what it cost."""

    time: datetime
    attempt: int = Field(ge=0, description="The gang attempt it started (a resize is a fresh gang).")
    from_nodes: int = Field(ge=1)
    to_nodes: int = Field(ge=1)
    reason: Literal["Shrunk", "Grown"]
    message: str = Field("", max_length=1024)
    at_step: int | None = Field(None, ge=0, description="The step rank 0 last reported before it.")
    resumed_from_step: int | None = Field(None, ge=0, description="The step the resized gang resumed from.")
    steps_lost: int | None = Field(None, ge=0, description=(
        "Steps trained before the resize and trained again after it: atStep - resumedFromStep (0 where the step "
        "in flight was saved, as when growing)."))


class DomainRanks(_StatusModel):
    """The node ranks placed in one domain of spec.scheduling.topology.level."""

    domain: str = Field(max_length=63, description="The nodes' label value; empty: nodes without the label.")
    node_ranks: str = Field(max_length=256, description="e.g. `0-15,32`; cut short (…) for a scattered gang.")


class Placement(_StatusModel):
    """Where a gang with spec.scheduling.topology landed, read when it starts running."""

    attempt: int = Field(ge=0)
    level: str = Field(max_length=317)
    domains: list[DomainRanks] = Field(default_factory=list, max_length=32, description=(
        "Each domain's node ranks, by first rank (the first 32 domains)."))
    split_groups: int = Field(0, ge=0, description=(
        "Groups (ranksPerDomain's, or the whole gang) whose pods landed in more than one domain; an Event "
        "SplitAcrossDomains names their ranks and the step time the planner predicts it costs."))


class Progress(_StatusModel):
    """Training progress reported by rank 0 (read by the operator; pods hold no API credentials)."""

    step: int | None = Field(None, ge=0)
    start_step: int | None = Field(None, ge=0, description=(
        "The step this run started from (its checkpoint's); equal to totalSteps: nothing was trained."))
    total_steps: int | None = Field(None, ge=0)
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_second: int | None = Field(None, ge=0, description="Whole tokens a second, the last interval's.")
    eta_seconds: float | None = Field(None, ge=0)
    updated_at: datetime | None = Field(None, description="When rank 0 last reported; drives the Stalled condition.")
    phase: Literal["starting", "training", "done"] | None = Field(None, description="The trainer's own phase.")
    restarts_in_place: int | None = Field(None, ge=0, description=(
        "The current attempt's in-place restarts (every rank restarted in the same pods)."))
    last_failure: RankFailure | None = Field(None, description="The rank whose exit caused the latest of them.")
    peak_memory_bytes: int | None = Field(None, ge=0, description=(
        "The largest rank's peak of device memory (CUDA's max_memory_allocated) after the first steps; CPU ranks "
        "do not report it."))


class PlanLayout(_StatusModel):
    """The layout parallelism mode auto chose, by its spec fields: what the gang's pods run."""

    nodes: int = Field(ge=1)
    data: int = Field(ge=1)
    tensor: int = Field(ge=1)
    pipeline: int = Field(ge=1)
    zero_stage: int = Field(ge=0, le=3)
    pipeline_schedule: Literal["GPipe", "1F1B"]
    microbatches: int = Field(ge=1)
    activation_checkpointing: Literal["none", "full", "selective"]
    gradient_accumulation: int = Field(ge=1)
    rank_order: Literal["tp-dp-pp", "tp-pp-dp"] = "tp-dp-pp"  # spec.parallelism.rankOrder (absent before it existed)


class Plan(_StatusModel):
    """What parallelism mode auto chose, for what, what it predicted, and what the gang then measured."""

    summary: str | None = Field(None, max_length=512, description=(
        "The layout in words, e.g. `data 8 x tensor 2 x pipeline 1, ZeRO-1, selective activation checkpointing on "
        "2 node(s)`."))
    layout: PlanLayout | None = None
    accelerator: str | None = Field(None, max_length=64, description="The GPU it was planned for (catalogue name).")
    source: str | None = Field(None, max_length=512, description=(
        "Where the GPU came from: the nodes' GPU Feature Discovery labels, the platform's planner.gpu, or CPU pods."))
    attempt: int | None = Field(None, ge=0, description="The gang attempt it was planned for (restarts re-plan).")
    objective: str | None = Field(None, max_length=32)
    considered: int | None = Field(None, ge=0, description="Layouts the planner judged.")
    feasible: int | None = Field(None, ge=0, description="Of them, those within the rules and the memory budget.")
    memory_budget_bytes: int | None = Field(None, ge=0, description="What a rank's predicted peak could use.")
    predicted_peak_bytes: int | None = Field(None, ge=0, description="The largest rank's predicted peak.")
    predicted_step_seconds: float | None = Field(None, ge=0)
    predicted_tokens_per_second: int | None = Field(None, ge=0)
    memory_band: float | None = Field(None, ge=0, description="The memory model's tested error, as a share.")
    time_band: float | None = Field(None, ge=0, description="The time model's error, as a share.")
    alternatives: list[Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=3, description=(
        "The next best layouts and why each lost."))
    measured_at_step: int | None = Field(None, ge=0, description=(
        "The step of the measurement below (taken once the gang has trained a few steps)."))
    measured_tokens_per_second: int | None = Field(None, ge=0)
    measured_peak_bytes: int | None = Field(None, ge=0, description=(
        "The largest rank's peak of device memory (CUDA's max_memory_allocated; CPU ranks do not measure it)."))
    tokens_per_second_error: float | None = Field(None, description="measured / predicted - 1.")
    peak_error: float | None = Field(None, description="measured / predicted - 1.")


class JobStatus(_StatusModel):
    """What the operator observed; its words (gang, attempt, round, stop, exit codes): docs/operator.md, glossary."""

    phase: Phase | None = None
    reason: str | None = Field(None, max_length=1024, description="CamelCase reason for the phase.")
    message: str | None = Field(None, max_length=32768, description=(
        "Why the job is in its phase, for people (its words: docs/operator.md, \"Words the Events and status use\")."))
    layout: str | None = Field(None, max_length=256, description="The layout in words, e.g. `data 2 × tensor 2 × pipeline 2, ZeRO-1, bf16`.")
    platform_defaults: list[Annotated[str, Field(max_length=128)]] | None = Field(None, max_length=32, description=(
        "The spec fields the platform's jobDefaults filled in (the operator's --platform file), e.g. spec.image."))
    progress_text: str | None = Field(None, max_length=64, description="`step/totalSteps`, e.g. `120/2000`.")
    conditions: list[Condition] | None = Field(None, max_length=32)
    observed_generation: int | None = Field(None, ge=0)
    pods: PodCounts | None = None
    restarts: int | None = Field(None, ge=0, description="Failure-triggered gang restarts so far (counted against "
                                 "runPolicy.backoffLimit).")
    in_place_restarts: int | None = Field(None, ge=0, description=(
        "In-place restarts so far, every attempt's (each attempt allows spec.restartPolicy.inPlaceLimit; not "
        "counted against runPolicy.backoffLimit)."))
    attempt_in_place_restarts: int | None = Field(None, ge=0, description="The current attempt's in-place restarts.")
    pod_replacements: int | None = Field(None, ge=0, description=(
        "Pods replaced alone so far, every attempt's: a pod lost (deleted, evicted, its node gone) recreated while "
        "the other pods' ranks waited in place (spec.restartPolicy.inPlaceLimit > 0); not counted against "
        "runPolicy.backoffLimit."))
    attempt_pod_replacements: int | None = Field(None, ge=0, description="The current attempt's pod replacements.")
    replacing: list[ReplacingPod] | None = Field(None, max_length=4096, description=(
        "The pods being replaced now, until each replacement runs."))
    failures_in_a_row: int | None = Field(None, ge=0, description=(
        "Gang restarts since rank 0 last reported a step trained: the second and later wait restartNotBefore."))
    restart_not_before: datetime | None = Field(None, description=(
        "The restarted gang's pods are created no sooner (10 s, doubling to 6 min with failuresInARow)."))
    uncounted_restarts: int | None = Field(None, ge=0, description=(
        "Gang restarts not counted against backoffLimit (stops, Ignore rules); limit runPolicy.maxUncountedRestarts."))
    start_timeouts: int | None = Field(None, ge=0, description=(
        "Attempts ended because their gang was not running in startTimeoutSeconds; limit startAttempts."))
    attempt: int | None = Field(None, ge=0, description="Current gang attempt, part of pod names; bumped by every "
                                "gang restart and by resuming a suspended job.")
    gang_created: bool | None = Field(None, description="Every pod of the current attempt has been seen; a pod "
                                      "missing after that was deleted.")
    start_time: datetime | None = None
    attempt_start_time: datetime | None = Field(None, description=(
        "When the current attempt began creating its pods (under Kueue: its admission); "
        "spec.scheduling.startTimeoutSeconds runs from it."))
    completion_time: datetime | None = None
    failure: Failure | None = None
    last_stop: Failure | None = Field(None, description=(
        "The latest stop from outside the gang restarted from without counting it (a pod deleted: a drain, a "
        "preemption, by hand; or exit 76): kept apart from failure, since a stop is not a failure."))
    progress: Progress | None = None
    # What `kubectl get ptj` shows, as people read it (printer columns cannot format a number).
    restarts_text: str | None = Field(None, max_length=128, description=(
        "Restarts of every kind: the gang restarts counted against backoffLimit, then in brackets those in place, "
        "the pods replaced alone and the gang restarts not counted (stops), e.g. `1 (2 in place)`."))
    loss_text: str | None = Field(None, max_length=32, description="The training loss to four significant digits.")
    eta: str | None = Field(None, max_length=32, description="Time left while training, e.g. `12m30s`.")
    failure_reason: str | None = Field(None, max_length=1024, description=(
        "Why the job failed, only once it has (a running or finished job's earlier failures: lastRestartReason, "
        "failure, Events)."))
    last_restart_reason: str | None = Field(None, max_length=1024, description=(
        "Why the gang last restarted (a pod's failure, a stop from outside, a start timeout)."))
    last_restart_time: datetime | None = Field(None, description="When the gang last restarted.")
    plan: Plan | None = Field(None, description=(
        "What parallelism mode auto chose (the pods run it), its predictions and, after a few steps, the "
        "measurements beside them."))
    resumed_from_step: int | None = Field(None, ge=0, description=(
        "The step this attempt's ranks resumed from (their newest checkpoint; 0: from scratch), as its rank 0 said."))
    nodes: int | None = Field(None, ge=1, description=(
        "Pods in the current gang attempt, for an elastic job (spec.elastic): the size it last resized to."))
    resizes: list[Resize] | None = Field(None, max_length=16, description=(
        "An elastic gang's resizes, the latest 16, oldest first."))
    placement: Placement | None = Field(None, description=(
        "A gang with spec.scheduling.topology: each domain's node ranks, and the groups split across domains."))
    # kopf keeps its handler bookkeeping under status.kopf; declared so the API server does not prune it.
    kopf: dict[str, Any] | None = None


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, the cut marked."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def fit_to_schema(model: type[BaseModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (keyed by alias) with every string clipped to its field's maxLength, nested models and lists of them
    included: a status that outgrew its schema would be refused whole, so the pass that writes it would fail."""
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    out = dict(data)
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            continue
        limit = next((m.max_length for m in field.metadata if hasattr(m, "max_length")), None)
        nested = next((t for t in _leaf_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)),
                      None)
        if isinstance(value, str) and limit is not None:
            out[key] = clip(value, limit)
        elif nested and isinstance(value, Mapping):
            out[key] = fit_to_schema(nested, value)
        elif nested and isinstance(value, list):
            out[key] = [fit_to_schema(nested, v) if isinstance(v, Mapping) else v for v in value]
    return out


def _leaf_types(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    return [leaf for arg in args for leaf in _leaf_types(arg)] if args else [annotation]


def progress_text(step: int, total_steps: int) -> str:
    """The printer column's `step/total`, e.g. `120/2000`."""
    return f"{step}/{total_steps}"
