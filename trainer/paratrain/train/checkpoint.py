"""Checkpoints in torch.distributed.checkpoint (DCP) format: keyed by the full model's parameter names, so a
checkpoint written by one layout loads into another; atomic; loaded without unpickling arbitrary objects.

Layout: `<path>/step-00000100/{__0_0.distcp, __1_0.distcp, ..., .metadata, manifest.json}`. Every rank hands DCP
its part of the state — the FQN-keyed model and optimizer tensors (plain, or DTensors of its shard) and, under
`rank.NNNNN.*`, the per-rank state that cannot reshard (RNG streams) — and DCP writes each distinct piece once: a
tensor that data-parallel replicas hold identically is written by one of them. Files go under a hidden
`.tmp-step-*` directory; once DCP has written them (and its `.metadata`), every rank hashes a share of the files,
rank 0 writes the manifest (each file's SHA-256) and renames the directory into place — one atomic rename is what
makes a checkpoint exist. With async saves (`spec.checkpoint.async`) the files are written in the background and
that commit waits for the next save or the end of training.

On start, the ranks verify the newest candidate's files against its manifest (each rank a share); the newest
checkpoint whose every file is sound is loaded, and a corrupt or truncated one is reported by file name and
skipped. DCP reads tensors with `torch.load(weights_only=True)`; its `.metadata` (a pickle) is read with an
unpickler that admits only DCP's metadata classes and the few torch and builtin types they hold. A checkpoint is
read through one `CheckpointFiles`: its directory and each file opened once, never through a link, and a file read
is the very file its hash was checked on (the same descriptor, or, where another rank hashed it, the same inode):
a file swapped on the volume after the check is refused, not read.

Two things fail the job instead of being skipped (CheckpointError, exit 2), because skipping would let the next
saves overwrite what the user still needs: a checkpoint that does not fit the model (another size or format), and
a file whose checksum matches but which holds other objects (not corruption but a foreign or tampered writer; the
file is kept for inspection). Another layout is not refused: it is resharded on load.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import io
import json
import logging
import math
import os
import pickle
import shutil
import stat
import threading
import warnings
import zipfile
from concurrent.futures import Future
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..token_shards import sha256_file  # the one streaming file hash (token shards and checkpoint files alike)
from .partial_read import FlatRange, read_box

log = logging.getLogger("paratrain.checkpoint")
MANIFEST = "manifest.json"
PRUNED = ".pruned-"  # an old checkpoint renamed aside, being deleted (Checkpointer._prune)
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2  # 1: one torch.save file per rank, loadable only into the layout that wrote it
MODEL_PREFIX = "engine.model."  # where the model's tensors sit among DCP's flattened keys


class CheckpointError(ValueError):
    """A checkpoint that must neither be loaded nor silently replaced."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_key(rank: int) -> str:
    """The key of a rank's own, non-reshardable state within a checkpoint."""
    return f"{rank:05d}"


