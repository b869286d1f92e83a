"""What evaluation and the loss hold at once: a rank's evaluation slice goes through in gradientAccumulation parts
(never more rows per forward than training uses), and the loss's fp32 copy of the logits exists one piece of
CE_CHUNK_TOKENS tokens at a time, with the same value and gradient as the whole-batch loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from paratrain.api import parse_job
from paratrain.train import loss
from paratrain.train.loop import Trainer

from .harness import TINY_JOB


class RowsEngine:
    """An engine that records how many rows each evaluation forward gets."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.rows.append(x.shape[0])
        return 2.0


def test_evaluation_goes_through_a_ranks_slice_in_accumulation_parts(one_rank_group):
    spec = parse_job({**TINY_JOB, "spec": {**TINY_JOB["spec"], "training": {
        **TINY_JOB["spec"]["training"], "batchSize": 8, "gradientAccumulation": 4, "evalSteps": 2}}}).spec
    recorder = RowsEngine()
    corpus = SimpleNamespace(val=torch.randint(64, (4096,)))
    trainer = Trainer(spec=spec, engine=recorder, dims=SimpleNamespace(dp=1, dp_rank=0), corpus=corpus,
                      device=torch.device("cpu"), reporter=None, checkpointer=None)
    assert trainer.evaluate() == pytest.approx(2.0)
    assert recorder.rows == [2] * 8  # 8 rows in parts of 8 / 4, for each of the 2 eval batches


def test_the_loss_holds_one_piece_in_fp32_and_equals_the_whole_batch_loss(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(loss, "CE_CHUNK_TOKENS", 10)
    logits = torch.randn(3, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(50, (3, 16))
    expected = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    expected.backward()
    expected_grad, logits.grad = logits.grad.clone(), None

    seen: list[int] = []
    whole = loss._piece_loss

    def recording(piece: torch.Tensor, *args, **kwargs):
        seen.append(piece.shape[0])
        return whole(piece, *args, **kwargs)
    monkeypatch.setattr(loss, "_piece_loss", recording)
    value = loss.cross_entropy(logits, targets)
    value.backward()
    assert max(seen) == 10 and sum(seen) == 48  # pieces of 10 tokens, each once (its gradient with it), never all 48
    torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, expected_grad, rtol=2e-2, atol=1e-4)  # bf16: rounded once more
