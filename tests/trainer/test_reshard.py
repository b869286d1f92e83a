"""Checkpoints reshard: one written by a layout resumes in another (tp/pp/dp degrees, ZeRO stage, DeepSpeed or
torch-native, world size) and goes on as a run of that layout would have. Every layout starts from the same weights
(same seed), so after the resume at step 5, steps 6-10 must match a run in the new layout all along."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from paratrain.train.checkpoint import full_model_state
from paratrain.train.models.gpt import GPT, GPTConfig

from .harness import TINY_JOB, assert_close_curves, layout, run_job

RESUME_STEP = 5


def checkpointed(ckpt: Path, **sets) -> list[str]:
    """10 steps, a checkpoint every 5 into `ckpt` (steps 5 and 10 kept)."""
    sets = {"spec.checkpoint.path": ckpt, "spec.checkpoint.interval": RESUME_STEP, "spec.checkpoint.keep": 2, **sets}
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run directory, metrics) of a 10-step run checkpointing into <run directory>/ckpt, each run once
    per module."""
    done: dict[str, tuple[Path, dict]] = {}

    def get(name: str, overrides: list[str], **sets) -> tuple[Path, dict]:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name)
            _, metrics = run_job(run_dir, overrides + checkpointed(run_dir / "ckpt", **sets))
            done[name] = run_dir, metrics
        return done[name]

    return get


LAYOUTS = {
    "dp1": layout(),
    "dp2": layout(data=2),  # writes its checkpoints asynchronously
    "tp2": layout(tensor=2),
    "pp2": layout(pipeline=2, microbatches=2),
    "dp2-zero2-deepspeed": layout(data=2, zeroStage=2),
    "dp2-zero3-deepspeed": layout(data=2, zeroStage=3),
    "dp2xtp2": layout(data=2, tensor=2),
    "dp2xtp2-zero1": layout(data=2, tensor=2, zeroStage=1),  # torch-native: optimizer state gathered at save
}
ASYNC = {"dp2": {"spec.checkpoint.asyncSave": "true"}}


def straight(runs, name: str) -> tuple[Path, dict]:
    return runs(name, LAYOUTS[name], **ASYNC.get(name, {}))


def resumed(runs, tmp_path: Path, written_by: str, name: str) -> dict:
    """Layout `name` started on a copy of `written_by`'s checkpoints without its step-10 one."""
    source, _ = straight(runs, written_by)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source / "ckpt", ckpt)
    shutil.rmtree(ckpt / "step-00000010")
    _, metrics = run_job(tmp_path, LAYOUTS[name] + checkpointed(ckpt, **ASYNC.get(name, {})))
    return metrics


# DeepSpeed reads each rank's flat range of every tensor (partial_read.FlatRange): from TP shards (a range crosses
# the chunks they were saved in) and from composed ZeRO-1, for a ZeRO-3 and a ZeRO-2 partition.
@pytest.mark.parametrize("written_by,name", [("dp2", "tp2"), ("dp2-zero3-deepspeed", "dp1"), ("pp2", "dp2"),
                                              ("dp2xtp2-zero1", "pp2"), ("tp2", "dp2xtp2-zero1"),
                                              ("tp2", "dp2-zero3-deepspeed"), ("dp2xtp2-zero1", "dp2-zero2-deepspeed")])
def test_checkpoint_resumes_in_another_layout(written_by, name, runs, tmp_path):
    _, reference = straight(runs, name)
    metrics = resumed(runs, tmp_path, written_by, name)
    assert metrics["resumed_from_step"] == RESUME_STEP
    assert metrics["layout"] == reference["layout"]
    assert_close_curves(metrics["losses"][RESUME_STEP:], reference["losses"][RESUME_STEP:], rtol=1e-4)
    assert metrics["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-4)


@pytest.mark.parametrize("name", ["dp2", "dp2xtp2-zero1", "dp2-zero3-deepspeed"])
def test_checkpoint_resumes_exactly_in_its_own_layout(name, runs, tmp_path):
    """dp2 writes asynchronously; composed ZeRO-1 gathers each parameter's optimizer state at save and slices this
    rank's shard out again at load; DeepSpeed ZeRO-3 reads back each rank's partition alone, padding included."""
    _, reference = straight(runs, name)
    metrics = resumed(runs, tmp_path, name, name)
    assert metrics["resumed_from_step"] == RESUME_STEP
    assert metrics["losses"] == reference["losses"]
    assert metrics["grad_norms"] == reference["grad_norms"]
    assert metrics["val_loss"] == reference["val_loss"]


def checkpoint_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.distcp"))


def test_data_parallel_replicas_write_one_copy(runs):
    """DP2 holds the same model and optimizer state twice; its checkpoint holds it once (DCP's dedup). What the
    second rank adds is its own random streams (5 KB)."""
    one = checkpoint_bytes(straight(runs, "dp1")[0] / "ckpt" / "step-00000005")
    two = checkpoint_bytes(straight(runs, "dp2")[0] / "ckpt" / "step-00000005")
    assert one < two < 1.1 * one, (one, two)


def test_full_model_state_of_a_sharded_run(runs):
    """The exporter's view: the DP2xTP2 run's weights, whole and keyed as a single-process GPT's, equal to those of
    the single-process run (same data, same steps: parity)."""
    sharded = full_model_state(straight(runs, "dp2xtp2")[0] / "ckpt" / "step-00000010")
    single = full_model_state(straight(runs, "dp1")[0] / "ckpt" / "step-00000010")
    m = TINY_JOB["spec"]["model"]
    vocab, _ = sharded["tok_emb.weight"].shape
    model = GPT(GPTConfig(vocab_size=vocab, block_size=m["blockSize"], layers=m["layers"], heads=m["heads"],
                          embed_dim=m["embedDim"]))
    model.load_state_dict(sharded, strict=True)  # every name, every shape
    assert sharded.keys() == single.keys()
    for name, value in sharded.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, single[name], rtol=1e-4, atol=1e-5, msg=name)

