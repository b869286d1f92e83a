"""`paratrain export`: a checkpoint, written by any layout, as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

from ..api import ParallelTrainJob
from .checkpoint import CheckpointModel, newest_sound
from .models.hf import DEFAULT_SHARD_BYTES, export_hf
from .models.hf_config import TOKENIZER_FILE


def export_checkpoint(job: ParallelTrainJob, checkpoint: str | Path, out_dir: str | Path,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str = "fp32") -> tuple[Path, Path, dict]:
    """`paratrain export`: a checkpoint of `job`, written by any layout (a step directory, or the newest sound one
    under a checkpoint.path), as a Hugging Face directory, with the token directory's tokenizer.json if the job
    reads one. Returns the directory, the checkpoint exported and its manifest (step, layout)."""
    data = job.spec.data
    tokenizer = Path(data.path) / TOKENIZER_FILE if data.source == "tokens" and data.path else None
    with newest_sound(checkpoint) as files:  # what was hashed is what is read: the same descriptors
        model = CheckpointModel(files)
        out = export_hf(job, model, out_dir, tokenizer if tokenizer and tokenizer.is_file() else None,
                        max_shard_bytes, dtype)
    return out, files.path, model.manifest
