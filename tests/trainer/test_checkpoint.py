"""Checkpoint loading, in the test process (one rank)."""

import hashlib
import io
import json
import pickle
import shutil
import threading

import pytest
import torch

from paratrain.train.checkpoint import Checkpointer, CheckpointError, full_model_state, rng_state
from paratrain.train.loop import Trainer
from paratrain.train.partial_read import FlatRange


class RecordingEngine:
    """An engine whose whole state is one weight tensor."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def state_dict(self) -> dict:
        return {"model": {"w": self.weights}, "optim": {}}

    def restore(self, load) -> None:
        self.loaded = self.state_dict()
        load(self.loaded)

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, extra: dict, step: int, skipped_steps: int) -> None:
        pass

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict | None, step: int) -> None:
        pass


def trainer(checkpointer: Checkpointer, engine: RecordingEngine) -> Trainer:
    # The meta device stands in for CUDA: an RNG state loaded onto either is refused by torch.set_rng_state.
    return Trainer(spec=None, engine=engine, dims=None, corpus=None, device=torch.device("meta"), reporter=None,
                   checkpointer=checkpointer)


@pytest.fixture
def saved(one_rank_group, tmp_path):
    """A checkpoint at step 3 of weights arange(4) and the RNG state when it was written."""
    checkpointer = Checkpointer(tmp_path, rank=0, world_size=1, layout="dp1·tp1·pp1 z0 fp32")
    torch.manual_seed(7)
    saved_rng = rng_state()
    trainer(checkpointer, RecordingEngine(torch.arange(4.0))).save(3)
    return checkpointer, saved_rng


def test_resume_on_a_non_cpu_device_restores_the_rng_state(saved):
    checkpointer, saved_rng = saved
    torch.manual_seed(8)
    engine = RecordingEngine(torch.zeros(4))
    resumed = trainer(checkpointer, engine)

    resumed.resume()

    assert resumed.result.start_step == 3
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])
    assert torch.equal(engine.loaded["model"]["w"], torch.arange(4.0))


def test_full_model_state_reads_without_a_process_group(saved, tmp_path):
    assert torch.equal(full_model_state(tmp_path / "step-00000003")["w"], torch.arange(4.0))


def test_a_flat_range_of_a_saved_tensor_loads_from_that_range_of_its_file(one_rank_group, tmp_path):
    """What a DeepSpeed partition asks for: elements [a, b) of a tensor, flattened; the read covers those bytes, not
    the tensor (its file is 4 MiB; the range 1/16 of it)."""
    checkpointer = Checkpointer(tmp_path, rank=0, world_size=1, layout="dp1·tp1·pp1 z0 fp32")
    weights = torch.randn(1024, 1024)
    trainer(checkpointer, RecordingEngine(weights)).save(3)
    ckpt, _ = checkpointer.latest()
    start, length = 300_000, 2**16
    out = torch.zeros(length)
    read_before = int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("rchar:")))
    checkpointer.load(ckpt, {"engine": {"model": {"w": FlatRange((1024, 1024), start, out)}}})
    read = int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("rchar:"))) - read_before
    assert torch.equal(out, weights.view(-1)[start:start + length])
    assert read < 4 * length * 2, read  # the range's 256 KiB and the metadata, not the 4 MiB tensor


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def test_metadata_that_would_run_code_is_refused_before_it_runs(saved, tmp_path):
    """DCP's .metadata is a pickle: read with an unpickler that admits DCP's metadata classes only, even when the
    manifest vouches for it (a tampered store)."""
    ckpt = tmp_path / "step-00000003"
    marker = tmp_path / "code-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = hashlib.sha256((ckpt / ".metadata").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    checkpointer, _ = saved

    assert checkpointer.latest() == (ckpt, manifest)  # sound by its checksums
    with pytest.raises(CheckpointError, match="global builtins.exec is not DCP metadata"):
        checkpointer.load(ckpt, {"engine": RecordingEngine(torch.zeros(4)).state_dict()})
    with pytest.raises(CheckpointError, match="global builtins.exec is not DCP metadata"):
        full_model_state(ckpt)
    assert not marker.exists()


ENUM_BY_NAME = (  # an enum member pickled by name, as Debian bookworm's Python 3.11.2 writes DCP's _MEM_FORMAT_ENCODING
    b"\x80\x04\x8c\x08builtins\x8c\x07getattr\x93\x8c%torch.distributed.checkpoint.metadata"
    b"\x8c\x14_MEM_FORMAT_ENCODING\x93\x8c\x17TORCH_CONTIGUOUS_FORMAT\x86R.")


def test_metadata_enum_members_pickled_by_name_are_read():
    """A checkpoint written by the trainer image's Python was refused on resume (found by the kind e2e)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from paratrain.train.checkpoint import _MetadataUnpickler

    assert _MetadataUnpickler(io.BytesIO(ENUM_BY_NAME)).load() is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


