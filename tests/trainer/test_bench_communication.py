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
