"""Gradient accumulation: batch B in k micro-steps of B/k trains exactly as batch B in one, in every layout.

Each layout at gradientAccumulation 2 is compared with the same layout at 1 (fp32, 1e-5 relative: only the
summation order differs) and with the single-process run (the parity tests' 1e-4). Gradient norms are compared
too: a missing 1/k weight leaves the Adam update, and so the loss, nearly unchanged but multiplies the norm by k.
How often gradients are reduced, which parity cannot see, is counted for DDP and FSDP2 in the test process.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.train.parallel.data_parallel import OverlappedGradReducer
from paratrain.train.parallel.dims import ParallelDims
from paratrain.train.engine import TorchEngine
from paratrain.train.parallel.fsdp import apply_fsdp

from .harness import AUTOCAST_RTOL, MUTANTS, assert_parity, layout, run_job
from .test_engine import CFG, tiny_gpt

ACCUMULATE = ["spec.training.gradientAccumulation=2"]

LAYOUTS = {
    "single": layout(),
    "dp2-ddp": layout(data=2),
    "dp2-zero2-deepspeed": layout(data=2, zeroStage=2),
    "dp2xtp2-zero3-fsdp2": layout(data=2, tensor=2, zeroStage=3),
    "dp2xpp2-zero1": layout(data=2, pipeline=2, microbatches=2, zeroStage=1),
    "pp2-1f1b": layout(pipeline=2, microbatches=2, pipelineSchedule="1F1B"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_accumulation_matches_one_full_batch(name, reference, job_runs, tmp_path):
    _, whole = job_runs(name, LAYOUTS[name])  # the parity tests' run of the same layout, where there is one
    _, accumulated = run_job(tmp_path / "k2", LAYOUTS[name] + ACCUMULATE)
    assert_parity(accumulated, whole, rtol=1e-5)
    assert_parity(accumulated, reference, rtol=1e-4)


def test_fp16_accumulation_under_pipeline_matches_fp32(reference, tmp_path):
    """The fp16 loss scale and the 1/(k·microbatches) weight share the pipeline's loss_fn; unscaling once per step
    must undo only the former (test_parity's fp16 bounds)."""
    _, metrics = run_job(tmp_path, layout(pipeline=2, microbatches=2) + ACCUMULATE + ["spec.precision=fp16"])
    assert metrics["skipped_steps"] == 0
    assert_parity(metrics, reference, *AUTOCAST_RTOL["fp16"])


@pytest.mark.parametrize("overrides", [layout(), layout(data=2)], ids=["single", "dp2-ddp"])
def test_accumulation_parity_catches_summed_micro_steps(overrides, reference, tmp_path):
    _, metrics = run_job(tmp_path, overrides + ACCUMULATE,
                         env={"PARATRAIN_TEST_MUTANT": "accumulation_sums_micro_steps", "PYTHONPATH": str(MUTANTS)})
    with pytest.raises(AssertionError, match="loss curves differ"):
        assert_parity(metrics, reference, rtol=1e-4)


def engine_reductions(accumulation: int, wrap, count, patch: pytest.MonkeyPatch) -> int:
    """How many gradient reductions one optimizer step of `accumulation` micro-steps makes, in the test process
    (one rank): `wrap(model)` gives what forward runs and the engine's dp_reducer, `count(wrapped, calls, patch)` makes
    each reduction append to calls."""
    model = tiny_gpt()
    (wrapped, dp_reducer), calls = wrap(model), []
    count(wrapped, calls, patch)
    engine = TorchEngine(model=wrapped, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         dims=ParallelDims(dp=1, tp=1, pp=1, world_size=1), precision="fp32", grad_clip=0.0,
                         dp_reducer=dp_reducer, accumulation=accumulation)
    tokens = torch.randint(CFG.vocab_size, (6, CFG.block_size + 1), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    engine.forward_backward(list(zip(x.chunk(accumulation), y.chunk(accumulation), strict=True)))
    return len(calls)


def count_ddp_buckets(wrapped, calls: list, patch: pytest.MonkeyPatch) -> None:
    def count_and_keep(state, bucket):
        calls.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    wrapped.register_comm_hook(None, count_and_keep)


def ddp(model):
    return DDP(model), None


def fsdp2(model):
    apply_fsdp(model, one_rank_dp_mesh(), zero_stage=3, precision="fp32")
    return model, None


def overlapped(model, shard: bool = False):
    """The composed layouts' reducer, with buckets small enough that the tiny model needs several."""
    return model, OverlappedGradReducer(list(model.parameters()), one_rank_dp_mesh(), bucket_bytes=4096, shard=shard)


def overlapped_zero1(model):
    """ZeRO-1's: reduce-scatters instead of all-reduces."""
    return overlapped(model, shard=True)


def one_rank_dp_mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def counting(collective: str):
    """A `count` that makes every call of torch.distributed's `collective` append to calls."""
    def count(wrapped, calls: list, patch: pytest.MonkeyPatch) -> None:
        original = getattr(dist, collective)

        def count_and_call(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        patch.setattr(dist, collective, count_and_call)

    return count


count_all_reduces = counting("all_reduce")


def count_fsdp_reduce_scatters(wrapped, calls: list, patch: pytest.MonkeyPatch) -> None:
    reduce = _fsdp_param_group.foreach_reduce

    def count_and_reduce(*args, **kwargs):
        calls.append(1)
        return reduce(*args, **kwargs)

    patch.setattr(_fsdp_param_group, "foreach_reduce", count_and_reduce)


@pytest.mark.parametrize("wrap,count", [(ddp, count_ddp_buckets), (fsdp2, count_fsdp_reduce_scatters),
                                        (overlapped, count_all_reduces),
                                        (overlapped_zero1, counting("reduce_scatter_single"))],
                         ids=["ddp", "fsdp2", "composed", "composed-zero1"])
def test_gradients_are_reduced_once_per_optimizer_step(wrap, count, one_rank_group, monkeypatch):
    """Parity cannot see how often gradients are reduced (averaging each micro-step's equals averaging the sum):
    count the reductions at k = 1 and k = 3."""
    counts = []
    for accumulation in (1, 3):
        with monkeypatch.context() as patch:
            counts.append(engine_reductions(accumulation, wrap, count, patch))
    assert counts[0] >= 1
    assert counts[1] == counts[0]


def test_the_composed_reducer_starts_reducing_while_backward_still_runs(one_rank_group, monkeypatch):
    """Buckets of the last layers' gradients are all-reduced before backward reaches the first layer."""
    model = tiny_gpt()
    _, reducer = overlapped(model)
    events: list[str] = []
    model.tok_emb.weight.register_post_accumulate_grad_hook(lambda p: events.append("first layer's gradient"))
    count_all_reduces(model, events, monkeypatch)
    tokens = torch.randint(CFG.vocab_size, (2, CFG.block_size + 1), generator=torch.Generator().manual_seed(3))
    reducer.expect(passes=1)
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    reducer.finish()
    assert len(reducer.buckets) > 2 and events.count(1) == len(reducer.buckets)
    assert events.index(1) < events.index("first layer's gradient")
