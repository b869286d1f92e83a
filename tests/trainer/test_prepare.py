"""`paratrain prepare` and the token directories it writes: contents, exact round trip, errors named by file (and
line), and the loader's view of the shards as one stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from paratrain.prepare import PrepareError, prepare
from paratrain.token_shards import MANIFEST_FILE, TokenDirError, open_token_dir, sha256_file
from paratrain.train.data import ShardedTokens, global_batch, load_corpus

from .conftest import DOCS

EOT = "<|endoftext|>"


def stream(root: Path, split: str) -> np.ndarray:
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    return np.concatenate([np.fromfile(root / s["file"], manifest["dtype"]) for s in manifest[split]["shards"]])


def test_manifest_says_what_was_written(token_dir, token_inputs):
    manifest = json.loads((token_dir / MANIFEST_FILE).read_text())
    assert (manifest["format"], manifest["version"], manifest["dtype"]) == ("paratrain-tokens", 1, "uint16")
    assert manifest["vocabSize"] == 512 and manifest["valFraction"] == 0.005
    tokenizer = Tokenizer.from_file(str(token_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512 and tokenizer.token_to_id(EOT) == manifest["tokenizer"]["eosId"] == 0
    assert manifest["tokenizer"]["sha256"] == sha256_file(token_dir / "tokenizer.json")
    assert [(i["path"], i["split"]) for i in manifest["inputs"]] == [(str(p), "train") for p in token_inputs]
    for split in ("train", "val"):
        shards = manifest[split]["shards"]
        assert manifest[split]["tokens"] == sum(s["tokens"] for s in shards)
        for s in shards:
            assert (token_dir / s["file"]).stat().st_size == 2 * s["tokens"]
            assert sha256_file(token_dir / s["file"]) == s["sha256"]
    total = manifest["train"]["tokens"] + manifest["val"]["tokens"]
    assert len(manifest["train"]["shards"]) == -(-manifest["train"]["tokens"] // 20_000)  # --shard-tokens 20000
    assert manifest["val"]["tokens"] == round(total * 0.005)
    assert sorted(p.name for p in token_dir.iterdir() if not p.name.endswith(".bin")) == ["manifest.json",
                                                                                        "tokenizer.json"]


def test_decoding_the_stream_gives_the_inputs_back(tmp_path, token_inputs):
    """Train and validation splits are one stream cut near its end, whatever the shard boundaries: decoded, it is
    each text file, then each JSONL document, each followed by the end-of-text token."""
    out = tmp_path / "tokens"
    prepare(out, token_inputs, bpe_vocab=300, val_fraction=0.3, shard_tokens=1000)
    tokens = np.concatenate([stream(out, "train"), stream(out, "val")])
    assert len(json.loads((out / MANIFEST_FILE).read_text())["val"]["shards"]) > 1
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    documents = [token_inputs[0].read_bytes().decode()] + [json.loads(line)["text"] for line in DOCS]
    assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False) == "".join(d + EOT for d in documents)


def test_a_given_tokenizer_and_separate_validation_files(tmp_path, token_dir, token_inputs):
    """The tokenizer is copied byte for byte; --val files become the validation split."""
    out = tmp_path / "tokens"
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"text": "O Romeo, Romeo!"}) + "\n")
    manifest = prepare(out, token_inputs[:1], tokenizer_file=token_dir / "tokenizer.json", val_inputs=[val])
    assert (out / "tokenizer.json").read_bytes() == (token_dir / "tokenizer.json").read_bytes()
    assert manifest.val_fraction is None and manifest.tokenizer.source == str((token_dir / "tokenizer.json").resolve())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(stream(out, "val").tolist(), skip_special_tokens=False) == "O Romeo, Romeo!" + EOT


@pytest.mark.parametrize("line,words", [
    ('{"txt": "x"}', 'no "text" field'),
    ('{"text": 3}', '"text" is a int, not a string'),
    ('{"text": "x"', "not JSON"),
])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, line, words):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(PrepareError, match=f"^{bad}:3: {words}"):
        prepare(tmp_path / "out", [bad], bpe_vocab=300)


def test_the_cli_reports_errors_and_summarises(tmp_path, token_inputs):
    cli = [sys.executable, "-m", "paratrain.cli", "prepare"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    refused = subprocess.run([*cli, "--train-bpe", "300", "--out", str(tmp_path / "a"), str(bad)],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and f'paratrain prepare: {bad}:1: no "text" field' in refused.stderr
    done = subprocess.run([*cli, "--train-bpe", "300", "--out", str(tmp_path / "b"), *map(str, token_inputs)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "training tokens in 1 shard(s)" in done.stderr, done.stderr
    assert "tokenizing" not in done.stderr, "no progress bar when stderr is not a terminal"


def test_a_rerun_replaces_its_own_files_and_refuses_foreign_ones(tmp_path, token_inputs):
    out = tmp_path / "tokens"
    prepare(out, token_inputs, bpe_vocab=300, shard_tokens=1000)
    many = len(list(out.glob("train-*.bin")))
    prepare(out, token_inputs, bpe_vocab=300)
    assert many > 1 and [p.name for p in out.glob("train-*.bin")] == ["train-00000.bin"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="holds notes.txt, which prepare did not write"):
        prepare(out, token_inputs, bpe_vocab=300)


def test_an_unfinished_directory_is_refused_by_name(tmp_path, token_dir):
    """A prepare stopped before its manifest leaves shards that no reader takes for a complete directory."""
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "train-00000.bin").write_bytes((token_dir / "train-00000.bin").read_bytes())
    with pytest.raises(ValueError, match=rf"^spec\.data\.path: {partial}: no manifest\.json: .* did not finish"):
        load_corpus("tokens", str(partial), 0.1, 64, 0, 16)


@pytest.mark.parametrize("damage,words", [
    (lambda shard: shard.unlink(), "train-00001.bin: missing"),
    (lambda shard: shard.write_bytes(shard.read_bytes()[:-2]), "train-00001.bin: 39998 bytes, but the manifest "
     "says 20000 tokens = 40000 bytes"),
])
def test_a_rank_refuses_a_missing_or_cut_shard_by_name(tmp_path, token_dir, damage, words):
    """In a pod (no preflight there) the rank checks every shard's size; a ValueError is exit 2, naming it."""
    copy = copy_dir(token_dir, tmp_path / "copy")
    damage(copy / "train-00001.bin")
    with pytest.raises(ValueError, match=rf"^spec\.data\.path: {copy}: {words}"):
        load_corpus("tokens", str(copy), 0.1, 64, 0, 16)


