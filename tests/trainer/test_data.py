"""The batch function every rank calls: which windows a step draws, and which of them a rank reads."""

from __future__ import annotations

import numpy as np
import torch

from paratrain.train.data import global_batch, rank_rows


class CountingTokens:
    """A token stream that counts the windows read from it."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.reads = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, window: slice) -> np.ndarray:
        self.reads += 1
        return self.tokens[window]


def test_every_start_whose_window_fits_is_drawn_the_last_included():
    block = 4
    tokens = np.arange(block + 3, dtype=np.int64)  # windows of block + 1 tokens start at 0, 1 or 2
    firsts = {int(x[0, 0]) for step in range(200) for x in [global_batch(tokens, 1, block, 0, step)[0]]}
    assert firsts == {0, 1, 2}


def test_a_rank_reads_only_its_own_rows_of_the_global_batch():
    tokens = np.arange(1000, dtype=np.int64)
    whole_x, whole_y = global_batch(tokens, 8, 16, 3, 5)
    for rank in range(4):
        counting = CountingTokens(tokens)
        rows = rank_rows(8, rank, 4)
        x, y = global_batch(counting, 8, 16, 3, 5, rows=rows)
        assert torch.equal(x, whole_x[rows]) and torch.equal(y, whole_y[rows])
        assert counting.reads == 2  # its 2 of the 8 windows
