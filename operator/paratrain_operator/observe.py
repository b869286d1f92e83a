"""What the operator reads: the job, its pods (by label), and rank 0's progress endpoint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from paratrain import contract
from paratrain.api import API_GROUP_VERSION, PLURAL

from .kube import ApiError, api_path, client

PROGRESS_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
PROGRESS_MAX_BYTES = 64 * 1024  # a progress report is a few hundred bytes
_progress_session: aiohttp.ClientSession | None = None


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
