"""Checkpoints under faults: a crash mid-write never leaves a checkpoint that looks complete, a damaged one is
skipped for the previous good one, and a checkpoint that must not be loaded (another model, metadata that would run
code when unpickled) fails the job with a clear message and is left untouched."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import contract

from ..trainer.harness import assert_close_curves, run_job
from .gang import checkpointed, fault_env


def step_dirs(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def rank_log(tmp: Path, rank: int) -> str:
    return (tmp / "work" / "logs" / f"rank-{rank}.log").read_text()


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("rank,phase", [(1, "file"), (0, "manifest")],
                         ids=["rank1-after-its-file", "rank0-after-the-manifest"])
def test_kill_during_checkpoint_write_resumes_from_the_previous_one(rank, phase, reference, tmp_path):
    straight, _ = reference
    ckpt = tmp_path / "ckpt"
    proc, _ = run_job(tmp_path, checkpointed(ckpt), expect_ok=False, env=fault_env(f"ckpt_crash:{rank}:9:{phase}"))
    assert proc.returncode != 0 and f"rank {rank} exited" in proc.stderr, proc.stderr
    assert step_dirs(ckpt) == [".tmp-step-00000009", "step-00000003", "step-00000006"]
    if phase == "manifest":  # everything written, only the rename missing: still not a checkpoint
        assert step_dirs(ckpt / ".tmp-step-00000009") == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]

    # The rerun checkpoints every 4 steps, so it never writes step 9 again: the debris goes at its first save.
    _, resumed = run_job(tmp_path, checkpointed(ckpt, **{"spec.checkpoint.interval": 4}))
    assert resumed["resumed_from_step"] == 6
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)
    assert step_dirs(ckpt) == ["step-00000003", "step-00000006", "step-00000008", "step-00000012"]


def flip(path: Path) -> None:
    """Invert 16 bytes in the middle of the file (tensor data): the zip archive still opens."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [flip, truncate], ids=["bytes-flipped", "truncated"])
def test_damaged_checkpoints_are_reported_and_skipped(damage, reference, tmp_path):
    straight, reference_ckpt = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_ckpt, ckpt)
    damage(ckpt / "step-00000012" / "__1_0.distcp")  # written by rank 1
    damage(ckpt / "step-00000009" / "__0_0.distcp")

    _, resumed = run_job(tmp_path, checkpointed(ckpt))
    assert resumed["resumed_from_step"] == 6
    assert_close_curves(resumed["losses"], straight["losses"], rtol=1e-6)
    log = rank_log(tmp_path, 0)  # rank 0 reports what every rank found
    assert (f"skipping checkpoint {ckpt / 'step-00000012'}: __1_0.distcp is corrupt or truncated "
            "(checksum mismatch)") in log, log
    assert (f"skipping checkpoint {ckpt / 'step-00000009'}: __0_0.distcp is corrupt or truncated "
            "(checksum mismatch)") in log, log


def test_checkpoint_of_another_model_is_refused(reference, tmp_path):
    """Another layout reshards (tests/trainer/test_reshard.py); another model cannot."""
    _, reference_ckpt = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_ckpt, ckpt)
    before = tree_digest(ckpt)

    proc, metrics = run_job(tmp_path, checkpointed(ckpt, **{"spec.model.embedDim": 64}), expect_ok=False)
    assert proc.returncode == contract.EXIT_INVALID_SPEC, proc.stderr
    assert f"checkpoint {ckpt / 'step-00000012'} does not fit this model (" in proc.stderr, proc.stderr
    assert "tok_emb.weight" in proc.stderr and "give this job a new spec.checkpoint.path" in proc.stderr
    assert "earlier checkpoint" not in proc.stderr  # they were written by the same other model
    assert metrics is None
    assert tree_digest(ckpt) == before, "the other model's checkpoints must be left exactly as they were"


class RunsCode:
    """Unpickling this calls exec(): what a hostile checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def test_checkpoint_that_would_run_code_is_refused_and_kept(reference, tmp_path):
    _, reference_ckpt = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_ckpt, ckpt)
    marker = tmp_path / "code-ran"
    # The newest checkpoint's DCP metadata (a pickle) replaced by a payload, and a manifest vouching for it (a
    # tampered store).
    target = ckpt / "step-00000012" / ".metadata"
    target.write_bytes(pickle.dumps(RunsCode(marker)))
    manifest_path = ckpt / "step-00000012" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][target.name] = hashlib.sha256(target.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    # The file is really hostile: a plain unpickle (what DCP's own reader does) runs its code.
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(target)!r}, 'rb'))"],
                   check=True, capture_output=True)
    assert marker.read_text() == "code ran"
    marker.unlink()
    before = tree_digest(ckpt)

    proc, metrics = run_job(tmp_path, checkpointed(ckpt), expect_ok=False)
    assert not marker.exists(), "the checkpoint's code ran"
    # Not skipped in favour of step 9: the job fails (permanently) and the file stays for inspection.
    assert proc.returncode == contract.EXIT_INVALID_SPEC, proc.stderr
    assert (f"checkpoint {ckpt / 'step-00000012'} refused: UnpicklingError: global builtins.exec is not DCP "
            "metadata") in proc.stderr, proc.stderr
    assert metrics is None
    assert tree_digest(ckpt) == before
