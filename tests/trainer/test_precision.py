"""Which precisions a device is allowed to run."""

import pytest
import torch

from paratrain.train.precision import check_device_supports


def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(monkeypatch):
    """A pre-Ampere GPU (V100, T4): torch says it supports bf16 unless emulation is excluded."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    with pytest.raises(ValueError, match="spec.precision: bf16 needs a GPU with bfloat16 support"):
        check_device_supports("bf16", torch.device("cuda"), deepspeed=False)
