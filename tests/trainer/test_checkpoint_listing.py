"""Two ranks whose views of the checkpoint directory differ, as on a network filesystem whose listings lag: rank 1
does not see one file of the save it is committing, nor the newest checkpoint. Rank 0's listing is the one every
rank works from, so every file is hashed into the manifest and both ranks resume from the same checkpoint (with a
listing of its own, rank 1 left a file unhashed, and, seeing no checkpoint, skipped the collective rank 0 waited in).
Two gloo processes, spawned."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.train import checkpoint
from paratrain.train.checkpoint import MANIFEST, Checkpointer

from .harness import spawn_ranks

LAYOUT = "dp2·tp1·pp1 z0 fp32"


def lagging_listing(rank: int) -> None:
    """Rank 1's directory listings miss rank 0's DCP file and every finished checkpoint directory."""
    if rank != 1:
        return
    iterdir, glob = Path.iterdir, Path.glob
    Path.iterdir = lambda self: (p for p in iterdir(self) if p.name != "__0_0.distcp")  # type: ignore[method-assign]
    Path.glob = lambda self, pattern: (p for p in glob(self, pattern)  # type: ignore[method-assign]
                                       if not p.name.startswith("step-"))


def worker(rank: int, root: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.FileStore(os.path.join(out, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    ckpt = Checkpointer(Path(root), rank=rank, world_size=2, layout=LAYOUT)
    lagging_listing(rank)
    state = {"engine.model.w": torch.full((4,), float(rank + 1)), f"rank.{rank:05d}.x": torch.tensor([rank])}
    ckpt.save(5, state, {})
    found = ckpt.latest()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found[0].name if found else None))
    dist.destroy_process_group()


def test_every_rank_works_from_rank_0s_listing(tmp_path: Path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    spawn_ranks(worker, 2, str(root), str(out))
    step = root / checkpoint.step_dir_name(5)
    manifest = json.loads((step / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in step.iterdir()} - {MANIFEST}  # every file hashed
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] == [step.name, step.name]
