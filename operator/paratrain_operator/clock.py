"""Timestamps as Kubernetes writes them: UTC, whole seconds, `Z` suffix (RFC 3339)."""

from __future__ import annotations

from datetime import datetime, timezone


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def to_iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str | None) -> datetime | None:
    """Parse an RFC 3339 timestamp (`Z` or an offset, fractions allowed); None for missing or unreadable text."""
    if not text or not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
