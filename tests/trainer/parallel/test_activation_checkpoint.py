"""Activation checkpointing (spec.training.activationCheckpointing): recomputation changes no number, in any
layout, and the forward keeps fewer activations alive (how many fewer, and what it costs in time:
bench/activation_checkpointing.py)."""

import pytest
import torch
import torch.nn.functional as F

from paratrain.train.parallel.activation_checkpoint import apply_ac
from paratrain.train.models.gpt import GPT, GPTConfig
from paratrain.train.models.weights import init_weights

from ..harness import assert_close_curves, assert_parity, layout

CFG = GPTConfig(vocab_size=64, block_size=32, layers=2, heads=4, embed_dim=32, dropout=0.1)
TOKENS = torch.randint(CFG.vocab_size, (4, CFG.block_size + 1), generator=torch.Generator().manual_seed(0))


def forward_backward(mode: str) -> tuple[int, float, list[torch.Tensor]]:
    """(bytes the forward leaves allocated — the activations kept for backward, and the logits —, loss, grads)
    of one training step with dropout, from the same weights and random state."""
    model = GPT(CFG)
    init_weights(model, seed=1)
    apply_ac(model, mode)
    torch.manual_seed(5)
    with torch.profiler.profile(profile_memory=True) as prof:
        logits = model(TOKENS[:, :-1])
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss = F.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())
    loss.backward()
    return held, loss.item(), [p.grad for p in model.parameters()]


def test_recomputation_reproduces_the_step_and_keeps_fewer_activations():
    held = {}
    base_held, base_loss, base_grads = forward_backward("none")
    for mode in ("full", "selective"):
        held[mode], loss, grads = forward_backward(mode)
        assert loss == base_loss
        for g, base in zip(grads, base_grads, strict=True):  # dropout masks replayed, not redrawn
            torch.testing.assert_close(g, base, rtol=0, atol=0)
    # full keeps each block's input only; selective also its matmul and attention outputs
    assert held["full"] < held["selective"] < base_held


def test_an_unknown_mode_is_refused_with_the_field():
    with pytest.raises(ValueError, match="spec.training.activationCheckpointing: 'some'"):
        apply_ac(GPT(CFG), "some")


TP_DROPOUT = layout(tensor=2) + ["spec.model.dropout=0.1"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_tensor_parallel_dropout_recomputes_the_same_masks(mode, job_runs):
    """Attention dropout under TP draws from each rank's heads stream; recomputation must replay it."""
    _, plain = job_runs("tp2-dropout", TP_DROPOUT)
    _, checkpointed = job_runs(f"tp2-dropout-{mode}", TP_DROPOUT + [f"spec.training.activationCheckpointing={mode}"])
    assert_close_curves(checkpointed["losses"], plain["losses"], rtol=1e-6)
    assert_close_curves(checkpointed["grad_norms"], plain["grad_norms"], rtol=1e-6)


@pytest.mark.parametrize("overrides", [
    layout(data=2, tensor=2, zeroStage=3) + ["spec.training.activationCheckpointing=full"],
    layout(pipeline=2, microbatches=2) + ["spec.training.activationCheckpointing=selective"],
    layout(data=2, zeroStage=2) + ["spec.training.activationCheckpointing=full"],
], ids=["dp2xtp2-zero3-fsdp2-full", "pp2-1f1b-selective", "dp2-zero2-deepspeed-full"])
def test_checkpointed_layouts_match_single_process(overrides, reference, job_runs):
    _, metrics = job_runs("ac", overrides)
    assert_parity(metrics, reference, rtol=1e-4)
