"""The DeepSpeed engine on a real 2-rank gloo dp group.

Gradients accumulate over micro-steps in fp32, whatever the precision, as the torch-native layouts accumulate them
(DeepSpeed's default is the model's dtype: bf16 sums lose the small ones).

Checkpoint state (ZeRO-1 and ZeRO-3): a save gathers one parameter at
a time and each is kept, in host memory, by one rank only; a resume reads the state back in parts of bounded size,
each rank only its partition's flat range of each tensor, and gives back exactly what was saved. (Before, every rank gathered the whole fp32 model and Adam state onto its
device at once: 12 bytes per parameter, 96 GB for 8B.) Whether a resumed run goes on exactly is test_resume's and
test_reshard's business; this test holds the memory bounds."""

from __future__ import annotations

import copy
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain.train.partial_read import FlatRange

from .harness import TINY_JOB, spawn_ranks

PART_ELEMENTS = 2000  # the tiny model's parameters load in several parts


def tensors(state: dict):
    for values in state["optim"].values():
        yield from values.values()
    yield from state["model"].values()


def whole(share: dict) -> dict:
    """Every rank's share, merged (collective)."""
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    return {kind: {name: value for each in shares for name, value in each[kind].items()} for kind in share}


def init(rank: int, out: str) -> None:
    # torchrun's worker env, which DeepSpeed reads
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))


def spec_of(stage: int, precision: str = "fp32", accumulation: int = 1):
    from paratrain.api.load import parse_job

    doc = copy.deepcopy(TINY_JOB)
    doc["spec"]["nodes"] = 2
    doc["spec"]["parallelism"] = {"data": 2, "zeroStage": stage}
    doc["spec"]["precision"] = precision
    doc["spec"]["training"]["gradientAccumulation"] = accumulation
    return parse_job(doc).spec


def accumulating(rank: int, stage: int, precision: str, out: str) -> None:
    init(rank, out)
    try:
        from paratrain.train.parallel.dims import ParallelDims
        from paratrain.train.build import build_engine

        spec = spec_of(stage, precision, accumulation=2)
        engine = build_engine(spec, ParallelDims.from_spec(spec, 2, "cpu"), torch.device("cpu"), spec.model.vocab_size)
        tokens = torch.randint(spec.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(rank))
        engine.forward_backward([(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])])
        dtypes = sorted({str(t.dtype) for t in engine.grad_accumulators()})
        applied = engine.optimizer_step(lr=1e-2).applied
        Path(out, f"rank{rank}.json").write_text(json.dumps({"dtypes": dtypes, "applied": applied}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "bf16"), (3, "bf16")])
def test_gradients_accumulate_in_fp32(stage, precision, tmp_path):
    spawn_ranks(accumulating, 2, stage, precision, str(tmp_path))
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"dtypes": ["torch.float32"],
                                                                          "applied": True}


def worker(rank: int, stage: int, out: str) -> None:
    init(rank, out)
    try:
        from paratrain.train import deepspeed_engine
        from paratrain.train.parallel.dims import ParallelDims
        from paratrain.train.build import build_engine

        spec = spec_of(stage)
        dims = ParallelDims.from_spec(spec, 2, "cpu")
        vocab = spec.model.vocab_size

        def trained_engine():
            engine = build_engine(spec, dims, torch.device("cpu"), vocab)
            tokens = torch.randint(vocab, (4, 17), generator=torch.Generator().manual_seed(rank))
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
            engine.optimizer_step(lr=1e-2)
            return engine

        saved = trained_engine()
        share = saved.state_dict()
        state = whole(share)

        deepspeed_engine.LOAD_PART_ELEMENTS = PART_ELEMENTS
        parts: list[int] = []

        def fill(template, saved: torch.Tensor) -> int:
            """Checkpointer.load's part for one template: a flat range of the tensor, or all of it; the elements."""
            if isinstance(template, FlatRange):
                template.out.copy_(saved.reshape(-1)[template.start:template.start + template.out.numel()])
                return template.out.numel()
            template.copy_(saved)
            return template.numel()

        def load(part: dict) -> None:  # what Checkpointer.load does, from the merged shares
            parts.append(sum(fill(value, state["model"][name]) for name, value in part["model"].items())
                         + sum(fill(value, state["optim"][name][key]) for name, values in part["optim"].items()
                               for key, value in values.items()))

        fresh = build_engine(spec, dims, torch.device("cpu"), vocab)
        fresh.restore(load)
        again = whole(fresh.state_dict())
        names = [name for name, _ in saved.module.named_parameters()]
        sizes = [getattr(p, "ds_numel", p.numel()) for _, p in saved.module.named_parameters()]
        report = {
            "kept": sorted(share["model"]), "names": names,
            "kept_bytes": sum(t.numel() * t.element_size() for t in tensors(share)),
            "kept_devices": sorted({str(t.device) for t in tensors(share)}),
            "psi": sum(sizes), "largest": max(sizes), "parts": parts,
            "restored_equal": all(torch.equal(a, b) for a, b in zip(tensors(state), tensors(again), strict=True)),
            "same_names": sorted(state["model"]) == sorted(again["model"]) == sorted(names),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_deepspeed_save_keeps_each_parameter_on_one_rank_and_a_resume_loads_in_parts(stage, tmp_path):
    spawn_ranks(worker, 2, stage, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    kept = [set(report["kept"]) for report in reports]
    assert kept[0].isdisjoint(kept[1]) and kept[0] | kept[1] == set(reports[0]["names"])
    for report in reports:
        psi, largest = report["psi"], report["largest"]
        assert report["kept_devices"] == ["cpu"]  # on a GPU: in host memory, not on the device
        # Weights and two moments in fp32 (and a step count per parameter) for about half the parameters.
        assert report["kept_bytes"] <= 12 * (psi / 2 + largest) + 4 * len(report["names"])
        # The load comes in parts, each of at most PART_ELEMENTS parameters' elements (or one larger parameter),
        # and each rank asks for its partition's share alone: weights and two moments of about half the model
        # (a step count per parameter beside them), not the whole state.
        assert len(report["parts"]) > 1
        assert max(report["parts"]) <= 3 * max(PART_ELEMENTS, largest) + len(report["names"])
        assert sum(report["parts"]) <= 3 * (psi / 2 + len(report["names"])) + len(report["names"]), report["parts"]
        assert report["restored_equal"] and report["same_names"]
