"""bench/communication.py counts what each layout sends per step against the formulas; here its pipeline row, in
both precisions: a bf16 pipeline sends its activations (and their gradients back) in bf16, half fp32's bytes, the
same elements (issue 44: the residual stream went between stages in fp32)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from communication import measure  # noqa: E402


@pytest.mark.parametrize("precision,width", [("fp32", 4), ("bf16", 2)])
def test_a_pipeline_sends_its_activations_in_the_training_dtype(precision, width):
    row = measure("PP=2", {"pipeline": 2, "microbatches": 2}, precision)
    sent = row["per_dim"]["pp"]
    assert sent["counts"] == {"send": 2}, sent  # one per microbatch, forward (stage 0 receives the gradients)
    assert sent["elements"] == row["formula"]["pp"], (sent, row["formula"])
    assert sent["bytes"] == width * sent["elements"], sent


REDUCTIONS = ("all-reduce", "reduce-scatter")


@pytest.mark.parametrize("name,parallelism", [
    ("DDP", {"data": 2}),
    ("DeepSpeed ZeRO-2", {"data": 2, "zeroStage": 2}),
    ("composed reducer", {"data": 2, "tensor": 2}),
    ("composed ZeRO-1", {"data": 2, "pipeline": 2, "microbatches": 2, "zeroStage": 1}),
    ("FSDP2 ZeRO-3", {"data": 2, "tensor": 2, "zeroStage": 3}),
])
def test_reduce_precision_bf16_halves_every_gradient_reduction(name, parallelism):
    """spec.reducePrecision bf16: each engine's gradient reductions over data parallel carry 2 bytes an element
    (DDP's compress hook, DeepSpeed's communication_data_type, the composed reducer's buckets, FSDP2's
    reduce_dtype), the same elements as in fp32; what ZeRO gathers after the step is not a gradient and keeps its
    width. Parity of these runs with the single process: tests/trainer/parallel/test_parity.py."""
    fp32, bf16 = (measure(name, parallelism, "bf16", reduce)["per_dim"]["dp"] for reduce in ("fp32", "bf16"))
    assert any(kind in bf16["widths"] for kind in REDUCTIONS), bf16
    for kind in REDUCTIONS:
        if kind in fp32["widths"]:
            assert fp32["widths"][kind] == [4] and bf16["widths"][kind] == [2], (kind, fp32, bf16)
    assert bf16["elements"] == fp32["elements"] and bf16["counts"] == fp32["counts"]
    if "all-gather" in fp32["widths"]:
        assert bf16["widths"]["all-gather"] == fp32["widths"]["all-gather"]
