"""fp16 overflow storms: overflowing steps are skipped on every rank, the loss scale halves and then grows back,
and the loss never becomes nan."""

from __future__ import annotations

import json
import math

from paratrain.train.parallel.precision import LossScaler

from ..trainer.harness import layout, run_job
from .gang import fault_env


def test_scaler_halves_and_skips_on_overflow_down_to_its_floor():
    scaler = LossScaler(enabled=True, scale=8.0, growth_interval=3, min_scale=2.0)
    assert scaler.update(math.inf) is False and scaler.scale == 4.0
    assert scaler.update(math.nan) is False and scaler.scale == 2.0
    assert scaler.update(math.inf) is False and scaler.scale == 2.0  # never below min_scale


def test_scaler_grows_after_growth_interval_clean_steps_and_an_overflow_restarts_the_count():
    scaler = LossScaler(enabled=True, scale=1024.0, growth_interval=3)
    assert [scaler.update(1.0) for _ in range(2)] == [True, True] and scaler.scale == 1024.0
    assert scaler.update(1.0) is True and scaler.scale == 2048.0
    scaler.update(1.0)
    scaler.update(1.0)
    assert scaler.update(math.inf) is False and scaler.scale == 1024.0
    scaler.update(1.0)
    scaler.update(1.0)
    assert scaler.scale == 1024.0, "the clean steps before the overflow must not count"
    scaler.update(1.0)
    assert scaler.scale == 2048.0


def test_disabled_scaler_never_scales_but_still_refuses_non_finite_steps():
    scaler = LossScaler(enabled=False)
    assert scaler.factor == 1.0
    assert scaler.update(3.0) is True
    assert scaler.update(math.inf) is False and scaler.update(math.nan) is False
    assert scaler.factor == 1.0


def test_scaler_state_survives_a_checkpoint():
    scaler = LossScaler(enabled=True, scale=512.0, growth_interval=4)
    scaler.update(1.0)
    restored = LossScaler(enabled=True, growth_interval=4)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.clean_steps) == (512.0, 1)


def scale_trace(log: str) -> list[dict]:
    return [json.loads(line.split("fault-scale ", 1)[1]) for line in log.splitlines() if "fault-scale " in line]


def test_overflow_storm_is_skipped_everywhere_and_the_scale_recovers(tmp_path):
    first, count, steps = 4, 6, 24
    storm = range(first, first + count)
    overrides = layout(data=2) + ["spec.precision=fp16", f"spec.training.steps={steps}"]
    # Only rank 1's backward overflows (as one rank's microbatch would); growth every 2 clean steps.
    _, metrics = run_job(tmp_path, overrides, env=fault_env(f"fp16_storm:1:{first}:{count}:2"))

    assert all(math.isfinite(loss) for loss in metrics["losses"]), metrics["losses"]
    assert math.isfinite(metrics["val_loss"])
    assert metrics["losses"][-1] < metrics["losses"][0], "training went on after the storm"
    assert metrics["skipped_steps"] >= count
    traces = [scale_trace((tmp_path / "work" / "logs" / f"rank-{r}.log").read_text()) for r in (0, 1)]
    assert len(traces[0]) == steps
    assert traces[0] == traces[1], "every rank must take the same skip decisions and keep the same scale"
    trace = traces[0]
    assert not any(trace[s]["applied"] for s in storm), trace
    before = trace[first - 1]["scale"]
    assert [trace[s]["scale"] for s in storm] == [before / 2 ** (i + 1) for i in range(count)], trace
    after = [t["scale"] for t in trace[first + count:]]
    assert max(after) >= 4 * trace[storm[-1]]["scale"], f"the scale did not grow back: {trace}"
    assert sum(t["applied"] for t in trace[first + count:]) >= len(after) // 2, trace
