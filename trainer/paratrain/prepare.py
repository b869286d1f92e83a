"""`paratrain prepare`: text and JSONL files into a token directory (the format: `paratrain.token_shards`).

    paratrain prepare --train-bpe 2048 --out examples/data/shakespeare-bpe examples/data/tinyshakespeare.txt
    paratrain prepare --tokenizer tokenizer.json --out data/tokens corpus/*.jsonl --val heldout.jsonl

A `.jsonl` input holds one document per line, in its "text" field; any other input is UTF-8 text and one
document. Every document is followed by the end-of-text token. Text is encoded in pieces cut only where the
tokenizer's pre-tokenizer splits (`cut_canonically`: the token stream is the one encoding each whole document would
give), `encode_batch_fast` over about a megabyte at a time, on every core, so memory stays flat whatever the input
size: text files are read in blocks, long lines included. The tokenizer's own special tokens (a BOS) are not
added. With a byte-level BPE, decoding a text file's tokens gives the file back exactly.

The validation split is the last `--val-fraction` of the token stream (as `source: text` holds out the end of its
file), or the files given with `--val`. Imports no torch.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from .token_shards import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, FORMAT, FORMAT_VERSION, MANIFEST_FILE,
                           SHARD_FILE, TOKENIZER_FILE, InputFile, Manifest, Shard, Split, TokenizerInfo, dtype_for,
                           sha256_file, write_manifest)

PIECE_CHARS = 16_384  # a document is encoded in pieces of about this many characters (cut_canonically)
CARRY_PRETOKENS = 2  # pre-tokens kept back at a cut: the split before the last one depends on what follows
BLOCK_BYTES = 1 << 16  # a text file is read this much at a time
BATCH_CHARS = 1 << 20  # text handed to one encode_batch_fast call
TRAINED_EOS = "<|endoftext|>"
EOS_CANDIDATES = (TRAINED_EOS, "<|end_of_text|>", "</s>", "<eos>")  # GPT-2, Llama 3, Llama 2 / T5, Gemma


class PrepareError(ValueError):
    pass


def read_pieces(path: Path, pre_tokenizer=None) -> Iterator[tuple[str, bool, int]]:
    """(text, whether a document ends with it, input bytes it consumed), in file order: each document cut by
    `cut_canonically` into pieces that encode as the whole document does. A text file is read in blocks, so a long
    line is never held whole; a JSONL document is (it is one JSON value)."""
    if path.suffix == ".jsonl":
        for text, consumed in _jsonl_documents(path):
            yield from cut_canonically([(text, consumed)], pre_tokenizer)
    else:
        yield from cut_canonically(_text_blocks(path), pre_tokenizer)


def cut_canonically(blocks: Iterable[tuple[str, int]], pre_tokenizer) -> Iterator[tuple[str, bool, int]]:
    r"""One document's text, given in blocks of (text, input bytes), as pieces of about PIECE_CHARS or more that the
    tokenizer encodes exactly as it encodes the whole: BPE never merges across its pre-tokenizer's splits, so each
    piece ends where a pre-token starts. The last CARRY_PRETOKENS pre-tokens of the text seen so far stay for the
    next piece, because where a split falls depends on what follows (GPT-2's `\s+(?!\S)`: ".\n\n" then "The"
    splits otherwise than ".\n\n" at the end of a piece); pre-token boundaries before them are final, and the
    pre-tokenizer, matching from one of them, finds the same ones again. Without a pre-tokenizer (or in one
    pre-token longer than a piece) the text is not cut until the document ends."""
    buffer, consumed, look_at = "", 0, PIECE_CHARS
    for text, size in blocks:
        buffer += text
        consumed += size
        if len(buffer) < look_at or pre_tokenizer is None:
            continue
        starts = [start for _, (start, _) in pre_tokenizer.pre_tokenize_str(buffer)]
        if len(starts) > CARRY_PRETOKENS and starts[-CARRY_PRETOKENS] > 0:
            cut = starts[-CARRY_PRETOKENS]
            yield buffer[:cut], False, consumed
            buffer, consumed = buffer[cut:], 0
            look_at = len(buffer) + PIECE_CHARS
        else:  # a pre-token as long as the piece: look again once the text has doubled (linear, not quadratic)
            look_at = 2 * len(buffer)
    yield buffer, True, consumed


def splitting_pre_tokenizer(tokenizer: Tokenizer):
    """The tokenizer's pre-tokenizer if cutting text between its pre-tokens leaves the encoding unchanged, else None
    (none at all, or one that marks where a text begins: a prefix space, SentencePiece's leading "▁")."""
    if tokenizer.pre_tokenizer is None:
        return None
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in ("one two", "one", " two")]
    return tokenizer.pre_tokenizer if ids[0] == ids[1] + ids[2] else None


