"""Parity for the Llama family on tokenized data: every kind of layout trains the same tiny Llama (grouped-query
attention, so k/v shard over fewer heads than q) on the same global batches of a `paratrain prepare`d token
directory (byte-level BPE, 512 tokens) as the single-process run, per-step losses and gradient norms within fp32's
1e-4 (see test_parity.py for the tolerance). ZeRO on data-parallel-only layouts runs through DeepSpeed, with tensor
or pipeline parallel through FSDP2 or ZeroOneOptimizer: both kinds are here."""

import pytest

from ..harness import assert_parity, layout


@pytest.fixture(scope="module")
def llama(token_dir) -> list[str]:
    return ["spec.model.family=llama", "spec.model.heads=4", "spec.model.kvHeads=2", "spec.model.ffnDim=64",
            "spec.data.source=tokens", f"spec.data.path={token_dir}", "spec.training.learningRate=1e-2"]


@pytest.fixture(scope="module")
def reference(llama, job_runs):
    return job_runs("llama-reference", llama + layout())[1]


LAYOUTS = {
    "dp2-ddp": layout(data=2),
    "tp2": layout(tensor=2),
    "pp2-1f1b": layout(pipeline=2, microbatches=2, pipelineSchedule="1F1B"),
    "dp2-zero1-deepspeed": layout(data=2, zeroStage=1),
    "dp2-zero3-deepspeed": layout(data=2, zeroStage=3),
    "dp2xtp2-zero2-fsdp2": layout(data=2, tensor=2, zeroStage=2),
    "dp2xtp2xpp2-zero1": layout(data=2, tensor=2, pipeline=2, microbatches=2, zeroStage=1),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_llama_layout_matches_single_process(name, llama, reference, job_runs):
    _, metrics = job_runs(f"llama-{name}", llama + LAYOUTS[name])
    assert_parity(metrics, reference, rtol=1e-4)


def test_llama_reference_learns(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.2, "or parity would be vacuous"