@pytest.mark.parametrize(("owner", "name"), [(b"\x8c\x07pathlib\x8c\tPosixPath", b"write_text"),
                                             (b"\x8c%torch.distributed.checkpoint.metadata\x8c\x14_MEM_FORMAT_ENCODING",
                                              b"__init_subclass__")], ids=["path-method", "enum-dunder"])
def test_metadata_getattr_reaches_nothing_but_enum_members(owner, name):
    """getattr in a pickle could fetch any attribute of an admitted class (a path's write_text, then called by the
    pickle): only members of an enum are given out."""
    from paratrain.train.checkpoint import _MetadataUnpickler

    payload = (b"\x80\x04\x8c\x08builtins\x8c\x07getattr\x93" + owner + b"\x93" + bytes([0x8c, len(name)]) + name
               + b"\x86R.")
    with pytest.raises(pickle.UnpicklingError, match="is not an enum member of DCP metadata"):
        _MetadataUnpickler(io.BytesIO(payload)).load()


def tamper_metadata(ckpt, change) -> None:
    """Rewrite the checkpoint's .metadata through `change(meta)` and vouch for it in the manifest (a foreign or
    tampered writer: the checksums match)."""
    from paratrain.train.checkpoint import SafeReader

    meta = SafeReader(ckpt).read_metadata()
    change(meta)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = hashlib.sha256((ckpt / ".metadata").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/hostname", "unlisted.distcp"])
def test_metadata_pointing_outside_the_hashed_files_is_refused(saved, tmp_path, path):
    """DCP joins each item's relative_path onto the directory: only bare names the manifest hashes may be read."""
    ckpt = tmp_path / "step-00000003"
    (tmp_path / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    (ckpt / "unlisted.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())

    def redirect(meta) -> None:
        for info in meta.storage_data.values():
            info.relative_path = path
    tamper_metadata(ckpt, redirect)
    with pytest.raises(CheckpointError, match="not a data file the manifest hashes"):
        full_model_state(ckpt)
    checkpointer, _ = saved
    with pytest.raises(CheckpointError, match="not a data file the manifest hashes"):
        checkpointer.load(ckpt, {"engine": RecordingEngine(torch.zeros(4)).state_dict()})


def test_metadata_declaring_more_than_the_files_hold_is_refused_before_allocating(saved, tmp_path):
    ckpt = tmp_path / "step-00000003"

    def inflate(meta) -> None:
        meta.state_dict_metadata["engine.model.w"].size = torch.Size([10**13])  # 40 TB of fp32
    tamper_metadata(ckpt, inflate)
    with pytest.raises(CheckpointError, match=r"declares 40,000,000,0[\d,]+ bytes of tensors; the checkpoint.s files"):
        full_model_state(ckpt)


# ---- a checkpoint volume others can write: symlinks and compressed entries (issue 31) ------------------------------

def test_a_data_file_that_is_a_symlink_is_refused_even_when_its_target_matches(saved, tmp_path):
    """A writer to the volume swaps a file for a link to a file elsewhere (same bytes, so the checksum matches):
    the link is never read through by the hashing or the loader."""
    ckpt = tmp_path / "step-00000003"
    elsewhere = tmp_path / "elsewhere.distcp"
    (ckpt / "__0_0.distcp").rename(elsewhere)
    (ckpt / "__0_0.distcp").symlink_to(elsewhere)
    checkpointer, _ = saved
    assert checkpointer.latest() is None  # skipped, with the reason logged
    with pytest.raises(CheckpointError, match="__0_0.distcp is a symbolic link"):
        full_model_state(ckpt)


def test_a_step_directory_that_is_a_symlink_is_not_a_candidate(saved, tmp_path):
    from paratrain.train.checkpoint import candidates, newest_sound

    (tmp_path / "step-00000009").symlink_to(tmp_path / "step-00000003")
    assert [p.name for p in candidates(tmp_path)] == ["step-00000003"]
    with newest_sound(tmp_path) as found:
        assert found.path.name == "step-00000003"


def test_what_is_loaded_is_what_was_hashed_whatever_is_swapped_in_after(saved, tmp_path):
    """Issue 42: the check and the read use one descriptor. After `latest` verified the checkpoint, a writer to the
    volume renames other bytes over a data file and swaps the step directory for a link to a copy it made: the
    load still reads the files that were hashed."""
    import os

    checkpointer, _ = saved
    ckpt, _ = checkpointer.latest()
    forged = tmp_path / "forged"
    shutil.copytree(ckpt, forged)
    data = forged / "__0_0.distcp"
    original = data.read_bytes()
    data.write_bytes(original.replace(torch.arange(4.0).numpy().tobytes(), torch.full((4,), 9.0).numpy().tobytes()))
    assert data.read_bytes() != original  # the forgery holds other weights
    os.replace(data, ckpt / "__0_0.distcp")  # other bytes, renamed over the hashed file
    os.rename(ckpt, tmp_path / "moved")
    ckpt.symlink_to(forged)  # and the directory itself now a link
    state = {"engine": {"model": {"w": torch.zeros(4)}, "optim": {}}}
    checkpointer.load(ckpt, state)
    assert torch.equal(state["engine"]["model"]["w"], torch.arange(4.0))
    checkpointer.release()
    with pytest.raises(CheckpointError, match="cannot be opened as a directory"):  # opened afresh: refused
        checkpointer.load(ckpt, state)


def test_a_file_another_rank_hashed_must_still_be_that_file_when_this_rank_opens_it(saved, tmp_path):
    """With several ranks each hashes a share; a rank opening a file another hashed checks it is the same file
    (device, inode, size): one renamed over it since is refused, not read."""
    import os

    from paratrain.train.checkpoint import CheckpointFiles

    ckpt = tmp_path / "step-00000003"
    with CheckpointFiles(ckpt) as hasher:  # "another rank"
        print_of_data = hasher.fingerprint("__0_0.distcp")
    with CheckpointFiles(ckpt) as reader:
        reader.verified["__0_0.distcp"] = print_of_data
        shutil.copy(ckpt / "__0_0.distcp", tmp_path / "copy")
        os.replace(tmp_path / "copy", ckpt / "__0_0.distcp")  # the same bytes, but not the file that was hashed
        with pytest.raises(OSError, match="__0_0.distcp was replaced after its checksum was checked"):
            reader.open("__0_0.distcp")


def test_the_hash_never_reads_through_a_link(tmp_path):
    from paratrain.token_shards import sha256_file

    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert sha256_file(tmp_path / "link") == sha256_file(tmp_path / "file")  # token shards may be links
    with pytest.raises(OSError):
        sha256_file(tmp_path / "link", follow_symlinks=False)


def rewrite_tensor_archives(ckpt, compression: int) -> None:
    """Re-zip every tensor archive of the checkpoint's data file with `compression` (torch stores them
    uncompressed; torch's reader inflates a deflated entry all the same), vouching for it in the manifest."""
    import zipfile

    from paratrain.train.checkpoint import SafeReader

    meta = SafeReader(ckpt).read_metadata()
    data = (ckpt / "__0_0.distcp").read_bytes()
    out = io.BytesIO()
    for info in sorted(meta.storage_data.values(), key=lambda i: i.offset):
        archive = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data[info.offset:info.offset + info.length])) as src, \
                zipfile.ZipFile(archive, "w", compression) as dst:
            for entry in src.infolist():
                dst.writestr(entry.filename, src.read(entry.filename))
        info.offset, info.length = out.tell(), len(archive.getvalue())
        out.write(archive.getvalue())
    (ckpt / "__0_0.distcp").write_bytes(out.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in ("__0_0.distcp", ".metadata"):
        manifest["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_tensor_archive_with_compressed_entries_is_refused_before_torch_inflates_it(saved, tmp_path):
    import zipfile

    ckpt = tmp_path / "step-00000003"
    rewrite_tensor_archives(ckpt, zipfile.ZIP_STORED)  # the same re-zip, stored: still loads
    assert torch.equal(full_model_state(ckpt)["w"], torch.arange(4.0))
    rewrite_tensor_archives(ckpt, zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match="holds compressed entries"):
        full_model_state(ckpt)
    checkpointer, _ = saved
    with pytest.raises(CheckpointError, match="holds compressed entries"):
        checkpointer.load(ckpt, {"engine": RecordingEngine(torch.zeros(4)).state_dict()})


def test_metadata_asking_for_a_load_transform_is_refused(saved, tmp_path):
    ckpt = tmp_path / "step-00000003"

    def transform(meta) -> None:
        for info in meta.storage_data.values():
            info.transform_descriptors = ["zstandard"]
    tamper_metadata(ckpt, transform)
    with pytest.raises(CheckpointError, match="asks for transforms"):
        full_model_state(ckpt)


def test_old_checkpoints_leave_at_once_and_are_deleted_off_the_training_path(one_rank_group, tmp_path, monkeypatch):
    """keep 2: the third save's commit renames the oldest aside (no longer a candidate, never a half-deleted
    checkpoint) and deletes it in a thread the save does not wait for; the next save, or the run's end (wait),
    finds it gone."""
    from paratrain.train import checkpoint

    checkpointer = Checkpointer(tmp_path, rank=0, world_size=1, layout="dp1·tp1·pp1 z0 fp32", keep=2)
    deleting, release = [], threading.Event()

    def slow_remove(paths):
        deleting.extend(p.name for p in paths)
        release.wait(30)
        for path in paths:
            shutil.rmtree(path)

    monkeypatch.setattr(checkpoint, "_remove_all", slow_remove)
    engine = RecordingEngine(torch.arange(4.0))
    for step in (1, 2, 3):
        trainer(checkpointer, engine).save(step)  # returns while step 1's removal is still held
    assert [p.name for p in checkpointer.candidates()] == ["step-00000003", "step-00000002"]
    assert deleting == [".pruned-step-00000001"] and (tmp_path / ".pruned-step-00000001").exists()
    release.set()
    checkpointer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_files_are_hashed_as_they_are_written_not_read_back(one_rank_group, tmp_path, monkeypatch, asynchronous):
    """The manifest's digests are the files' SHA-256s, taken while DCP wrote them: nothing is read back to hash
    it (at 8B that was about 100 GB per save on the training path)."""
    from paratrain.train import checkpoint

    read_back = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path, **kw: read_back.append(path) or "x")
    checkpointer = Checkpointer(tmp_path, rank=0, world_size=1, layout="dp1·tp1·pp1 z0 fp32",
                                asynchronous=asynchronous)
    trainer(checkpointer, RecordingEngine(torch.arange(4.0))).save(3)
    checkpointer.wait()
    assert read_back == []
    manifest = json.loads((tmp_path / "step-00000003" / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in (tmp_path / "step-00000003").iterdir()} - {"manifest.json"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((tmp_path / "step-00000003" / name).read_bytes()).hexdigest() == digest, name
