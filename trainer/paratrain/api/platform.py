"""What a platform team decides for every job the operator runs: which host access pods may ask for, and the
NetworkPolicy each gang gets.

The operator reads it from `--platform FILE` (the Helm chart writes that file from its `platform` values);
`paratrain validate` and `paratrain render` take the same `--platform FILE`. Without one: the defaults below,
the restricted Pod Security profile's answer (no host access) and a NetworkPolicy per gang.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from .spec import DNS_LABEL, LabelKey, LabelValue, Spec, _Model

# The operator's pods as the Helm chart labels them (release `paratrain`, chart name `paratrain`).
CHART_OPERATOR_LABELS = {"app.kubernetes.io/name": "paratrain", "app.kubernetes.io/instance": "paratrain",
                         "app.kubernetes.io/component": "operator"}


class GangNetworkPolicy(_Model):
    enabled: bool = Field(True, description=(
        "Give every gang a NetworkPolicy: traffic between its own pods allowed, the operator's pods allowed to "
        "the progress port, all other ingress denied."))
    operator_namespace: str = Field("paratrain-system", pattern=DNS_LABEL, max_length=63, description=(
        "The namespace the operator's pods run in."))
    operator_labels: dict[LabelKey, LabelValue] = Field(
        default_factory=lambda: dict(CHART_OPERATOR_LABELS), min_length=1, max_length=16,
        description="Labels that select the operator's pods there.")


class Platform(_Model):
    allow_ipc_lock: bool = Field(False, description=(
        "Jobs may add the IPC_LOCK capability (spec.pod.ipcLock), which GPUDirect RDMA needs to pin memory."))
    allow_host_network: bool = Field(False, description=(
        "Jobs may use the node's network namespace (spec.pod.hostNetwork), for RDMA fabrics without a CNI."))
    network_policy: GangNetworkPolicy = Field(default_factory=GangNetworkPolicy)


def load_platform(path: str | Path) -> Platform:
    """The platform file, or SpecError naming what is wrong with it."""
    from .load import Problem, SpecError

    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        return Platform.model_validate(doc)
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError([Problem(str(path), f"cannot read the platform file: {exc}")]) from None
    except ValidationError as exc:
        raise SpecError([Problem(f"{path}: " + ".".join(map(str, e["loc"])), e["msg"]) for e in exc.errors()]) from None


def platform_problems(spec: Spec, platform: Platform) -> list[tuple[str, str]]:
    """Host access the job asks for and the platform does not allow, as (field path, message)."""
    out = []
    if spec.pod.ipc_lock and not platform.allow_ipc_lock:
        out.append(("spec.pod.ipcLock", "the platform does not allow the IPC_LOCK capability (the operator's "
                    "platform.allowIpcLock, a Helm value)"))
    if spec.pod.host_network and not platform.allow_host_network:
        out.append(("spec.pod.hostNetwork", "the platform does not allow host networking (the operator's "
                    "platform.allowHostNetwork, a Helm value)"))
    return out
