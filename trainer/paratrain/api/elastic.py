"""Elastic gangs, pure: the sizes a job's gang may take (spec.elastic) and the job at each of them.

A resize keeps what the model needs and the optimizer sees: tensor x pipeline (every replica whole), the micro-batch
each rank computes (its memory) and the global batch in sequences, so gradient accumulation makes up for the
data-parallel replicas gone. A step at any size then averages the same sequences as at the job's own size, and
the checkpoint reshards into the new layout: the loss curve goes on as the smaller layout's would. Under mode auto
a size only sets the gang's nodes: the planner lays each size out afresh (paratrain_operator.planning), the global
batch its own to keep.
"""

from __future__ import annotations

from collections.abc import Callable

from .spec import ElasticSpec, Spec, cross_field_problems

MAX_ACCUMULATION = 1024  # spec.training.gradientAccumulation's bound


def bounds(spec: Spec) -> tuple[int, int]:
    """(fewest, most) pods the gang may have: spec.elastic's, or spec.nodes alone."""
    e = spec.elastic
    if e is None:
        return spec.nodes, spec.nodes
    return e.min_nodes, e.max_nodes or spec.nodes


def resized(spec: Spec, nodes: int) -> Spec | None:
    """`spec` as a gang of `nodes` pods, or None where no layout at that size keeps tensor x pipeline, the
    micro-batch and the global batch (and passes every cross-field rule). Under mode auto only the size changes."""
    if nodes == spec.nodes:
        return spec
    if spec.parallelism.mode == "auto":
        out = spec.model_copy(update={"nodes": nodes, "elastic": _bounds_kept(spec)})
        return None if cross_field_problems(out) else out
    p, t = spec.parallelism, spec.training
    model_parallel, world = p.tensor * p.pipeline, nodes * spec.procs_per_node
    micro = t.batch_size // (p.data * t.gradient_accumulation)  # sequences a rank computes per micro-step
    if world % model_parallel or t.batch_size % (world // model_parallel * micro):
        return None
    data = world // model_parallel
    accumulation = t.batch_size // (data * micro)
    if accumulation > MAX_ACCUMULATION or (p.zero_stage and data < 2):
        return None
    out = spec.model_copy(update={
        "nodes": nodes, "parallelism": p.model_copy(update={"data": data}), "elastic": _bounds_kept(spec),
        "training": t.model_copy(update={"gradient_accumulation": accumulation})})
    return None if cross_field_problems(out) else out


def _bounds_kept(spec: Spec) -> ElasticSpec | None:
    """spec.elastic with maxNodes stated: a resized spec keeps the bounds of the job's own."""
    e = spec.elastic
    return e.model_copy(update={"max_nodes": bounds(spec)[1]}) if e else None


def sizes(spec: Spec) -> tuple[int, ...]:
    """Every size the gang may take, smallest first (spec.nodes always among them)."""
    low, high = bounds(spec)
    return tuple(n for n in range(low, high + 1) if n == spec.nodes or resized(spec, n) is not None)


def largest_within(spec: Spec, most: int, least: int = 0, fits: Callable[[int], bool] = lambda n: True
                   ) -> int | None:
    """The largest size the gang may take that is at most `most`, above `least` and `fits` (under mode auto: one
    the planner finds a layout for); None if there is none."""
    return next((n for n in sorted(sizes(spec), reverse=True) if least < n <= most and fits(n)), None)


def problem(spec: Spec) -> str | None:
    """Why spec.elastic cannot resize this gang (no other size keeps its layout), with what would; None if it can
    (under mode auto the planner judges each size when the gang resizes)."""
    if spec.elastic is None or spec.parallelism.mode == "auto" or len(sizes(spec)) > 1:
        return None
    p, t = spec.parallelism, spec.training
    low, high = bounds(spec)
    return (f"no gang size from minNodes({low}) to {high} other than nodes({spec.nodes}) keeps tensor({p.tensor}) x "
            f"pipeline({p.pipeline}) whole and the global batch ({t.batch_size} sequences, "
            f"{t.batch_size // (p.data * t.gradient_accumulation)} per rank and micro-step): its data-parallel "
            "degree must divide the batch into whole micro-steps; widen minNodes..maxNodes or choose a batchSize "
            "with more divisors")
