"""Run real local jobs (`paratrain run`, the user's command) and read their metrics, for parity tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

MUTANTS = Path(__file__).parent / "mutants"  # PYTHONPATH entry that sabotages trainer processes on request

TINY_JOB = {
    "apiVersion": "paratrain.dev/v1alpha1",
    "kind": "ParallelTrainJob",
    "metadata": {"name": "parity"},
    "spec": {
        "model": {"layers": 2, "heads": 2, "embedDim": 32, "blockSize": 16, "vocabSize": 64},
        "training": {"steps": 10, "batchSize": 8, "evalInterval": 5, "evalSteps": 2, "warmupSteps": 2,
                     "learningRate": 3e-3},
    },
}


def layout(data: int = 1, tensor: int = 1, pipeline: int = 1, **parallelism) -> list[str]:
    """--set overrides for a layout; nodes = world size (one process per node, like a CPU cluster)."""
    sets = {"spec.nodes": data * tensor * pipeline, "spec.parallelism.data": data,
            "spec.parallelism.tensor": tensor, "spec.parallelism.pipeline": pipeline}
    sets.update({f"spec.parallelism.{k}": v for k, v in parallelism.items()})
    return [f"{k}={v}" for k, v in sets.items()]


def run_job(tmp: Path, overrides: list[str] = (), job: dict | None = None, expect_ok: bool = True,
            timeout: float = 300, env: dict[str, str] | None = None,
            args: list[str] = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    tmp.mkdir(parents=True, exist_ok=True)
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(job or TINY_JOB))
    metrics = tmp / "metrics.json"
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(job_file), "--metrics-out", str(metrics),
           "--workdir", str(tmp / "work"), "--no-progress", *args]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=job_env(env or {}))
    if expect_ok:
        assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    data = json.loads(metrics.read_text()) if metrics.exists() else None
    return proc, data


def spawn_ranks(fn: Callable[..., None], nprocs: int, *args) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes (torch.multiprocessing), each ending as `paratrain train`
    does (`entrypoint.exit_now`: no interpreter teardown, where a gloo thread still joinable aborts the process now and
    then) once `fn` returns. An exception in `fn` still fails the test with its traceback."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_then_exit, args=(fn, args), nprocs=nprocs, start_method="spawn")


def _rank_then_exit(rank: int, fn: Callable[..., None], args: tuple) -> None:
    from paratrain.train.entrypoint import exit_now

    fn(rank, *args)
    exit_now(0)


def forced_cpu_fp16_env(native: bool) -> dict[str, str]:
    """The environment under which a job's processes see a CPU with (or without) native fp16, whatever this CPU has
    (mutants/sitecustomize.py forces both probes that read it, paratrain's and DeepSpeed's)."""
    return {"PYTHONPATH": str(MUTANTS), "PARATRAIN_TEST_CPU_FP16": "native" if native else "none"}


def job_env(extra: dict[str, str]) -> dict[str, str]:
    """os.environ with `extra`; a PYTHONPATH in `extra` (the mutants) goes in front of the caller's, which may be
    what points the trainer processes at the code under test."""
    env = {**os.environ, **extra}
    if "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join((extra["PYTHONPATH"], os.environ["PYTHONPATH"]))
    return env


def assert_close_curves(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected))
    assert worst <= rtol, f"loss curves differ by {worst:.2e} relative (tolerance {rtol:.0e}):\n{actual}\n{expected}"


def assert_parity(metrics: dict, reference: dict, rtol: float, norm_rtol: float | None = None) -> None:
    """Per-step losses and global gradient norms (within `norm_rtol`, default `rtol`): Adam is nearly invariant to
    gradient scale, so a reduction that sums instead of averaging barely moves the loss but doubles the norm."""
    assert_close_curves(metrics["losses"], reference["losses"], rtol)
    assert_close_curves(metrics["grad_norms"], reference["grad_norms"], norm_rtol or rtol)


# Autocast (fp32 weights, matmuls in bf16/fp16) against the fp32 reference, (loss rtol, gradient norm rtol). One
# step's rounding is the format's: the first step's gradient norm differs by 1e-4 (bf16) and 3e-5 (fp16). From the
# second step on, Adam turns rounding noise into learning-rate-sized updates (its step m/√v has size lr whatever the
# gradient's) of weights whose gradients are near zero, so the gradient norm drifts by what the learning rate sets,
# not the format: 1.5e-3 for both formats at the parity job's lr 3e-3, and 5e-4 (bf16) and 5e-5 (fp16) at lr 3e-4.
# Measured on an AMD EPYC, where torch emulates fp16 (rounding inputs and output, accumulating in fp32); the drift is
# Adam's, so it does not depend on whether the CPU has native fp16. Losses keep the per-element bounds of
# test_parity's docstring (observed 1e-4 and 4e-5); norms get 5e-3 for both formats, 3x the drift. A broken
# reduction moves the loss by >1e-2 within a few steps or the norm by 30-100% (the mutant tests).
AUTOCAST_RTOL = {"bf16": (5e-3, 5e-3), "fp16": (1e-3, 5e-3)}


# 16-bit weights and gradients (DeepSpeed's bf16/fp16 modes, FSDP2's MixedPrecisionPolicy) against a reference that
# autocasts matmuls over fp32 weights and keeps fp32 gradients: both see the same batches from the same init, so they
# differ by rounding only: losses by less than one unit in the last place at 1.0 of the format (2^-8 bf16, 2^-11
# fp16; observed 6e-4 and 6e-5 under DeepSpeed), gradient norms — of gradients computed (and, under DeepSpeed,
# reduced) in the low precision — 8x that (observed 7e-3 and 1.4e-3). A broken reduction moves the loss by >1e-2
# within two steps or the gradient norm by 30-100% (see the mutant tests). (loss rtol, gradient norm rtol):
PRECISION_RTOL = {"bf16": (2**-8, 2**-5), "fp16": (2**-11, 2**-8)}
