"""Token streams and deterministic batches.

A step's *global* batch depends only on (seed, step), never on the layout; each data-parallel rank takes its
contiguous slice. That is what makes every layout comparable to a single process, and what makes resume exact:
the data position is the step number.

Sources: `synthetic` and `text` (characters) are built in memory; `tokens` reads a prepared token directory
(`paratrain.token_shards`) through np.memmap, its shards one stream in manifest order, so a rank holds only the
windows it draws.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..token_shards import Shard, TokenDirError, open_token_dir

SYNTHETIC_TOKENS = 200_000


class ShardedTokens:
    """Token shards read as one stream: a slice copies its own tokens out of the memory maps, as int64, and may
    span shards (a shard boundary is a byte count, not a document boundary)."""

    def __init__(self, root: Path, shards: list[Shard], dtype: str):
        self.maps = [np.memmap(root / s.file, dtype=dtype, mode="r", shape=(s.tokens,)) for s in shards]
        self.starts = np.cumsum([0] + [s.tokens for s in shards]).tolist()  # the stream offset of each shard

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        out = np.empty(max(0, stop - start), dtype=np.int64)
        pos, shard = start, bisect_right(self.starts, start) - 1
        while pos < stop:
            offset = pos - self.starts[shard]
            n = min(stop - pos, len(self.maps[shard]) - offset)
            out[pos - start: pos - start + n] = self.maps[shard][offset: offset + n]
            pos, shard = pos + n, shard + 1
        return out


Tokens = np.ndarray | ShardedTokens  # an in-memory int64 stream, or token shards on disk


@dataclass(frozen=True)
class Corpus:
    train: Tokens
    val: Tokens
    vocab_size: int
    vocab: str | None = None  # the characters, for text sources


def load_corpus(source: str, path: str | None, val_fraction: float, vocab_size: int, seed: int,
                block_size: int) -> Corpus:
    if source == "tokens":
        corpus = _token_corpus(Path(path))
    elif source == "text":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"spec.data.path: {path}: no such file in this pod or process") from None
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
        corpus = _split(ids, val_fraction, len(chars), "".join(chars))
    else:
        corpus = _split(_synthetic_tokens(vocab_size, seed), val_fraction, vocab_size, None)
    for name, part in (("training", corpus.train), ("validation", corpus.val)):
        if len(part) <= block_size + 1:
            raise ValueError(f"data: the {name} split has {len(part)} tokens, fewer than model.blockSize + 2 "
                             f"({block_size + 2}); use more data, a smaller blockSize, or (text) a smaller "
                             "valFraction")
    return corpus


def _token_corpus(root: Path) -> Corpus:
    """Shard sizes are checked here, on every rank; checksums once, before launch (`paratrain.launch`)."""
    try:
        manifest = open_token_dir(root)
    except TokenDirError as exc:
        raise ValueError(f"spec.data.path: {root}: {exc}") from None
    return Corpus(ShardedTokens(root, manifest.train.shards, manifest.dtype),
                  ShardedTokens(root, manifest.val.shards, manifest.dtype), manifest.vocab_size)


def _split(ids: np.ndarray, val_fraction: float, vocab_size: int, vocab: str | None) -> Corpus:
    n_train = int(len(ids) * (1 - val_fraction))
    return Corpus(ids[:n_train], ids[n_train:], vocab_size, vocab)


def _synthetic_tokens(vocab_size: int, seed: int) -> np.ndarray:
    """A learnable stream: a fixed random bigram table with a little noise, so loss falls below log(vocab)."""
    rng = np.random.default_rng(seed)
    successor = rng.integers(0, vocab_size, size=vocab_size)
    tokens = np.empty(SYNTHETIC_TOKENS, dtype=np.int64)
    tokens[0] = 0
    noise = rng.random(SYNTHETIC_TOKENS) < 0.1
    random_tokens = rng.integers(0, vocab_size, size=SYNTHETIC_TOKENS)
    for i in range(1, SYNTHETIC_TOKENS):
        tokens[i] = random_tokens[i] if noise[i] else successor[tokens[i - 1]]
    return tokens


def global_batch(tokens: Tokens, batch_size: int, block_size: int, seed: int, step: int, stream: int = 0,
                 rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of one step, each (batch_size, block_size), drawn from (seed, stream, step) alone.
    `rows` takes some of its rows (a data-parallel rank's: `rank_rows`) without reading the others' windows. Any
    start whose window (block_size + 1 tokens) fits may be drawn, the last one included."""
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, len(tokens) - block_size, size=batch_size)[rows]
    windows = np.stack([tokens[s: s + block_size + 1] for s in starts])
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def rank_rows(batch_size: int, dp_rank: int, dp_degree: int) -> slice:
    """A data-parallel rank's contiguous share of a global batch's rows."""
    per_rank = batch_size // dp_degree
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


TRAIN_STREAM, VAL_STREAM = 0, 1
