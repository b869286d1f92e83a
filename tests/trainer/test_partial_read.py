"""A piece of a saved tensor is read alone (partial_read): a flat range becomes contiguous boxes that cover it
exactly, and a box of a torch.save archive is read from its own bytes, giving what the whole tensor narrowed gives."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from paratrain.train.partial_read import FlatRange, flat_boxes, read_box


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 5), (1, 9), (9, 1)])
def test_flat_boxes_cover_a_range_exactly_each_box_contiguous(shape):
    total = math.prod(shape)
    numbered = torch.arange(total).view(shape)
    rng = random.Random(0)
    ranges = [(0, total), (0, 1), (total - 1, total)] + [tuple(sorted(rng.sample(range(total + 1), 2)))
                                                          for _ in range(40)]
    for start, stop in ranges:
        covered = []
        for offsets, sizes, first in flat_boxes(shape, start, stop):
            box = numbered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
            assert box.tolist() == list(range(first, first + box.numel())), (shape, start, stop, offsets, sizes)
            covered += box.tolist()
        assert covered == list(range(start, stop)), (shape, start, stop)


def test_a_flat_range_template_hands_dcp_views_of_its_buffer():
    out = torch.zeros(11)
    template = FlatRange((4, 5), 7, out)  # elements 7..17: row 1 from column 2, row 2, row 3 up to column 2
    chunks = template.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((1, 2), (1, 3)), ((2, 0), (1, 5)),
                                                                    ((3, 0), (1, 3))]
    whole = torch.arange(20.0).view(4, 5)
    for c in chunks:
        box = whole[c.offsets[0]:c.offsets[0] + c.sizes[0], c.offsets[1]:c.offsets[1] + c.sizes[1]]
        template.__get_tensor_shard__(MetadataIndex("w", c.offsets)).copy_(box)
    assert out.tolist() == list(range(7, 18))
    with pytest.raises(ValueError, match="do not fit"):
        FlatRange((4, 5), 15, torch.zeros(6))


class CountingFile(io.BytesIO):
    def __init__(self, data: bytes):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer):
        got = super().readinto(buffer)
        self.bytes_read += got
        return got


def archive_of(tensor: torch.Tensor) -> CountingFile:
    raw = io.BytesIO()
    torch.save(tensor, raw)
    return CountingFile(raw.getvalue())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_box_is_read_from_its_own_bytes(dtype):
    whole = torch.randn(256, 1024).to(dtype)  # 1 MiB in fp32
    archive = archive_of(whole)
    target = torch.empty(32, 1024, dtype=dtype)
    read_box(archive, torch.Size([64, 0]), torch.Size([32, 1024]), target)
    assert torch.equal(target, whole[64:96])
    whole_bytes = whole.numel() * whole.element_size()
    # The box's 1/8 of the data, and the archive's directory and pickle (a few KB): far from the whole tensor.
    assert archive.bytes_read < whole_bytes / 8 + 64 * 1024, archive.bytes_read


def test_a_box_of_many_runs_a_non_contiguous_tensor_and_a_cast_target_read_right():
    whole = torch.randn(64, 48)
    columns = torch.empty(64, 16, dtype=torch.float64)  # 64 runs of 16, into another dtype
    read_box(archive_of(whole), torch.Size([0, 8]), torch.Size([64, 16]), columns)
    assert torch.equal(columns, whole[:, 8:24].double())
    transposed = whole.t()  # saved with its strides: read whole, then narrowed
    piece = torch.empty(5, 64)
    read_box(archive_of(transposed), torch.Size([10, 0]), torch.Size([5, 64]), piece)
    assert torch.equal(piece, transposed[10:15])
    scalar = torch.tensor(3.5)
    out = torch.empty(())
    read_box(archive_of(scalar), torch.Size([]), torch.Size([]), out)
    assert out.item() == 3.5