def _text_blocks(path: Path) -> Iterator[tuple[str, int]]:
    """A UTF-8 file's text in blocks of at most BLOCK_BYTES, decoded incrementally (a character split between
    blocks is joined), with the bytes each consumed."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:  # bytes: \r\n stays as it is, and offsets are exact
        while raw := f.read(BLOCK_BYTES):
            try:
                yield decoder.decode(raw), len(raw)
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{path}: not UTF-8 ({exc.reason} at byte {offset + exc.start})") from None
            offset += len(raw)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}: not UTF-8 ({exc.reason} at the end of the file)") from None


def _jsonl_documents(path: Path) -> Iterator[tuple[str, int]]:
    skipped = 0  # bytes of blank lines, counted with the next document
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, number)
            if not line.strip():
                skipped += len(raw)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PrepareError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise PrepareError(f'{path}:{number}: no "text" field (each JSONL line must be an object with one)')
            if not isinstance(record["text"], str):
                raise PrepareError(f'{path}:{number}: "text" is a {type(record["text"]).__name__}, not a string')
            yield record["text"], skipped + len(raw)
            skipped = 0


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start} of the line)") from None


def train_bpe(inputs: list[Path], vocab_size: int, progress: bool) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme: any text encodes, decoding is exact) with TRAINED_EOS as its one special
    token (id 0), trained on `inputs`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    cutter = splitting_pre_tokenizer(tokenizer)
    pieces = (text for path in inputs for text, _, _ in read_pieces(path, cutter))
    tokenizer.train_from_iterator(pieces, trainer)
    return tokenizer


class ShardWriter:
    """Appends token arrays to ROOT/<split>-00000.bin, -00001.bin, ..., each of at most `shard_tokens` tokens."""

    def __init__(self, root: Path, split: str, dtype: str, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.files: list[Path] = []
        self._file = None
        self._room = 0

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._room == 0:
                self._next_shard()
            head, ids = ids[:self._room], ids[self._room:]
            head.astype(self.dtype, copy=False).tofile(self._file)
            self._room -= len(head)

    def _next_shard(self) -> None:
        self.close()
        path = self.root / f"{self.split}-{len(self.files):05d}.bin"
        self.files.append(path)
        self._file = open(path, "wb")
        self._room = self.shard_tokens

    def close(self) -> list[Path]:
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the manifest that vouches for it
            self._file.close()
            self._file = None
        return self.files


def encode_files(tokenizer: Tokenizer, inputs: list[Path], eos_id: int, out: ShardWriter, bar: tqdm) -> None:
    batch: list[tuple[str, bool]] = []
    chars = 0
    cutter = splitting_pre_tokenizer(tokenizer)
    for path in inputs:
        for text, ends_document, consumed in read_pieces(path, cutter):
            batch.append((text, ends_document))
            chars += len(text)
            if chars >= BATCH_CHARS:
                out.write(_encode(tokenizer, batch, eos_id, out.dtype))
                batch, chars = [], 0
            bar.update(consumed)
    if batch:
        out.write(_encode(tokenizer, batch, eos_id, out.dtype))


def _encode(tokenizer: Tokenizer, batch: list[tuple[str, bool]], eos_id: int, dtype: str) -> np.ndarray:
    encodings = tokenizer.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
    eos = np.array([eos_id], dtype)
    parts = []
    for encoding, (_, ends_document) in zip(encodings, batch, strict=True):
        parts.append(np.asarray(encoding.ids, dtype))
        if ends_document:
            parts.append(eos)
    return np.concatenate(parts)


def move_tail(files: list[Path], count: int, dtype: str, into: ShardWriter) -> list[Path]:
    """Move the last `count` tokens of the stream held by `files` into `into`, in order; the files still holding
    tokens are returned."""
    item = np.dtype(dtype).itemsize
    sizes = [f.stat().st_size // item for f in files]
    keep = sum(sizes) - count
    kept = []
    for path, size in zip(files, sizes, strict=True):
        if keep >= size:
            kept.append(path)
            keep -= size
            continue
        into.write(np.fromfile(path, dtype, offset=keep * item))
        if keep:
            os.truncate(path, keep * item)
            kept.append(path)
        else:
            path.unlink()
        keep = 0
    return kept


def clear_out_dir(root: Path) -> None:
    """Remove what an earlier prepare wrote here, its manifest first (so the directory never looks complete);
    refuse a directory holding anything else."""
    root.mkdir(parents=True, exist_ok=True)
    ours = {MANIFEST_FILE, MANIFEST_FILE + ".tmp", TOKENIZER_FILE}
    entries = list(root.iterdir())
    others = sorted(p.name for p in entries if p.name not in ours and not re.match(SHARD_FILE, p.name))
    if others:
        raise PrepareError(f"--out {root}: holds {', '.join(others[:5])}, which prepare did not write; give a new "
                           "or empty directory")
    (root / MANIFEST_FILE).unlink(missing_ok=True)
    for path in entries:
        path.unlink(missing_ok=True)


def _load_tokenizer(path: Path) -> tuple[Tokenizer, str]:
    try:
        text = path.read_text(encoding="utf-8")
        return Tokenizer.from_str(text), text
    except OSError as exc:
        raise PrepareError(f"--tokenizer {path}: {exc.strerror}") from None
    except Exception as exc:  # noqa: BLE001 (tokenizers raises a bare Exception for a malformed file)
        raise PrepareError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({exc})") from None


def _eos(tokenizer: Tokenizer, name: str | None) -> tuple[str, int]:
    for candidate in [name] if name else EOS_CANDIDATES:
        if (token_id := tokenizer.token_to_id(candidate)) is not None:
            return candidate, token_id
    if name:
        raise PrepareError(f"--eos {name}: not in the tokenizer's vocabulary")
    raise PrepareError(f"the tokenizer has none of {', '.join(EOS_CANDIDATES)}: name its end-of-document token "
                       "with --eos")


def split_of(files: list[Path], dtype: str) -> Split:
    """The manifest entry of a split held by `files`, in stream order (every file hashed)."""
    item = np.dtype(dtype).itemsize
    shards = [Shard(file=f.name, tokens=f.stat().st_size // item, sha256=sha256_file(f)) for f in files]
    return Split(tokens=sum(s.tokens for s in shards), shards=shards)


def prepare(out: Path, inputs: list[Path], *, tokenizer_file: Path | None = None, bpe_vocab: int | None = None,
            val_fraction: float = DEFAULT_VAL_FRACTION, val_inputs: list[Path] = (),
            shard_tokens: int = DEFAULT_SHARD_TOKENS, eos: str | None = None, progress: bool = False) -> Manifest:
    """Tokenize `inputs` (and `val_inputs`) into the token directory `out`; its manifest is written last."""
    _check_arguments([*inputs, *val_inputs], tokenizer_file, bpe_vocab, val_fraction, shard_tokens)
    if tokenizer_file:
        tokenizer, tokenizer_json = _load_tokenizer(tokenizer_file)  # before clearing `out`: it may be in there
        source = str(tokenizer_file.resolve())
    clear_out_dir(out)
    if bpe_vocab:
        tokenizer = train_bpe(inputs, bpe_vocab, progress)
        tokenizer_json = tokenizer.to_str()
        source = f"byte-level BPE of vocabulary {bpe_vocab} trained by paratrain prepare on the training inputs"
    eos_token, eos_id = _eos(tokenizer, eos)
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    dtype = dtype_for(vocab_size)
    train_files, val_files = _write_shards(out, tokenizer, eos_id, dtype, inputs, val_inputs, val_fraction,
                                           shard_tokens, progress)
    (out / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    manifest = Manifest(
        format=FORMAT, version=FORMAT_VERSION, vocab_size=vocab_size, dtype=dtype,
        tokenizer=TokenizerInfo(source=source, sha256=sha256_file(out / TOKENIZER_FILE), eos_token=eos_token,
                                eos_id=eos_id),
        val_fraction=None if val_inputs else val_fraction,
        inputs=[InputFile(path=str(p), bytes=p.stat().st_size, split=split)
                for split, paths in (("train", inputs), ("val", val_inputs)) for p in paths],
        train=split_of(train_files, dtype), val=split_of(val_files, dtype))
    write_manifest(out, manifest)
    return manifest


def _check_arguments(inputs: list[Path], tokenizer_file: Path | None, bpe_vocab: int | None, val_fraction: float,
                     shard_tokens: int) -> None:
    if (tokenizer_file is None) == (bpe_vocab is None):
        raise PrepareError("give exactly one of --tokenizer FILE and --train-bpe VOCAB")
    if bpe_vocab is not None and not 257 <= bpe_vocab <= 1_000_000:
        raise PrepareError(f"--train-bpe {bpe_vocab}: must be 257..1000000 (the 256 bytes and the end-of-text token "
                           "come first)")
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction}: must be between 0 and 1")
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {shard_tokens}: must be at least 1")
    for path in inputs:
        if not path.is_file():
            raise PrepareError(f"{path}: no such file")


def _write_shards(out: Path, tokenizer: Tokenizer, eos_id: int, dtype: str, inputs: list[Path],
                  val_inputs: list[Path], val_fraction: float, shard_tokens: int,
                  progress: bool) -> tuple[list[Path], list[Path]]:
    """The train and validation shard files, in stream order."""
    total_bytes = sum(p.stat().st_size for p in [*inputs, *val_inputs])
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
              file=sys.stderr) as bar:
        train = ShardWriter(out, "train", dtype, shard_tokens)
        encode_files(tokenizer, inputs, eos_id, train, bar)
        train_files = train.close()
        if not train_files:
            raise PrepareError("the training inputs hold no documents")
        val = ShardWriter(out, "val", dtype, shard_tokens)
        if val_inputs:
            encode_files(tokenizer, list(val_inputs), eos_id, val, bar)
        else:
            total = sum(f.stat().st_size for f in train_files) // np.dtype(dtype).itemsize
            val_tokens = max(1, round(total * val_fraction))
            if val_tokens >= total:
                raise PrepareError(f"the inputs hold {total} tokens: too few to hold out {val_fraction} of them")
            train_files = move_tail(train_files, val_tokens, dtype, val)
        val_files = val.close()
        if not val_files:
            raise PrepareError("the --val inputs hold no documents")
    return train_files, val_files
