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
    assert dp2_metrics["peak_reserved_bytes"] == [None, None]  # no allocator reserves on CPU


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


def test_tokens_per_second_leaves_out_a_runs_first_steps():
    """The first steps pay for lazy set-up: a run of 10 steps whose first takes 5 s and the rest 1 s runs at
    100 tokens/s, not 10 x 100 / 14; a run of 2 steps still counts its second; of 1 step, that step."""
    from paratrain.train.perf import SteadyRate

    rate = SteadyRate(tokens_per_step=100)
    for seconds in [5.0, 2.0, 1.5] + [1.0] * 7:
        rate.add(seconds)
    assert rate.skipped == 3 and rate.tokens_per_second == pytest.approx(100.0)
    short = SteadyRate(tokens_per_step=100)
    short.add(4.0)
    assert short.skipped == 0 and short.tokens_per_second == pytest.approx(25.0)
    short.add(1.0)
    assert short.skipped == 1 and short.tokens_per_second == pytest.approx(100.0)


@pytest.mark.parametrize("name, peak", [("NVIDIA H200 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA L4", 121e12),
                                        ("NVIDIA L40S", 362e12), ("NVIDIA GeForce RTX 3090", None)])
def test_each_gpu_is_read_as_its_own_model(name, peak):
    from paratrain.train.perf import peak_flops_of

    assert peak_flops_of(name) == peak
