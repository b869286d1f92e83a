"""--metrics-out's performance figures: model FLOPs per token, per-rank peak memory, MFU, the step-time split."""

import json

import pytest

from .harness import TINY_JOB, layout, run_job


def tiny_flops_per_token() -> int:
    """6N + 12·L·H·Q·T for TINY_JOB, counted by hand: per block 12E² + 9E (q, k, v, o projections 4E²; MLP 8E²
    and 5E of biases; two norms 4E), then the final norm 2E and the untied head E·V; embedding tables excluded."""
    m = TINY_JOB["spec"]["model"]
    e, layers, vocab, context = m["embedDim"], m["layers"], m["vocabSize"], m["blockSize"]
    n = layers * (12 * e * e + 9 * e) + 2 * e + e * vocab
    return 6 * n + 12 * layers * e * context


@pytest.fixture(scope="module")
def dp2_metrics(job_runs):
    return job_runs("dp2-ddp", layout(data=2))[1]  # test_parity's run of this layout


def test_flops_per_token_is_the_formula(dp2_metrics):
    assert dp2_metrics["model_flops_per_token"] == tiny_flops_per_token() == 175_872


def test_peak_memory_is_measured_on_every_rank(dp2_metrics):
    assert dp2_metrics["peak_memory_kind"] == "max_rss"
    assert len(dp2_metrics["peak_memory_bytes"]) == 2
    # A process that imported torch and trained holds tens of MB at least.
    assert all(b > 10 * 2**20 for b in dp2_metrics["peak_memory_bytes"])


def test_step_time_is_split_into_forward_backward_and_optimizer(dp2_metrics):
    split = dp2_metrics["step_time_seconds"]
    assert split["forward_backward"] > 0 and split["optimizer"] > 0


def test_mfu_needs_a_known_peak_and_is_logged_as_an_event(dp2_metrics, tmp_path):
    assert dp2_metrics["mfu"] is None and dp2_metrics["peak_flops_per_device"] is None
    _, metrics = run_job(tmp_path, layout(), args=["--peak-flops", "1e12"])
    assert metrics["peak_flops_per_device"] == 1e12
    achieved = metrics["model_flops_per_token"] * metrics["tokens_per_second"]
    assert metrics["achieved_flops_per_second"] == pytest.approx(achieved, rel=1e-9)
    assert metrics["mfu"] == pytest.approx(achieved / 1e12, rel=1e-9)
    assert 0 < metrics["mfu"] < 1
    events = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    (performance,) = [e for e in events if e["event"] == "performance"]
    assert performance["mfu"] == metrics["mfu"]
    assert performance["modelFlopsPerToken"] == metrics["model_flops_per_token"]
    assert performance["achievedFlopsPerSecond"] == metrics["achieved_flops_per_second"]
    assert performance["peakMemoryBytes"] == max(metrics["peak_memory_bytes"])