def sharding(layout: str) -> str:
    """A layout label without its precision (`dp2·tp2·pp1 z1 bf16` → `dp2·tp2·pp1 z1`): how the state is split over
    ranks. Per-rank state (RNG streams) is restored only into the same sharding on as many ranks."""
    return layout.rpartition(" ")[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_manifest(ckpt: Path | CheckpointFiles) -> dict | None:
    try:
        if isinstance(ckpt, CheckpointFiles):
            with ckpt.open(MANIFEST) as f:
                text = f.read()
        else:
            with open(os.open(ckpt / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                text = f.read()
        manifest = json.loads(text)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


# (st_size, st_mtime_ns): which file another rank hashed, as every node sees it (st_dev, and on some FUSE mounts
# st_ino, differ between the nodes of one shared filesystem; a rename over the file changes its mtime).
Fingerprint = tuple[int, int]


class CheckpointFiles:
    """A checkpoint's directory and files, each opened once: the directory with O_NOFOLLOW | O_DIRECTORY, each file
    by its bare name relative to that directory's descriptor with O_NOFOLLOW, so no link is ever followed (a
    directory or file swapped for a link after a check is never read through). Hashing and reading use the same
    descriptor (positioned reads: each reader keeps its own offset). `verified` holds each file's fingerprint as it
    was hashed, by this rank or another: a file this rank opens later must still be that file (a rename over it is
    refused as changed, not read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._dir = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self._fds: dict[str, int] = {}
        self.verified: dict[str, Fingerprint] = {}

    def fd(self, name: str) -> int:
        if name not in self._fds:
            if Path(name).name != name or name in (".", ".."):
                raise OSError(f"{name!r} is not a file of the checkpoint's own directory")
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._dir)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(f"{name} is not a plain file")
                if name in self.verified and (info.st_size, info.st_mtime_ns) != self.verified[name]:
                    raise OSError(f"{name} was replaced after its checksum was checked")
            except OSError:
                os.close(fd)
                raise
            self._fds[name] = fd
        return self._fds[name]

    def fingerprint(self, name: str) -> Fingerprint:
        info = os.fstat(self.fd(name))
        return info.st_size, info.st_mtime_ns

    def size(self, name: str) -> int:
        """A plain file's size, without opening it (a rank reads few of a large checkpoint's files)."""
        if name in self._fds:
            return os.fstat(self._fds[name]).st_size
        info = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{name} is not a plain file")
        return info.st_size

    def open(self, name: str) -> io.BufferedReader:
        """A reader of the file from its start, with an offset of its own."""
        fd = self.fd(name)  # the block size as open() would buffer: partial reads seek a lot, and read what they ask
        return io.BufferedReader(_positioned(fd), buffer_size=max(os.fstat(fd).st_blksize, 512))

    def sha256(self, name: str) -> str:
        digest, fd, at = hashlib.sha256(), self.fd(name), 0
        while block := os.pread(fd, 1 << 22, at):
            digest.update(block)
            at += len(block)
        return digest.hexdigest()

    def close(self) -> None:
        for fd in [*self._fds.values(), self._dir]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _positioned(fd: int) -> _Window:
    """The whole file of a descriptor, read with pread at an offset of its own (several readers share one
    descriptor; closing it leaves the descriptor to its CheckpointFiles)."""
    return _Window(None, 0, os.fstat(fd).st_size, fd=fd)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: its dataclasses, torch.Size, dtypes and layouts, and the
    checkpoint id (a path). Any other global — exec, os.system, a tensor rebuild — is refused before it is called."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            # Some Pythons pickle an enum member by name, as getattr(Enum, "NAME") (Debian bookworm's 3.11.2, in the
            # trainer image, writes _MEM_FORMAT_ENCODING so); anything but a member of an admitted enum is refused.
            return _enum_member
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def _enum_member(owner: Any, name: Any) -> enum.Enum:
    """getattr for `_MetadataUnpickler`, narrowed to an enum's member: the owner is itself a global the unpickler
    admitted, and no method or attribute of it (a path's write_text, say) can be reached this way."""
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str) and name in owner.__members__:
        return owner[name]
    raise pickle.UnpicklingError(f"getattr({getattr(owner, '__name__', type(owner).__name__)}, {name!r}) is not an "
                                 "enum member of DCP metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read by `_MetadataUnpickler` (tensors DCP already reads weights-only), and
    held to what the manifest vouches for: DCP joins each item's `relative_path` onto the directory, so every one
    must be a bare name the manifest hashes (not `../x` or `/x`, files no checksum covers); and the tensors it
    declares cannot hold more bytes than the checkpoint's files do (a reader allocates them from these sizes)."""

    def __init__(self, path: str | os.PathLike, files: CheckpointFiles | None = None):
        super().__init__(path)
        self.files = files or CheckpointFiles(path)  # every read goes through it: no path is opened again

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        files = self.files
        try:
            with files.open(DCP_METADATA) as f:
                meta = _MetadataUnpickler(f).load()
        except OSError as exc:
            raise pickle.UnpicklingError(f"{DCP_METADATA} cannot be read as a plain file: {exc}") from None
        if not isinstance(meta, metadata.Metadata):
            raise pickle.UnpicklingError(f"{DCP_METADATA} holds a {type(meta).__name__}, not DCP metadata")
        hashed = set(((_read_manifest(files) or {}).get("files") or {}))
        for info in (meta.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if name not in hashed or name in (DCP_METADATA, MANIFEST) or Path(name).name != name:
                raise pickle.UnpicklingError(f"{DCP_METADATA} points at {name!r}, not a data file the manifest hashes")
        declared = sum(math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
                       for md in meta.state_dict_metadata.values() if isinstance(md, metadata.TensorStorageMetadata))
        try:
            stored = sum(files.size(name) for name in hashed if name not in (DCP_METADATA, MANIFEST))
        except OSError as exc:
            raise pickle.UnpicklingError(f"a data file cannot be read as a plain file: {exc}") from None
        if declared > stored:
            raise pickle.UnpicklingError(f"{DCP_METADATA} declares {declared:,} bytes of tensors; the checkpoint's "
                                         f"files hold {stored:,}")
        for info in (meta.storage_data or {}).values():
            if getattr(info, "transform_descriptors", None):  # e.g. a decompression DCP would apply: never written here
                raise pickle.UnpicklingError(f"{DCP_METADATA} asks for transforms {info.transform_descriptors!r} on "
                                             f"{info.relative_path}; this trainer writes plain tensors")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """DCP's reading, but of each requested piece only (partial_read.read_box: a rank that keeps 1/N of a
        tensor reads 1/N of it, where DCP's own reader loads it whole). Our checkpoints hold tensors only: an item
        stored as pickled bytes (which DCP would unpickle freely) is refused. Each tensor is one torch.save zip
        archive, which torch writes uncompressed; one with a compressed entry (torch's reader inflates it: a 98 KB entry
        became a 100 MB tensor) or entries larger than its slice is refused before torch.load sees it."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                stream = self.files.open(relative_path)
            except OSError as exc:
                raise pickle.UnpicklingError(f"{relative_path} cannot be read as the file checked: {exc}") from None
            with stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    if item.type == LoadItemType.BYTE_IO:
                        raise pickle.UnpicklingError(f"{item.dest_index.fqn} is stored as pickled bytes, not a "
                                                     "tensor")
                    info = self.storage_data[item.storage_index]
                    archive = _Window(stream, info.offset, info.length)
                    refuse_compressed(archive, f"{info.relative_path}@{info.offset}")
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != tuple(item.lengths):  # DCP's own reader checks this too
                        raise AssertionError(f"{item.dest_index.fqn}: a piece of {tuple(item.lengths)} planned "
                                             f"into a tensor of {tuple(target.shape)}")
                    read_box(archive, item.storage_offsets, item.lengths, target)
                    planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a seekable file, or of a descriptor (`fd`, read with pread), as a file of
    their own (standard seek semantics)."""

    def __init__(self, file: Any, offset: int, length: int, fd: int | None = None):
        super().__init__()
        self._file, self._fd, self._offset, self._length, self._pos = file, fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + pos), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._length - self._pos))
        view = memoryview(buffer).cast("B")[:size]  # straight into the caller's buffer
        if self._fd is not None:
            got = os.preadv(self._fd, [view], self._offset + self._pos)
        else:
            self._file.seek(self._offset + self._pos)
            got = self._file.readinto(view)
        self._pos += got
        return got


def refuse_compressed(archive: Any, what: str) -> None:
    """UnpicklingError unless `archive` (a seekable file) is a zip whose entries are all stored uncompressed and
    add up to no more than the archive itself."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            entries = zipped.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise pickle.UnpicklingError(f"{what} is not a tensor archive ({exc})") from None
    compressed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise pickle.UnpicklingError(f"{what} holds compressed entries ({', '.join(compressed[:3])}); torch writes "
                                     "tensors uncompressed, and a compressed entry can inflate far past its size")
    size = archive.seek(0, io.SEEK_END)
    if sum(e.file_size for e in entries) > size:
        raise pickle.UnpicklingError(f"{what} declares entries larger than the archive")


class RangeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, which also takes FlatRange templates (a flat range of a saved tensor) among the tensors."""

    def set_up_planner(self, state_dict: dict, metadata: metadata.Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """DefaultLoadPlanner's set-up less its first move (`_init_state_dict`), which makes meta-device tensors
        real and turns every object it does not know, a FlatRange among them, into None. A template on the meta
        device would load nothing: refused."""
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        if meta := [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_meta]:
            raise ValueError(f"load templates on the meta device hold no memory to load into: {meta[:3]}")
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def lookup_tensor(self, index: metadata.MetadataIndex) -> torch.Tensor:
        found = self.state_dict[index.fqn]  # DCP itself looks up a piece by offset only in a tensor
        return found.__get_tensor_shard__(index) if isinstance(found, FlatRange) else super().lookup_tensor(index)


def verify(ckpt: Path, manifest: dict | None, names: list[str] | None = None,
           files: CheckpointFiles | None = None) -> str | None:
    """None if the files `names` (default: all) of `ckpt` match its manifest, else what is wrong, by file name.
    Each file is hashed through `files` (opened here when not given), and its fingerprint kept there as verified."""
    if manifest is None:
        return "unreadable manifest"
    if manifest.get("format") != FORMAT_VERSION:
        return f"format {manifest.get('format')}, not {FORMAT_VERSION}"
    listed = manifest.get("files", {})
    if DCP_METADATA not in listed:
        return f"manifest lists no {DCP_METADATA}"
    if files is None:
        try:
            with CheckpointFiles(ckpt) as opened:
                return verify(ckpt, manifest, names, opened)
        except OSError:
            return f"{ckpt.name} is a symbolic link or not a directory (a checkpoint holds plain files only)"
    for name in sorted(listed) if names is None else names:
        if Path(name).name != name or name in (".", ".."):
            return f"the manifest names {name!r}, not a file of the checkpoint's own directory"
        try:
            digest = files.sha256(name)
        except FileNotFoundError:
            return f"{name} missing"
        except OSError as exc:  # a symbolic link (ELOOP), not a plain file, or unreadable
            why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read as a plain file ({exc})"
            return f"{name} {why} (a checkpoint holds plain files only)"
        if digest != listed[name]:
            return f"{name} is corrupt or truncated (checksum mismatch)"
        files.verified[name] = files.fingerprint(name)
    return None


def _first_failure(exc: BaseException) -> BaseException:
    """DCP's CheckpointException wraps each failing rank's (exception, traceback); the first says what went wrong."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc, _ = next(iter(exc.failures.values()))
    return exc


def _dcp_failure(exc: BaseException) -> str:
    exc = _first_failure(exc)
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


class HashingFileSystem(FileSystem):
    """DCP's local file system, hashing each file as it is written: the manifest's digests without reading every
    file back (about 100 GB per save at 8B). A file written other than front to back (a seek) is left to be hashed
    after. Renames (the metadata file's) carry the digest along."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        if stream.in_order:
            with self._lock:
                self.digests[Path(path).name] = stream.sha.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (digest := self.digests.pop(Path(path).name, None)) is not None:
                self.digests[Path(new_path).name] = digest


class _HashingStream:
    """The file object DCP writes to, passing every call through and hashing the bytes written, in order."""

    def __init__(self, raw) -> None:
        self.raw, self.sha, self.in_order = raw, hashlib.sha256(), True

    def write(self, data) -> int:
        self.sha.update(data)
        return self.raw.write(data)

    def seek(self, *args) -> int:
        self.in_order = False
        return self.raw.seek(*args)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


@dataclass
class Checkpointer:
    root: Path
    rank: int
    world_size: int
    layout: str  # layout_label of this job: per-rank state loads only into the same sharding
    keep: int = 2
    asynchronous: bool = False  # spec.checkpoint.async: write in the background, commit at the next save or the end
    # Checkpoint collectives run on a group of their own (gloo: DCP's plans are Python objects), so that an async
    # save's background thread never interleaves with training's collectives on the default group.
    group: dist.ProcessGroup | None = None
    _pending: tuple[Future, int, dict] | None = field(default=None, repr=False)
    _pruner: threading.Thread | None = field(default=None, repr=False)
    _hashing: HashingFileSystem | None = field(default=None, repr=False)  # the save in flight's writer
    _files: CheckpointFiles | None = field(default=None, repr=False)  # the checkpoint `latest` found, open

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = dist.new_group(backend="gloo")

    def _tmp(self, step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(step)}"

    def save(self, step: int, state: dict, meta: dict) -> int | None:
        """Collective: every rank calls it with its part of the state. `meta` (rank 0's) goes into the manifest.
        Returns the step whose checkpoint this call committed: `step`, or with async saves the previous one's."""
        committed = self.wait()
        tmp = self._tmp(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._join_pruner()
            for debris in [*self.root.glob(".tmp-step-*"), *self.root.glob(f"{PRUNED}*")]:  # of a crash mid-write
                shutil.rmtree(debris, ignore_errors=True)
            tmp.mkdir()
        dist.barrier(group=self.group)
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        writer.fs = self._hashing = HashingFileSystem()
        if self.asynchronous:
            # async_save stages the state into CPU memory before it returns: training may go on changing it.
            self._pending = (dcp.async_save(state, storage_writer=writer, process_group=self.group), step, meta)
            return committed
        dcp.save(state, storage_writer=writer, process_group=self.group)
        self._commit(step, meta)
        return step

    def wait(self) -> int | None:
        """Collective: finish an async save in flight (its files, then the manifest and rename) and return its
        step; None if none was in flight."""
        self._join_pruner()
        if self._pending is None:
            return None
        future, step, meta = self._pending
        self._pending = None
        future.result()
        self._commit(step, meta)
        return step

    def _commit(self, step: int, meta: dict) -> None:
        """The digest of every file DCP wrote (each rank hashed its own as it wrote them; a file none did is read
        back, each rank a share), then rank 0 writes the manifest and renames into place."""
        tmp, final = self._tmp(step), self.root / step_dir_name(step)
        names = self._rank0_says(sorted(p.name for p in tmp.iterdir()) if self.rank == 0 else None)
        files = self._gathered(self._hashing.digests if self._hashing else {}, names)
        self._hashing = None
        if rest := [name for name in names if name not in files]:  # the same list on every rank
            files |= self._gathered({name: sha256_file(tmp / name) for name in rest[self.rank::self.world_size]},
                                    names)
        if self.rank == 0:
            manifest = {"format": FORMAT_VERSION, "step": step, "worldSize": self.world_size, "layout": self.layout,
                        "files": files, **meta}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier(group=self.group)

    def _gathered(self, digests: dict[str, str], names: list[str]) -> dict[str, str]:
        """Collective: every rank's digests of the files among `names`, merged."""
        shares: list[Any] = [None] * self.world_size
        dist.all_gather_object(shares, digests, group=self.group)
        return {name: digest for share in shares for name, digest in share.items() if name in names}

    def _prune(self) -> None:
        """Rank 0, after a commit: the checkpoints past `keep` stop being candidates at once (renamed aside, so a
        crash mid-delete leaves debris, never a damaged checkpoint to skip), and are deleted off the training path,
        in a thread: at 8B each is about 100 GB of files, which every rank would otherwise wait for."""
        self._join_pruner()
        doomed = []
        for old in self.candidates()[self.keep:]:
            aside = old.with_name(PRUNED + old.name)
            try:
                old.rename(aside)
            except OSError:
                aside = old
            doomed.append(aside)
        if doomed:
            self._pruner = threading.Thread(target=_remove_all, args=(doomed,), name="paratrain-prune", daemon=True)
            self._pruner.start()

    def _join_pruner(self) -> None:
        """Before the next save, and at the end of a run: the previous prune has finished."""
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def candidates(self) -> list[Path]:
        return candidates(self.root)

    def _check_format(self, ckpt: Path, manifest: dict) -> None:
        """Raise on every rank (they read the same manifest) if `ckpt` is of a format this version cannot read."""
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"spec.checkpoint.path: checkpoint {ckpt} is of format {manifest.get('format')} (one file per "
                f"rank, readable only by the layout that wrote it), this version reads format {FORMAT_VERSION} "
                "(DCP). Resume it with the paratrain version that wrote it, or give this job a new checkpoint.path "
                "(training from scratch here would replace those checkpoints).")

    def _every_rank(self, problem: str | None) -> list[str]:
        """Collective: every rank's problem, the same list on every rank (empty: all fine)."""
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        return [p for p in problems if p]

    def _rank0_says(self, value: Any) -> Any:
        """Collective: rank 0's `value` on every rank. What rank 0 sees of the checkpoint directory is what every
        rank works from: on a network filesystem another rank's listing can lag, and ranks that disagree on the
        file set leave a file unhashed, or call different collectives and hang."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def latest(self) -> tuple[Path, dict] | None:
        """Collective: the newest checkpoint whose every file matches its manifest, with the manifest, or None. Its
        files stay open (`load` reads through them): what each rank loads is what was hashed."""
        seen = self._rank0_says([(p.name, _read_manifest(p)) for p in self.candidates()] if self.rank == 0 else None)
        for name, manifest in seen:
            ckpt = self.root / name
            if manifest is not None:
                self._check_format(ckpt, manifest)
            names = sorted(manifest.get("files", {})) if manifest else []
            try:
                files: CheckpointFiles | None = CheckpointFiles(ckpt)
            except OSError:
                files = None
            problem = verify(ckpt, manifest, names[self.rank::self.world_size], files) if files else \
                f"{name} is a symbolic link or not a directory (a checkpoint holds plain files only)"
            shares: list[tuple[str | None, dict[str, Fingerprint]]] = [(None, {})] * self.world_size
            dist.all_gather_object(shares, (problem, files.verified if files else {}), group=self.group)
            problems = [p for p, _ in shares if p]
            if problems:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", ckpt, "; ".join(dict.fromkeys(problems)))
                if files:
                    files.close()
                continue
            assert files is not None
            for _, verified in shares:  # every rank's share: a file this rank reads is the file another hashed
                files.verified.update(verified)
            self.release()
            self._files = files
            return ckpt, manifest
        return None

    def release(self) -> None:
        """Close the files `latest` left open for loading."""
        if self._files is not None:
            self._files.close()
            self._files = None

    def same_sharding(self, manifest: dict) -> bool:
        """Whether `manifest`'s checkpoint was written by this layout (any precision) on as many ranks: then each
        rank's own state (rank.NNNNN.*) is there for it."""
        return manifest["worldSize"] == self.world_size and sharding(manifest["layout"]) == sharding(self.layout)

    def load(self, ckpt: Path, state: dict) -> None:
        """Collective: fill `state` (tensors, plain or DTensor shards, keyed as saved) in place from `ckpt`,
        resharding as needed. A checkpoint that does not fit, or whose metadata is not plain DCP metadata, raises
        CheckpointError on every rank."""
        kept = self._files if self._files is not None and self._files.path == Path(ckpt) else None
        try:
            files = kept or CheckpointFiles(ckpt)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {ckpt} refused: it cannot be opened as a directory ({exc})") from None
        try:
            self._load(ckpt, state, files)
        finally:
            if kept is None:
                files.close()

    def _load(self, ckpt: Path, state: dict, files: CheckpointFiles) -> None:
        reader = SafeReader(ckpt, files)
        try:
            reader.read_metadata()  # refused here, by its reason, rather than inside DCP's fallbacks
            dcp.load(state, storage_reader=reader, planner=RangeLoadPlanner(), process_group=self.group)
        except CheckpointException as exc:  # not a peer's failure: that stays retryable
            if isinstance(_first_failure(exc), pickle.UnpicklingError):  # a tensor archive refused while reading
                raise CheckpointError(f"checkpoint {ckpt} refused: {_dcp_failure(exc)}. It is left in place; move "
                                      "it away to resume from an earlier checkpoint.") from None
            # DCP's plan failed: names or shapes differ. Earlier checkpoints of the same directory were written by
            # the same model, so they would not fit either.
            raise CheckpointError(
                f"checkpoint {ckpt} does not fit this model ({_dcp_failure(exc)}): it was written by another model "
                "(size, family, vocabulary or bias), or by a paratrain from before q, k and v were fused "
                "(parameters layers.N.attn.wq/wk/wv, now attn.wqkv). Resume it with the spec and version that "
                "wrote it, or give this job a new spec.checkpoint.path to train from scratch; the checkpoints are "
                "left in place.") from None
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"checkpoint {ckpt} refused: {_dcp_failure(exc)}. It is left in place; move it "
                                  "away to resume from an earlier checkpoint.") from None


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def candidates(root: Path) -> list[Path]:
    """Directories under `root` that look like finished checkpoints, newest first (not yet verified)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if (p / MANIFEST).is_file() and not p.is_symlink()), reverse=True)


def newest_sound(path: str | os.PathLike) -> CheckpointFiles:
    """`path` if it is a checkpoint (a step directory), else the newest checkpoint under it whose files match their
    manifest, as a resuming job would pick, opened (its `verified` filled where it was checked here; the caller
    closes it); CheckpointError naming what is wrong otherwise."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        try:
            return CheckpointFiles(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be opened as a checkpoint directory ({exc})") from None
    problems = []
    for ckpt in candidates(path):
        try:
            files = CheckpointFiles(ckpt)
        except OSError as exc:
            problems.append(f"{ckpt.name}: {exc}")
            continue
        problem = verify(ckpt, _read_manifest(files), files=files)
        if problem is None:
            return files
        files.close()
        problems.append(f"{ckpt.name}: {problem}")
    found = f"; skipped {'; '.join(problems)}" if problems else ""
    raise CheckpointError(f"{path}: no complete checkpoint (a step-* directory with {MANIFEST}){found}")


class CheckpointModel(Mapping[str, torch.Tensor]):
    """The model of a checkpoint written by any layout: whole fp32 tensors keyed by parameter name (as in
    `GPT.state_dict()`), each read when asked for, each rank's pieces joined. Names and shapes (`shapes`) come from
    its metadata, without reading a tensor: an exporter holds one at a time, not the model. Single process, no
    process group. The files are verified first, through the descriptors every later read uses, unless the caller
    hands in files it just verified (newest_sound's: hashing again would read the checkpoint twice)."""

    def __init__(self, ckpt: str | os.PathLike | CheckpointFiles):
        if isinstance(ckpt, CheckpointFiles):
            self.files = ckpt
        else:
            try:
                self.files = CheckpointFiles(ckpt)
            except OSError as exc:
                raise CheckpointError(f"checkpoint {ckpt}: cannot be opened as a directory ({exc})") from None
        self.ckpt = self.files.path
        try:
            self.manifest = manifest = _read_manifest(self.files)
            unchecked = sorted(set((manifest or {}).get("files") or {}) - set(self.files.verified))
            if (unchecked or manifest is None) and (problem := verify(self.ckpt, manifest, unchecked, self.files)):
                raise CheckpointError(f"checkpoint {self.ckpt}: {problem}")
            try:
                stored = SafeReader(self.ckpt, self.files).read_metadata().state_dict_metadata
            except pickle.UnpicklingError as exc:
                raise CheckpointError(f"checkpoint {self.ckpt} refused: {exc}") from None
        except BaseException:
            self.files.close()  # refused: nothing of it stays open
            raise
        self._stored = {key.removeprefix(MODEL_PREFIX): md for key, md in stored.items()
                        if key.startswith(MODEL_PREFIX) and isinstance(md, metadata.TensorStorageMetadata)}
        self.shapes = {name: md.size for name, md in self._stored.items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `names`, in one load."""
        state = {MODEL_PREFIX + n: torch.empty(self._stored[n].size, dtype=self._stored[n].properties.dtype)
                 for n in names}
        with warnings.catch_warnings():  # that no_dist means one process is what we ask for
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            try:
                dcp.load(state, storage_reader=SafeReader(self.ckpt, self.files), planner=RangeLoadPlanner(),
                         no_dist=True)
            except (pickle.UnpicklingError, CheckpointException) as exc:
                raise CheckpointError(f"checkpoint {self.ckpt} refused: {_dcp_failure(exc)}") from None
        return {key.removeprefix(MODEL_PREFIX): value.float() for key, value in state.items()}


def full_model_state(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model of a checkpoint at once (CheckpointModel's tensors, verified first)."""
    model = CheckpointModel(ckpt_dir)
    with model.files:
        return model.read(model)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
