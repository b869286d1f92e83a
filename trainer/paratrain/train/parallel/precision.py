"""Mixed precision: autocast for bf16/fp16, and a dynamic loss scale for fp16.

The scaler is ours rather than torch.amp.GradScaler because the overflow decision must be global: under tensor
or pipeline parallel each rank holds different gradients, and a step skipped on one rank but applied on another
would silently desynchronise the replicas. The global gradient norm (reduced over every shard and stage) is
non-finite exactly when any gradient anywhere overflowed, so it is the one signal every rank agrees on.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def cpu_has_native_fp16() -> bool:
    """Whether oneDNN runs fp16 natively on this CPU (AVX512-FP16 or AMX-FP16). DeepSpeed's CPU accelerator asks
    exactly this and refuses fp16 without it; autocast instead emulates fp16 on any CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def check_device_supports(precision: str, device: torch.device, deepspeed: bool) -> None:
    """Reject a precision the device cannot run before any training step (the spec field is named). `deepspeed`:
    the layout trains through DeepSpeed (deepspeed_engine.py), whose fp16 on CPU needs native fp16."""
    # Without including_emulation=False, torch also says yes for pre-Ampere GPUs that only emulate bf16 (slowly).
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError("spec.precision: bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16")
    if precision == "fp16" and deepspeed and device.type == "cpu" and not cpu_has_native_fp16():
        raise ValueError("spec.precision: fp16 with ZeRO on a data-parallel-only layout trains through DeepSpeed, "
                         "which on CPU needs native fp16 (AVX512-FP16 or AMX-FP16), and this CPU has none; "
                         "use bf16 or fp32, or train on GPUs")
    if precision != "fp32":
        try:
            with autocast(precision, device.type):
                torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        except RuntimeError as exc:
            raise ValueError(f"spec.precision: {precision} autocast is not available on {device.type}: {exc}") from None


@dataclass
class LossScaler:
    """Dynamic loss scaling: halve on overflow (and skip the step), double after `growth_interval` clean steps."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 200
    clean_steps: int = 0
    min_scale: float = 1.0

    @property
    def factor(self) -> float:
        return self.scale if self.enabled else 1.0

    def update(self, grad_norm: float) -> bool:
        """Record a step whose (scaled) global grad norm is `grad_norm`; return whether to apply it."""
        if not self.enabled:
            return math.isfinite(grad_norm)
        if not math.isfinite(grad_norm):
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
