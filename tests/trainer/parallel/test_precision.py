"""Which precisions a device is allowed to run."""

import pytest
import torch

from paratrain.train.parallel.precision import check_device_supports


def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(monkeypatch):
    """A pre-Ampere GPU (V100, T4): torch says it supports bf16 unless emulation is excluded."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    with pytest.raises(ValueError, match="spec.precision: bf16 needs a GPU with bfloat16 support"):
        check_device_supports("bf16", torch.device("cuda"), deepspeed=False)


def test_paratrain_refuses_fp16_deepspeed_exactly_where_deepspeed_would():
    """On this CPU, unforced: paratrain's probe (which refuses an fp16 DeepSpeed job before launch) answers as
    DeepSpeed's CPU accelerator does (which would refuse it in every rank, after the launch)."""
    from deepspeed.accelerator import get_accelerator

    from paratrain.train.parallel.precision import cpu_has_native_fp16

    assert bool(get_accelerator().is_fp16_supported()) == cpu_has_native_fp16()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_cpu_runs_torch_native_sixteen_bit_layouts(precision, cpu_fp16):
    """Autocast runs bf16 and fp16 on any CPU (torch emulates what the CPU lacks); only DeepSpeed's fp16 needs native
    fp16, and is refused with the field and the way out."""
    check_device_supports(precision, torch.device("cpu"), deepspeed=False)
    if precision == "fp16" and not cpu_fp16.native:
        with pytest.raises(ValueError, match=r"spec.precision: fp16 with ZeRO .* use bf16 or fp32, or train on GPUs"):
            check_device_supports(precision, torch.device("cpu"), deepspeed=True)
    else:
        check_device_supports(precision, torch.device("cpu"), deepspeed=True)
