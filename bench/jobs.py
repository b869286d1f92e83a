"""How benchmarks run the trainer. Most run it as users do: `run_job` is `paratrain run` of a job document, with
its metrics. Those that look inside a step (pipeline_bubble.py, communication.py, dp_scaling.py's breakdown) run
the trainer's own engine in processes of their own: `spawn` starts one per rank on a gloo group and collects what
each returns, and `engine_for` builds the engine a job document describes, exactly as `paratrain train` does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml


def run_job(job: dict, tmp: Path, overrides: Sequence[str] = (), args: Sequence[str] = ()) -> dict:
    """`paratrain run` of `job` (with `--set` overrides and other `args`) in `tmp`: its metrics, and the whole
    command's seconds (start-up included) as "seconds"."""
    tmp.mkdir(parents=True, exist_ok=True)
    job_file, metrics = tmp / "job.yaml", tmp / "metrics.json"
    job_file.write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", str(job_file), "--metrics-out", str(metrics),
           "--workdir", str(tmp / "work"), "--no-progress", *args]
    for item in overrides:
        cmd += ["--set", item]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"paratrain run {job['metadata']['name']} {' '.join(overrides)} failed:\n"
                         f"{proc.stderr[-3000:]}")
    return {**json.loads(metrics.read_text()), "seconds": seconds}


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run `fn(*args)` on `world` ranks, one process each with one thread, joined on a gloo group; return each
    rank's result (JSON-able), in rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, port, out_dir, fn, args), nprocs=world, start_method="spawn")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    from paratrain.train.entrypoint import exit_now

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(fn(*args)))
        dist.barrier()  # no rank leaves while another may still talk to it
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as `paratrain train` ends: no interpreter teardown, where gloo threads can abort the process


def engine_for(job: dict, vocab_size: int):
    """(spec, dims, engine) of a job document on this process group, on the CPU."""
    import torch
    import torch.distributed as dist

    from paratrain.api.load import parse_job
    from paratrain.train.parallel.dims import ParallelDims
    from paratrain.train.build import build_engine

    spec = parse_job(job).spec
    dims = ParallelDims.from_spec(spec, dist.get_world_size(), "cpu")
    return spec, dims, build_engine(spec, dims, torch.device("cpu"), vocab_size)
