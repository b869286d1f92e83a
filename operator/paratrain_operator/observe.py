"""What the operator reads: the job, its pods (by label, each parsed into a `PodView`), and rank 0's progress
endpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from paratrain import contract
from paratrain.api import API_GROUP_VERSION, PLURAL
from paratrain.api.status import FAILED, PENDING, SUCCEEDED

from .kube import ApiError, api_path, client

PROGRESS_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
PROGRESS_MAX_BYTES = 64 * 1024  # a progress report is a few hundred bytes
_progress_session: aiohttp.ClientSession | None = None


@dataclass(frozen=True)
class PodView:
    """What the decisions need from one pod."""

    name: str
    attempt: int  # -1 when the label is missing or unreadable: never mistaken for the current attempt
    rank: int
    phase: str = PENDING  # Pending | Running | Succeeded | Failed | Unknown
    terminating: bool = False
    exit_code: int | None = None
    reason: str | None = None  # the pod's (Evicted) or else its container's (Error, OOMKilled)
    message: str | None = None
    finished_at: str | None = None
    waiting: str | None = None  # why it is not running yet (ImagePullBackOff, Unschedulable)
    ip: str | None = None
    termination_message: str | None = None

    @property
    def done(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED)

    @property
    def active(self) -> bool:
        """Still (about to be) running a program, and nobody asked it to stop."""
        return not self.done and not self.terminating


def as_int(value: Any, default: int) -> int:
    """`value` as an int, or `default` when it is missing or unreadable (labels and status are strings)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    statuses = status.get("containerStatuses") or []
    terminated = [s["state"]["terminated"] for s in statuses if (s.get("state") or {}).get("terminated")]
    # The container that failed says why the pod failed; a clean exit only counts if none failed.
    term = next((t for t in terminated if t.get("exitCode")), terminated[0] if terminated else {})
    waiting = next(((s.get("state") or {}).get("waiting") for s in statuses
                    if ((s.get("state") or {}).get("waiting") or {}).get("reason")), None)
    unschedulable = next((c for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    blocker = waiting or unschedulable
    return PodView(
        name=meta.get("name", ""),
        attempt=as_int(labels.get(contract.LABEL_ATTEMPT), -1),
        rank=as_int(labels.get(contract.LABEL_NODE_RANK), -1),
        phase=status.get("phase") or PENDING,
        terminating=bool(meta.get("deletionTimestamp")),
        exit_code=term.get("exitCode"),
        reason=status.get("reason") or term.get("reason"),
        message=status.get("message") or term.get("message"),
        finished_at=term.get("finishedAt") or meta.get("deletionTimestamp"),
        waiting=f"{blocker.get('reason')}: {blocker.get('message', '')}".rstrip(": ") if blocker else None,
        ip=status.get("podIP"),
        termination_message=term.get("message"),
    )


async def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await client().request("GET", api_path(API_GROUP_VERSION, PLURAL, namespace, name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def list_pods(namespace: str, job_name: str, job_uid: str) -> list[dict[str, Any]]:
    """Every pod of the job, any attempt (fresh from the API, not a watch cache: decisions must not act on a
    stale view, e.g. create a gang while the old one is still terminating). Only pods the job owns: those of a
    same-named job deleted moments ago carry the same label and names, but are not this job's to count."""
    data = await client().request("GET", api_path("v1", "pods", namespace),
                                  params={"labelSelector": f"{contract.LABEL_JOB}={job_name}"})
    return [pod for pod in (data or {}).get("items") or []
            if any(ref.get("uid") == job_uid for ref in pod["metadata"].get("ownerReferences") or [])]


async def fetch_progress(pod_ip: str, port: int = contract.PROGRESS_PORT) -> Any:
    """Rank 0's `GET /progress` JSON, or None when it does not answer (starting, hung, gone) or answers more than
    PROGRESS_MAX_BYTES (the pod runs user code): pods need no API credentials to report progress. One HTTP session
    serves every job's reads."""
    global _progress_session
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod IPs
    url = f"http://{host}:{port}/progress"
    if _progress_session is None or _progress_session.closed:
        _progress_session = aiohttp.ClientSession(timeout=PROGRESS_TIMEOUT)
    try:
        async with _progress_session.get(url) as response:
            body = await response.content.read(PROGRESS_MAX_BYTES + 1)
            if response.status != 200 or len(body) > PROGRESS_MAX_BYTES:
                return None
            return json.loads(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def close() -> None:
    """Close the progress reads' session (at operator shutdown)."""
    if _progress_session is not None:
        await _progress_session.close()
