"""spec.logging.tensorboard: rank 0's progress events become TensorBoard scalars a TensorBoard server reads."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .harness import layout, run_job


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_writes_its_curves_as_tensorboard_scalars(tmp_path):
    _, metrics = run_job(tmp_path, layout(data=2) + ["spec.logging.tensorboard=tb"])
    written = scalars(tmp_path / "tb")  # relative to the directory `paratrain run` ran in, as checkpoint.path is
    steps = len(metrics["losses"])
    assert [s for s, _ in written["train/loss"]] == list(range(1, steps + 1))
    assert [v for _, v in written["train/loss"]] == pytest.approx(metrics["losses"], rel=1e-6)  # stored as float32
    assert [v for _, v in written["train/grad_norm"]] == pytest.approx(metrics["grad_norms"], rel=1e-6)
    assert written["val/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in metrics["val_losses"]]
    assert len(written["train/learning_rate"]) == steps and len(written["perf/tokens_per_second"]) == steps
    assert written["perf/model_flops_per_token"] == [(steps, metrics["model_flops_per_token"])]
    assert written["perf/achieved_flops_per_second"] == [
        (steps, pytest.approx(metrics["achieved_flops_per_second"], rel=1e-6))]
    assert written["memory/peak_bytes"] == [(steps, pytest.approx(max(metrics["peak_memory_bytes"]), rel=1e-6))]
    assert "perf/mfu" not in written  # unknown peak: no made-up number


def test_a_relative_tensorboard_dir_is_refused_for_a_cluster(tmp_path):
    from paratrain.api import SpecError, load_job, require_cluster_ready

    job_file = tmp_path / "job.yaml"
    job_file.write_text("apiVersion: paratrain.dev/v1alpha1\nkind: ParallelTrainJob\nmetadata: {name: tb}\n"
                        "spec: {logging: {tensorboard: runs/tb}}\n")
    with pytest.raises(SpecError, match="spec.logging.tensorboard: 'runs/tb' is relative"):
        require_cluster_ready(load_job(str(job_file)))
