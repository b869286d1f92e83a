"""Both engines' optimizer step, in the test process (one rank)."""

from collections.abc import Callable

import pytest
import torch

from paratrain.api.spec import Spec
from paratrain.train.deepspeed_engine import DeepSpeedEngine, deepspeed_config, skip_the_shm_op
from paratrain.train.parallel.dims import ParallelDims
from paratrain.train.engine import TorchEngine
from paratrain.train.models.gpt import GPT, GPTConfig
from paratrain.train.models.weights import init_weights
from paratrain.train.parallel.precision import LossScaler

CFG = GPTConfig(vocab_size=32, block_size=8, layers=1, heads=2, embed_dim=16)


def tiny_gpt() -> GPT:
    model = GPT(CFG)
    init_weights(model, seed=1)
    return model


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in tensors])


def second_step_update(engine, weights: Callable[[], torch.Tensor]) -> torch.Tensor:
    """What the second of two steps changes in the weights. The optimizers are SGD at lr 1, which applies the
    unscaled gradient itself (Adam would hide a wrongly scaled gradient: its update barely depends on the scale)."""
    tokens = torch.randint(CFG.vocab_size, (4, CFG.block_size + 1), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        before = weights()
        engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        assert engine.optimizer_step(lr=1.0).applied
    return weights() - before


def torch_engine(precision: str) -> tuple[TorchEngine, Callable[[], torch.Tensor]]:
    """fp16's scale grows after 2 clean steps: at the second step."""
    model = tiny_gpt()
    engine = TorchEngine(model=model, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                         dims=ParallelDims(dp=1, tp=1, pp=1, world_size=1), precision=precision, grad_clip=0.0,
                         dp_reducer=None,
                         scaler=LossScaler(enabled=precision == "fp16", scale=2.0**10, growth_interval=2))
    return engine, lambda: flat(model.parameters())


def deepspeed_engine(precision: str, stage: int) -> tuple[DeepSpeedEngine, Callable[[], torch.Tensor]]:
    """The config of a dp2 ZeRO job, run on one rank; fp16's scale grows after 1 clean step (DeepSpeed counts
    differently from LossScaler): at the second step."""
    import deepspeed

    skip_the_shm_op(torch.device("cpu"))  # as the trainer does
    spec = Spec(nodes=2, precision=precision, parallelism={"data": 2, "zeroStage": stage})
    config = deepspeed_config(spec, 1, torch.device("cpu"), CFG.embed_dim)
    config["fp16"].update(initial_scale_power=10, loss_scale_window=1)
    config["zero_allow_untested_optimizer"] = True  # SGD
    model = tiny_gpt()
    ds, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)
    engine = DeepSpeedEngine(ds=ds, module=model, zero_stage=stage, dp=1, dp_rank=0)
    return engine, lambda: flat(engine.masters)


def assert_same_update(fp16: torch.Tensor, fp32: torch.Tensor) -> None:
    # fp16 rounds matmul inputs (and DeepSpeed's weights) to 11 bits; half the gradient would be off by 50%.
    assert torch.linalg.vector_norm(fp16 - fp32) <= 1e-2 * torch.linalg.vector_norm(fp32), (
        f"|fp16 update| / |fp32 update| = {torch.linalg.vector_norm(fp16) / torch.linalg.vector_norm(fp32):.3f}")


def test_torch_engine_fp16_growth_step_applies_the_whole_gradient():
    engine, weights = torch_engine("fp16")
    fp16 = second_step_update(engine, weights)
    assert engine.scaler.scale == 2.0**11
    assert_same_update(fp16, second_step_update(*torch_engine("fp32")))


# DeepSpeed's fp16 mechanics (its loss scaler: the GPU path) are checked on every CPU: DeepSpeed refuses fp16 on a
# CPU without native fp16 (and paratrain refuses such a job before launch: test_zero's no-native-fp16 branch), so
# these tests take the native branch (cpu_fp16 forces both probes), where torch emulates fp16 if it must.
NATIVE_FP16 = pytest.mark.parametrize("cpu_fp16", [True], ids=["native-fp16"], indirect=True)


