"""Checkpoints that a crash can never leave looking complete, loaded without unpickling arbitrary objects.

Layout: `<path>/step-00000100/{rank-00000.pt, ..., manifest.json}`. Every rank writes its own state under a
hidden `.tmp-step-*` directory (file written, fsynced, renamed); rank 0 then writes the manifest (with each file's
SHA-256) and renames the directory into place — one atomic rename is what makes a checkpoint exist. On start,
every rank checks its own file of the newest candidate against the manifest; the newest checkpoint that every
rank accepts wins, and a corrupt or truncated one is reported and skipped. Files are read with
`torch.load(weights_only=True)`: tensors and plain containers only.

Two things fail the job instead of being skipped (CheckpointError, exit 2), because skipping would let the next
saves overwrite what the user still needs: a checkpoint written by another layout (training from scratch would
replace that run's checkpoints), and a file whose checksum matches but which holds other objects than tensors
(not corruption but a foreign or tampered writer; the file is kept for inspection).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("paratrain.checkpoint")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that must neither be loaded nor silently replaced."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _to_local(obj: Any) -> Any:
    """DTensors become the shard this rank holds; the layout check on load makes that sufficient."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _sharding(layout: str) -> str:
    """A layout label without its precision (`dp2·tp2·pp1 z1 bf16` → `dp2·tp2·pp1 z1`): how the state is split over
    ranks, all a checkpoint's files depend on. Every engine keeps fp32 master weights and optimizer state in every
    precision, so a run may resume under another precision (say bf16 after fp16 overflow trouble)."""
    return layout.rpartition(" ")[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_manifest(ckpt: Path) -> dict | None:
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Checkpointer:
    root: Path
    rank: int
    world_size: int
    layout: str  # layout_label: a checkpoint only loads into the layout that wrote it (per-rank shards), any precision
    keep: int = 2

    def save(self, step: int, state: dict, meta: dict) -> Path:
        """Collective: every rank calls it. `meta` (rank 0's) goes into the manifest."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for debris in self.root.glob(".tmp-step-*"):  # of a crash mid-write, at whatever step
                shutil.rmtree(debris, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        target = tmp / rank_file_name(self.rank)
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as f:
            torch.save(_to_local(state), f)
            f.flush()
            os.fsync(f.fileno())
        partial.rename(target)
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (rank_file_name(self.rank), _sha256(target)))
        if self.rank == 0:
            manifest = {"format": FORMAT_VERSION, "step": step, "worldSize": self.world_size, "layout": self.layout,
                        "files": dict(digests), **meta}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        for old in self.candidates()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def candidates(self) -> list[Path]:
        """Directories that look like finished checkpoints, newest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step-*") if (p / MANIFEST).is_file()), reverse=True)

    def _check_layout(self, ckpt: Path, manifest: dict) -> None:
        """Raise on every rank (they read the same manifest) if `ckpt` is of another layout."""
        written_by = str(manifest.get("layout"))
        if manifest.get("worldSize") != self.world_size or _sharding(written_by) != _sharding(self.layout):
            raise CheckpointError(
                f"spec.checkpoint.path: checkpoint {ckpt} was written by layout {written_by} on "
                f"{manifest.get('worldSize')} ranks, but this job is {self.layout} on {self.world_size} ranks; "
                "per-rank checkpoints only load into the layout that wrote them (of any precision). Run that layout "
                "again, or give this job a new checkpoint.path (training from scratch here would replace those "
                "checkpoints).")

    def _check_own_file(self, ckpt: Path, manifest: dict | None) -> str | None:
        """None if this rank's file of `ckpt` is sound, else the reason it is not."""
        if manifest is None:
            return "unreadable manifest"
        name = rank_file_name(self.rank)
        expected = manifest.get("files", {}).get(name)
        path = ckpt / name
        if expected is None or not path.is_file():
            return f"{name} missing"
        if _sha256(path) != expected:
            return f"{name} is corrupt or truncated (checksum mismatch)"
        return None

    def _load_own_file(self, ckpt: Path) -> tuple[dict | None, str | None]:
        """Onto the CPU whatever the training device: RNG states must be CPU tensors (torch.set_rng_state and
        torch.cuda.set_rng_state refuse others), and the engines copy the rest onto their parameters' device."""
        path = ckpt / rank_file_name(self.rank)
        try:
            return torch.load(path, map_location="cpu", weights_only=True), None
        except pickle.UnpicklingError as exc:
            # torch's message goes on to suggest weights_only=False; only its reason is worth repeating.
            reason = str(exc).partition("WeightsUnpickler error: ")[2].split(". ")[0] or "not a weights-only file"
            return None, (f"{path.name} holds objects other than tensors and plain containers ({reason}); "
                          "refusing to unpickle it")

    def _every_rank(self, problem: str | None) -> list[str]:
        """Collective: every rank's problem, as `rank N: ...`, the same list on every rank (empty: all fine)."""
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        return [f"rank {r}: {p}" for r, p in enumerate(problems) if p]

    def load_latest(self) -> tuple[dict, dict] | None:
        """Collective: (this rank's state, manifest) of the newest checkpoint every rank accepts, or None."""
        for ckpt in self.candidates():
            manifest = _read_manifest(ckpt)
            if manifest is not None:
                self._check_layout(ckpt, manifest)
            problems = self._every_rank(self._check_own_file(ckpt, manifest))
            if problems:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", ckpt, "; ".join(problems))
                continue
            state, refusal = self._load_own_file(ckpt)
            refusals = self._every_rank(refusal)
            if refusals:
                raise CheckpointError(f"checkpoint {ckpt} refused: {'; '.join(refusals)}. It is left in place; "
                                      "move it away to resume from an earlier checkpoint.")
            return state, manifest
        return None


def restore_into(module: torch.nn.Module, optimizer: Any, state_model: dict, state_optim: dict) -> None:
    """Load per-rank local tensors back into (possibly DTensor) parameters and optimizer state."""
    with torch.no_grad():
        own = module.state_dict()
        missing = set(own) - set(state_model)
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:3]}")
        for name, value in own.items():
            target = value.to_local() if isinstance(value, DTensor) else value
            target.copy_(state_model[name])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, st in state_optim.get("state", {}).items():
        p = params[int(idx)]
        if isinstance(p, DTensor):
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)
    optimizer.load_state_dict(state_optim)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
