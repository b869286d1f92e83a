"""Reading a part of a saved tensor without the rest: DCP's file reader loads a stored tensor whole and then cuts
out the piece a rank asked for, so a rank that keeps 1/N of every tensor (DeepSpeed's ZeRO partitions, FSDP's
shards) reads the whole checkpoint: 96 GB per rank for an 8B model's fp32 state. `read_box` reads only the bytes
of the piece, and `FlatRange` asks for a flat range of a tensor, which is what a ZeRO partition holds.

A stored tensor is a torch.save archive, uncompressed (checkpoint.refuse_compressed enforces it): loaded on the
meta device, torch reports where its storage's bytes start in the archive (`_checkpoint_offset`), and a row-major
piece of it is a set of contiguous runs of those bytes."""

from __future__ import annotations

import math
import sys
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

# Runs shorter than this, in number beyond MANY_RUNS, are read as the whole tensor: one read beats thousands of seeks.
SHORT_RUN_BYTES, MANY_RUNS = 64 * 1024, 1024


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of `shape`, flattened, as boxes (offsets, sizes, first flat
    index), each contiguous in the flattened order: at most two partial slabs per dimension around whole ones."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    (first, r0), (last, r1) = divmod(start, inner), divmod(stop, inner)

    def within(i: int, a: int, b: int) -> list:
        return [((i, *o), (1, *s), i * inner + f) for o, s, f in flat_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, r0, r1)
    boxes = []
    if r0:
        boxes += within(first, r0, inner)
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]), first * inner))
    if r1:
        boxes += within(last, 0, r1)
    return boxes


class FlatRange:
    """A load template for elements [start, start + out.numel()) of a saved tensor of `shape`, flattened, read into
    `out` (1-D, contiguous; it may be a view into a larger buffer, which is then filled in place). DCP plans its
    reads from `__create_chunk_list__` (one box per contiguous part) and writes each box where
    `__get_tensor_shard__` says."""

    def __init__(self, shape: tuple[int, ...], start: int, out: torch.Tensor):
        if out.dim() != 1 or not out.is_contiguous() or start + out.numel() > math.prod(shape):
            raise ValueError(f"FlatRange: {out.numel()} elements at {start} do not fit a tensor of shape {shape}")
        self.shape, self.start, self.out = torch.Size(shape), start, out
        self._boxes = {offsets: (sizes, flat) for offsets, sizes, flat in
                       flat_boxes(tuple(shape), start, start + out.numel())}

    def size(self) -> torch.Size:
        return self.shape  # DCP checks it against the saved tensor's

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, (s, _) in self._boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        sizes, flat = self._boxes[tuple(index.offset)]
        return self.out[flat - self.start:flat - self.start + math.prod(sizes)].view(sizes)


def _little_endian(archive: Any) -> bool:
    """Whether the archive's tensors are stored little-endian as this host reads them (its `byteorder` record;
    archives without one were written in the writer's native order, which torch assumes is the reader's)."""
    with zipfile.ZipFile(archive) as zipped:
        orders = [n for n in zipped.namelist() if n.endswith("/byteorder")]
        order = zipped.read(orders[0]).decode() if orders else sys.byteorder
    return order == sys.byteorder == "little"


def _runs(shape: torch.Size, offsets: torch.Size, lengths: torch.Size) -> tuple[list[int], int]:
    """The box (offsets, lengths) of a row-major tensor of `shape` as contiguous runs: each run's first flat index,
    and the run length in elements."""
    j = max((d for d in range(len(shape)) if lengths[d] != shape[d]), default=-1)
    if j < 0:
        return [0], math.prod(shape)
    run = lengths[j] * math.prod(shape[j + 1:])
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    starts = [offsets[j] * strides[j]]
    for d in range(j - 1, -1, -1):  # every combination of the outer indices, in row-major order
        starts = [(offsets[d] + i) * strides[d] + s for i in range(lengths[d]) for s in starts]
    return starts, run


def read_box(archive: Any, offsets: torch.Size, lengths: torch.Size, target: torch.Tensor) -> None:
    """Copy the box (offsets, lengths) of the tensor saved in `archive` (a seekable file holding one torch.save
    archive, uncompressed) into `target`, reading only the box's bytes where the tensor is stored contiguous and
    little-endian, else the whole tensor."""
    archive.seek(0)
    meta = torch.load(archive, map_location="meta", weights_only=True)
    starts, run = _runs(meta.shape, offsets, lengths)
    itemsize = meta.element_size()
    partial = math.prod(lengths) < meta.numel() and not (len(starts) > MANY_RUNS and run * itemsize < SHORT_RUN_BYTES)
    if not (partial and meta.is_contiguous() and _little_endian(archive)):
        archive.seek(0)
        whole = torch.load(archive, map_location="cpu", weights_only=True)
        for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            whole = whole.narrow(d, o, n)
        target.copy_(whole)
        return
    base = meta.untyped_storage()._checkpoint_offset + meta.storage_offset() * itemsize
    direct = target.device.type == "cpu" and target.dtype == meta.dtype and target.is_contiguous()
    buffer = target if direct else torch.empty(tuple(lengths), dtype=meta.dtype)
    raw = buffer.view(-1).view(torch.uint8).numpy()
    run_bytes = run * itemsize
    for k, first in enumerate(starts):
        archive.seek(base + first * itemsize)
        view, filled = memoryview(raw[k * run_bytes:(k + 1) * run_bytes]), 0
        while filled < run_bytes:
            got = archive.readinto(view[filled:])
            if not got:
                raise EOFError(f"the tensor archive ends {run_bytes - filled} bytes into a run it declares")
            filled += got
    if not direct:
        target.copy_(buffer)
