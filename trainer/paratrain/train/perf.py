"""What the hardware did with the step time: model FLOPs per token, peak memory, model FLOPs utilisation (MFU)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..api.hardware import ACCELERATORS
from .host_memory import peak_rss_bytes
from .models.registry import ModelConfig, build_model

# Dense (not sparse) bf16/fp16 tensor-core peak FLOP/s per GPU, from the vendors' datasheets (api.hardware),
# matched as substrings of torch.cuda.get_device_name() in this order (so "H100 PCIe" before "H100").
PEAK_FLOPS = tuple((a.device_name, a.peak_flops) for a in ACCELERATORS)


class SteadyRate:
    """Tokens per second at steady state: over a run's steps after its first few, which also pay for lazy set-up
    (NCCL communicators opened at the first collective, kernels picked, the allocator growing its pools) and would
    understate a short run's speed. A run (or a resumed one) skips min(SKIP, half of its steps so far)."""

    SKIP = 3

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.step_seconds: list[float] = []

    def add(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    @property
    def skipped(self) -> int:
        return min(self.SKIP, len(self.step_seconds) // 2)

    @property
    def tokens_per_second(self) -> float:
        counted = self.step_seconds[self.skipped:]
        return self.tokens_per_step * len(counted) / sum(counted) if counted and sum(counted) > 0 else 0.0


def model_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token, PaLM's (appendix B) and nanoGPT's estimate: 6N for the matmuls' forward and
    backward, N the parameters outside the embedding tables (lookups, not matmuls; the untied head counts), plus
    12·L·H·Q·T for attention's scores and weighted sum over a T-token context (H query heads of Q dims each)."""
    with torch.device("meta"):  # shapes only, whatever this rank holds of the model
        model = build_model(cfg)
    tables = tuple(f"{name}." for name in model.embeddings)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(tables))
    return 6 * n + 12 * cfg.layers * cfg.embed_dim * cfg.block_size  # H·Q = embedDim


def peak_reserved_bytes(device: torch.device) -> int | None:
    """On CUDA the allocator's peak of reserved memory (its cache included: what the device actually gave up, and
    what an out-of-memory error counts against); None on CPU, where no allocator reserves."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): on CUDA the allocator's peak (torch.cuda.max_memory_allocated: tensors, not the
    allocator's cache or the CUDA context); on CPU the process's peak resident set (host_memory.peak_rss_bytes:
    VmHWM, across its resets per phase), which includes Python, torch and the data."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return peak_rss_bytes(), "max_rss"


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages on one device that ops create inside the mode, and their peak.

    torch's own MemTracker does this too but keeps per-module statistics that refuse a module run twice in one
    step (gradient accumulation, pipeline microbatches). A storage is counted once, however many views share it,
    until it is freed; FSDP2's `UntypedStorage.resize_` (it frees and refills unsharded parameters so) is followed.
    Storages made before the mode (the corpus) are not counted. DTensor ops are counted as their local ops, and the
    fake tensors its sharding propagation makes not at all."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}  # storage (its C++ address) → bytes counted
        self._resize = torch.UntypedStorage.resize_

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key not in self._sizes:
            self._sizes[key] = 0
            weakref.finalize(storage, self._forget, key)
        self.live += size - self._sizes[key]
        self._sizes[key] = size
        self.peak = max(self.peak, self.live)

    def _forget(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __enter__(self):
        resize, track, device = self._resize, self._track, self.device

        def resize_(storage: torch.UntypedStorage, size: int):
            out = resize(storage, size)
            if storage.device == device:
                track(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not None:  # DTensor's sharding propagation runs ops on fake tensors: no memory
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device == self.device and not t.is_meta:
                self._track(t.untyped_storage())
        return out


@contextmanager
def tensor_peak(device: torch.device, measure: bool) -> Iterator[Callable[[], int | None]]:
    """The peak bytes of live tensors on `device` within the block, read by the function it yields: on CUDA the
    allocator's (max_memory_allocated); on CPU, where no allocator keeps count, LiveTensorBytes (a dispatch mode:
    slow, so only when `measure`; else None)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device)
        return
    if not measure:
        yield lambda: None
        return
    counter = LiveTensorBytes(device)
    with counter:
        yield lambda: counter.peak


def device_peak_flops(device: torch.device, given: float | None) -> float | None:
    """The peak FLOP/s of one device: `given` (paratrain run --peak-flops) if set, else the table's entry for this
    GPU; None where neither is known (CPUs, unlisted GPUs)."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The table's dense 16-bit peak for a GPU named so (torch.cuda.get_device_name), None where unlisted."""
    return next((flops for model, flops in PEAK_FLOPS if model in device_name), None)


def mfu(flops_per_token: int, tokens_per_second: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s (no recompute counted) over the peak of all devices."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / (peak_flops * devices)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads that make the host wait for the device: a value read (item, tolist, bool, float, int) and
    what must count rows first (nonzero, masked_select, indexing by a boolean mask). On a GPU each is a sync
    (torch.cuda.set_sync_debug_mode sees them there); on CPU this mode sees the same calls in the Python that runs
    under it (autograd's backward runs in C++ and another thread: not seen). For the tests and bench/gpu.sh."""

    READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "masked_select",
                       "argwhere"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in self.READS or masked:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