@NATIVE_FP16
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_fp16_growth_step_applies_the_whole_gradient(stage, cpu_fp16, one_rank_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed asserts the worker env torchrun would set
    engine, weights = deepspeed_engine("fp16", stage)
    fp16 = second_step_update(engine, weights)
    assert engine.zero.loss_scale == 2.0**11
    assert_same_update(fp16, second_step_update(*deepspeed_engine("fp32", stage)))


@NATIVE_FP16
@pytest.mark.parametrize("first,then", [("bf16", "fp16"), ("fp16", "bf16")])
def test_deepspeed_keeps_its_own_loss_scaler_when_precision_changes(first, then, cpu_fp16, one_rank_group,
                                                                    monkeypatch):
    """bf16's scaler is the constant 1, fp16's a dynamic one: an fp16 run resumed from bf16 must not start at
    scale 1 (its gradients would underflow), a bf16 run resumed from fp16 must not scale at all."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    checkpoint = deepspeed_engine(first, 1)[0].extra_state()
    engine, _ = deepspeed_engine(then, 1)
    # bf16 at ZeRO-1 is DeepSpeed's BF16_Optimizer, which never scales the loss (no loss_scale: 1)
    scale = getattr(engine.zero, "loss_scale", 1.0)
    engine.load_extra_state(checkpoint, step=0, skipped_steps=0)
    assert getattr(engine.zero, "loss_scale", 1.0) == scale


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeed_reduces_gradients_in_fp32_whatever_the_precision(precision):
    """As the torch-native layouts do: a bf16 run's reductions would otherwise sum in bf16 (DeepSpeed's default is
    the model's dtype)."""
    spec = Spec(nodes=2, precision=precision, parallelism={"data": 2, "zeroStage": 2})
    assert deepspeed_config(spec, 2, torch.device("cpu"), CFG.embed_dim)["communication_data_type"] == "fp32"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deepspeed_overlaps_each_buckets_reduction_with_backward_on_every_stage_and_device(stage, device):
    """Issue 44: DeepSpeed 0.19.8 overlaps gradient reduction with backward for ZeRO-3 only. On every stage and
    device, so the CPU's memory tests measure the GPU's config (its second bucket buffer is in the memory model)."""
    spec = Spec(nodes=2, parallelism={"data": 2, "zeroStage": stage})
    assert deepspeed_config(spec, 2, torch.device(device), CFG.embed_dim)["zero_optimization"]["overlap_comm"] is True


def test_a_single_process_agrees_on_its_loss_and_flags_without_a_collective(one_rank_group, monkeypatch):
    """One process has nothing to agree on: the per-step loss all-reduce (and its host sync) is skipped, which
    bench/overhead.py found among what made a single-process run slower than a plain loop."""
    import torch.distributed as dist

    from paratrain.train.loop import mean_over_reporters

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective in a one-process run")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    assert mean_over_reporters(2.5, torch.device("cpu"), flags=(False, True)) == (2.5, (False, True), None)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_step_reads_the_device_once_whatever_its_micro_steps_and_loss_pieces(precision, one_rank_group,
                                                                             monkeypatch):
    """Issue 44: a read per micro-step's loss and a boolean mask per 4,096-token loss piece made the host wait
    on the device many times a step, and the gradient norm was read apart from the loss. Now a step reads once
    (loop.train_step): its loss, the ranks' flags and its gradient norm in one tensor, before the update whose
    skip and clip the norm decides, whatever the gradient accumulation and however many pieces the loss takes."""
    from paratrain.train import loss as loss_module
    from paratrain.train.loop import train_step
    from paratrain.train.perf import HostReads

    monkeypatch.setattr(loss_module, "CE_CHUNK_TOKENS", 8)  # 32 tokens a micro-step: 4 pieces each
    engine, _ = torch_engine(precision)
    engine.accumulation = 4
    tokens = torch.randint(CFG.vocab_size, (16, CFG.block_size + 1), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    micro = list(zip(x.chunk(4), y.chunk(4), strict=True))
    for _ in range(2):
        with HostReads() as counted:
            trained = train_step(engine, micro, 0.1, torch.device("cpu"), flags=lambda: (False, True))
        assert counted.reads == ["tolist"], counted.reads
        assert trained.outcome.applied and 0 < trained.loss < 10 and trained.flags == (False, True)
        assert 0 < trained.outcome.grad_norm < 100


def test_a_step_whose_gradient_norm_is_not_finite_is_skipped_from_the_one_read(one_rank_group):
    """The norm read with the loss still decides the skip: an fp16 overflow leaves the weights as they were and
    halves the loss scale."""
    from paratrain.train.loop import train_step

    engine, weights = torch_engine("fp16")
    before = weights()
    engine.scaler.scale = 2.0**200  # every scaled gradient overflows
    tokens = torch.randint(CFG.vocab_size, (4, CFG.block_size + 1), generator=torch.Generator().manual_seed(4))
    trained = train_step(engine, [(tokens[:, :-1], tokens[:, 1:])], 0.1, torch.device("cpu"))
    assert not trained.outcome.applied and trained.outcome.grad_norm == float("inf")
    assert engine.scaler.scale == 2.0**199
    assert torch.equal(weights(), before)
