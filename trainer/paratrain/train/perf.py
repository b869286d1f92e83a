"""What the hardware did with the step time: model FLOPs per token, peak memory, model FLOPs utilisation (MFU)."""

from __future__ import annotations

import resource

import torch

from .models import ModelConfig, build_model

# Dense (not sparse) bf16/fp16 tensor-core peak FLOP/s per GPU, from the vendors' datasheets, matched as substrings
# of torch.cuda.get_device_name() in this order (so "H100 PCIe" before "H100", "L40S" before "L4").
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),  # fp16 (no bf16)
)


def model_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token, PaLM's (appendix B) and nanoGPT's estimate: 6N for the matmuls' forward and
    backward, N the parameters outside the embedding tables (lookups, not matmuls; the untied head counts), plus
    12·L·H·Q·T for attention's scores and weighted sum over a T-token context (H query heads of Q dims each)."""
    with torch.device("meta"):  # shapes only, whatever this rank holds of the model
        model = build_model(cfg)
    tables = tuple(f"{name}." for name in model.embeddings)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(tables))
    return 6 * n + 12 * cfg.layers * cfg.embed_dim * cfg.block_size  # H·Q = embedDim


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): on CUDA the allocator's peak (torch.cuda.max_memory_allocated: tensors, not the
    allocator's cache or the CUDA context); on CPU the process's peak resident set (getrusage's ru_maxrss, KiB on
    Linux), which includes Python, torch and the data."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max_rss"


def device_peak_flops(device: torch.device, given: float | None) -> float | None:
    """The peak FLOP/s of one device: `given` (paratrain run --peak-flops) if set, else the table's entry for this
    GPU; None where neither is known (CPUs, unlisted GPUs)."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for model, flops in PEAK_FLOPS if model in name), None)


def mfu(flops_per_token: int, tokens_per_second: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s (no recompute counted) over the peak of all devices."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / (peak_flops * devices)
