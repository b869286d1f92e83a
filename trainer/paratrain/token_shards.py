"""A prepared token directory: what `paratrain prepare` writes and `spec.data.source: tokens` reads.

    DIR/train-00000.bin ...  token ids, native little-endian uint16 (vocabulary <= 65536) or uint32, no header
    DIR/val-00000.bin ...    the validation split, in the same form
    DIR/tokenizer.json       the Hugging Face tokenizer the ids come from
    DIR/manifest.json        written last (and atomically): a DIR without it is an unfinished prepare

The manifest lists each split's shards in stream order with their token counts and SHA-256s. Opening a directory
checks every shard's size against its count (cheap: a stat per shard, done by every rank); `checksums=True` also
hashes every shard (a few seconds per GB: `paratrain run` and `validate` do it once, before launch).

Imports neither torch nor numpy: `paratrain validate` uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

FORMAT = "paratrain-tokens"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SHARD_FILE = r"^(train|val)-[0-9]{5,}\.bin$"
ITEM_BYTES = {"uint16": 2, "uint32": 4}
# What `paratrain prepare` writes unless told otherwise (here, so its CLI help needs no numpy).
DEFAULT_VAL_FRACTION = 0.005
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16


def dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Shard(_Model):
    file: str = Field(pattern=SHARD_FILE)  # a bare name: a manifest cannot point outside its directory
    tokens: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Split(_Model):
    tokens: int = Field(ge=1)
    shards: list[Shard] = Field(min_length=1)

    @model_validator(mode="after")
    def _counts_add_up(self) -> Split:
        if sum(s.tokens for s in self.shards) != self.tokens:
            raise ValueError(f"tokens({self.tokens}) is not the sum of its shards' tokens")
        return self


class TokenizerInfo(_Model):
    source: str  # the tokenizer file prepare was given, or how prepare trained one
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # of DIR/tokenizer.json
    eos_token: str  # appended after every document
    eos_id: int = Field(ge=0)


class InputFile(_Model):
    path: str
    bytes: int
    split: Literal["train", "val"]


class Manifest(_Model):
    format: Literal["paratrain-tokens"]
    version: Literal[1]
    tokenizer: TokenizerInfo
    vocab_size: int = Field(ge=2)
    dtype: Literal["uint16", "uint32"]
    val_fraction: float | None  # None: the validation split came from separate files
    inputs: list[InputFile]
    train: Split
    val: Split

    @model_validator(mode="after")
    def _vocab_fits(self) -> Manifest:
        if self.dtype == "uint16" and self.vocab_size > 2**16:
            raise ValueError(f"vocabSize({self.vocab_size}) does not fit dtype uint16")
        return self

    def split(self, name: Literal["train", "val"]) -> Split:
        return self.train if name == "train" else self.val


class TokenDirError(ValueError):
    """What is wrong with a token directory, each problem naming its file."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def sha256_file(path: Path, follow_symlinks: bool = True) -> str:
    """The file's SHA-256. follow_symlinks=False: a symbolic link raises OSError (ELOOP) instead of being read
    through, checked by the open itself (O_NOFOLLOW), so no swap between a check and the read can slip one in."""
    h = hashlib.sha256()
    flags = os.O_RDONLY | (0 if follow_symlinks else os.O_NOFOLLOW)
    with open(os.open(path, flags), "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Last step of a prepare: until this rename, the directory has no manifest and every reader refuses it."""
    tmp = root / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest.model_dump(by_alias=True, mode="json"), indent=1) + "\n")
    tmp.replace(root / MANIFEST_FILE)


def open_token_dir(root: Path, checksums: bool = False) -> Manifest:
    """The manifest of a complete, intact token directory; TokenDirError naming every bad file otherwise."""
    if not root.is_dir():
        raise TokenDirError([f"no such directory (looked for {root.resolve()})"])
    try:
        raw = (root / MANIFEST_FILE).read_text()
    except FileNotFoundError:
        raise TokenDirError([f"no {MANIFEST_FILE}: not a token directory, or its `paratrain prepare` did not "
                             "finish (run it again)"]) from None
    try:
        manifest = Manifest.model_validate(json.loads(raw))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise TokenDirError([f"{MANIFEST_FILE} is not a paratrain-tokens v{FORMAT_VERSION} manifest: "
                             f"{_first_line(exc)}"]) from None
    problems = [p for name in ("train", "val") for shard in manifest.split(name).shards
                if (p := _shard_problem(root, shard, ITEM_BYTES[manifest.dtype], checksums))]
    if problems:
        raise TokenDirError(problems)
    return manifest


def _shard_problem(root: Path, shard: Shard, item_bytes: int, checksum: bool) -> str | None:
    path = root / shard.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{shard.file}: missing"
    if size != shard.tokens * item_bytes:
        return (f"{shard.file}: {size} bytes, but the manifest says {shard.tokens} tokens = "
                f"{shard.tokens * item_bytes} bytes")
    if checksum and sha256_file(path) != shard.sha256:
        return f"{shard.file}: SHA-256 differs from the manifest's (the shard is corrupt or was changed)"
    return None


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}"
    return str(exc).splitlines()[0]
