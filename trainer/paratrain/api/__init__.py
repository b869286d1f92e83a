"""The ParallelTrainJob API: typed spec, loading with field-path errors, CRD schema. Imports no torch, no kopf."""

from .load import Problem, SpecError, apply_overrides, load_job, parse_job, read_yaml
from .platform import require_cluster_ready
from .spec import (API_GROUP, API_GROUP_VERSION, API_VERSION, KIND, PLURAL, SHORT_NAME, ParallelTrainJob, Spec,
                   describe_checkpoints, describe_layout, layout_label)

__all__ = [
    "API_GROUP", "API_GROUP_VERSION", "API_VERSION", "KIND", "PLURAL", "SHORT_NAME", "ParallelTrainJob", "Problem",
    "Spec", "SpecError", "apply_overrides", "describe_checkpoints", "describe_layout", "layout_label", "load_job", "parse_job", "read_yaml",
    "require_cluster_ready",
]