def test_checksums_catch_a_changed_shard_that_sizes_miss(tmp_path, token_dir):
    copy = copy_dir(token_dir, tmp_path / "copy")
    shard = copy / "val-00000.bin"
    shard.write_bytes(b"\x07\x00" + shard.read_bytes()[2:])
    open_token_dir(copy)  # sizes agree
    with pytest.raises(TokenDirError, match="^val-00000.bin: SHA-256 differs from the manifest's"):
        open_token_dir(copy, checksums=True)


def test_shards_read_as_one_stream(tmp_path, token_dir):
    """Windows crossing shard boundaries read as from the concatenated stream: a token directory's batches are
    those of the same tokens in memory, so every layout and a resume see the same data."""
    corpus = load_corpus("tokens", str(token_dir), 0.1, 64, 0, 16)
    assert isinstance(corpus.train, ShardedTokens) and len(corpus.train.maps) > 1
    flat = stream(token_dir, "train").astype(np.int64)
    assert len(corpus.train) == len(flat) and corpus.vocab_size == 512
    boundary = corpus.train.starts[1]
    assert np.array_equal(corpus.train[boundary - 5: boundary + 5], flat[boundary - 5: boundary + 5])
    for step in range(20):
        for mine, theirs in zip(global_batch(corpus.train, 8, 4000, 1, step), global_batch(flat, 8, 4000, 1, step)):
            assert mine.dtype == theirs.dtype == torch.int64 and torch.equal(mine, theirs)


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_the_stream_is_the_tokenizers_encoding_of_each_whole_document(tmp_path):
    """Pieces are cut only between pre-tokens, never where the cut changes the encoding: paragraphs split by blank
    lines (GPT-2's pre-tokenizer groups "\\n\\n" differently at the end of a text than before a word), runs of
    spaces, and one line far longer than a piece. The shards hold exactly encode(document) + end-of-text."""
    from paratrain import prepare as prep

    paragraph = "The king said.\n\nAnd   the queen,  answered:\n\n\n  Nay!  \n"
    text = tmp_path / "doc.txt"
    text.write_text(paragraph * 1200 + "x" * (3 * prep.PIECE_CHARS) + " end.\n\n" + paragraph * 300)
    out = tmp_path / "tokens"
    prep.prepare(out, [text], bpe_vocab=400)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    whole = tokenizer.encode(text.read_text(), add_special_tokens=False).ids
    eos = tokenizer.token_to_id(prep.TRAINED_EOS)
    assert np.concatenate([stream(out, "train"), stream(out, "val")]).tolist() == whole + [eos]
    assert "ĊĊ" in tokenizer.get_vocab()  # the merge a cut after "\n\n" would change is there to be made


def test_a_long_line_streams_in_pieces_and_characters_split_between_blocks_are_joined(tmp_path):
    from tokenizers import pre_tokenizers

    from paratrain import prepare as prep

    line = "héllo wörld, ünïcode " * 60_000  # 1.3 MB, one line: read whole before, it is now read in blocks
    path = tmp_path / "line.txt"
    path.write_text(line)
    pieces = list(prep.read_pieces(path, pre_tokenizers.ByteLevel(add_prefix_space=False)))
    assert "".join(text for text, _, _ in pieces) == line
    assert sum(consumed for _, _, consumed in pieces) == path.stat().st_size
    assert [ends for _, ends, _ in pieces] == [False] * (len(pieces) - 1) + [True]
    assert max(len(text) for text, _, _ in pieces) < 2 * prep.PIECE_CHARS + prep.BLOCK_BYTES
    (tmp_path / "bad.txt").write_bytes(b"ok\n" * 30_000 + b"\xff")
    with pytest.raises(prep.PrepareError, match=r"bad.txt: not UTF-8 \(invalid start byte at byte 90000\)"):
        list(prep.read_pieces(tmp_path / "bad.txt"))
