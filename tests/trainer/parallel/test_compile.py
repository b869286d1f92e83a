"""torch.compile per block (spec.training.compile): a compiled run trains the single-process eager run's loss
curve, alone, under tensor parallel with selective activation checkpointing (DTensor's collectives and the
recomputation policy inside the compiled blocks) and under DeepSpeed ZeRO-2. Tolerance: parity's fp32 1e-4
relative (inductor fuses elementwise ops and may reorder their sums). That the blocks were compiled at all is
checked by the code inductor wrote to the run's own cache directory, and that one compilation serves every block
by dynamo's recompilation log."""

from pathlib import Path

import pytest
import torch

from paratrain.train.parallel.compile import compile_problem

from ..harness import assert_parity, layout, run_job

COMPILE = ["spec.training.compile=true"]


def compiled_kernels(cache: Path) -> list[Path]:
    """The C++ kernels inductor generated for this run (CPU)."""
    return list(cache.rglob("*.cpp"))


LAYOUTS = {
    "one-process": layout(),
    "tp2-selective-recomputation": layout(tensor=2) + ["spec.training.activationCheckpointing=selective"],
    "dp2-deepspeed-zero2": layout(data=2, zeroStage=2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_blocks_train_the_eager_loss_curve(name, reference, tmp_path):
    cache = tmp_path / "inductor"
    _, metrics = run_job(tmp_path, LAYOUTS[name] + COMPILE, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=600)
    assert compiled_kernels(cache), "no kernel was compiled: the blocks ran eagerly"
    assert_parity(metrics, reference, rtol=1e-4)


def test_compile_without_a_cpu_compiler_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert "no 'no-such-c++' on PATH" in compile_problem(torch.device("cpu"))
    proc, _ = run_job(tmp_path, layout() + COMPILE, env={"CXX": "no-such-c++"}, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "spec.training.compile: inductor compiles CPU kernels with a C++ compiler" in proc.stderr + proc.stdout


def test_one_compilation_serves_every_block(tmp_path):
    """Blocks are alike: dynamo compiles the first and reuses its code for the others, also when activation
    checkpointing gives each block a forward of its own. Past 8 recompilations (dynamo's limit) the rest would run
    eagerly unnoticed; at 10 layers the only recompilation is evaluation's (grad mode off)."""
    _, metrics = run_job(tmp_path, layout() + COMPILE + ["spec.model.layers=10", "spec.training.steps=3",
                                                           "spec.training.activationCheckpointing=full"],
                         env={"TORCH_LOGS": "recompiles"}, timeout=600)
    log = (tmp_path / "work" / "logs" / "rank-0.log").read_text()
    assert metrics["losses"], "the run trained no step"
    assert log.count("Recompiling function") <= 1, log[-3000:]
