"""Sharded checkpoint state through torch.distributed.checkpoint (DCP): each rank writes the pieces it owns.

Every tensor is stored in its true shape under the name `model.state_dict()` gives it (optimizer state under
`optim/<name>/<key>`), so that `torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=CKPT)` fills
a freshly built model with torch alone (README, "Reading weights with torch alone"); a tied head is a second
name for the embedding's stored chunks (`writer(aliases=...)`), no second copy; non-tensor module state (the
expert lifecycle's event log) is stored as DCP bytes under its `_extra_state` key for torch's loader, and read
here from extra_state.json only.

What a rank owns of a tensor is a contiguous range of it flattened: a ZeRO-1/2 fragment (an arbitrary range of
the parameter inside a rank's flat partition), a ZeRO-3 partition (the last one padded in memory; only its valid
part is written), a slice of stacked experts [E_local, ...] owned by an expert-parallel rank, or a replica's
share of a replicated tensor. Such a range is no rectangle of the N-d tensor, but it is a few of them
(`flat_boxes`: a partial leading row, whole rows, a partial trailing row, recursively per dimension), each
contiguous in memory. A `FlatShard` writes each box as one DCP chunk at its N-d offset and asks for the same
boxes at load, through DCP's checkpointable hooks (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`), which DTensor cannot describe for such ranges; the planners below look it up. At load
DCP's planner reads whichever saved chunks overlap the boxes a rank asks for: this is the resharding.

Checkpoints written before 2026-12-03 stored every tensor flattened to 1-D under `model/<name>` (shapes in
`tensors.json`); they are still read: `ShardLoadPlanner` asks for the same ranges in that layout (`is_legacy`).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException as DCPError  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from moep_ds.errors import SharedUserError

METADATA_FILE = ".metadata"
MODEL_PREFIX = ""  # parameters (fp32 masters) and buffers: under their state_dict() names, nothing before them
OPTIM_PREFIX = "optim/"  # optim/<name>/<state key>, in the parameter's shape
# the format before 2026-12-03 (read only): 1-D tensors under model/<name>, their shapes in tensors.json
LEGACY_MODEL_PREFIX = "model/"
TENSORS_FILE = "tensors.json"  # {canonical name: [N-d shape]}
EXTRA_STATE_SUFFIX = "_extra_state"  # torch's key of a module's get_extra_state() in state_dict()


class CheckpointError(SharedUserError):
    """A checkpoint that cannot be used (every rank finds the same), named in one line."""


class DamagedCheckpoint(CheckpointError):
    """Missing, truncated or unreadable files, or files failing their checksum (manifest.py): `--resume auto` falls
    back to the previous checkpoint."""


Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # (flat start, N-d offsets, N-d sizes)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Elements [start, stop) of a row-major tensor of `shape` as rectangular boxes, in order: a partial leading
    row (split again along the next dimension), the whole rows, a partial trailing row. Each box is a contiguous
    run of the flat tensor (at most 2 * ndim - 1 of them)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, (start,) if shape else (), (stop - start,) if shape else ())]
    row = math.prod(shape[1:])
    inner = tuple(shape[1:])

    def in_row(r: int, lo: int, hi: int) -> list[Box]:  # [lo, hi) of row r
        return [(r * row + f, (r, *o), (1, *z)) for f, o, z in flat_boxes(inner, lo, hi)]

    first, last = divmod(start, row), divmod(stop, row)
    if first[0] == last[0]:  # within one row
        return in_row(first[0], first[1], last[1])
    out, r = [], first[0]
    if first[1]:
        out += in_row(r, first[1], row)
        r += 1
    if last[0] > r:
        out.append((r * row, (r, *(0 for _ in inner)), (last[0] - r, *inner)))
    if last[1]:
        out += in_row(last[0], 0, last[1])
    return out


class FlatShard:
    """Elements [offset, offset + len(local)) of a tensor of `numel` elements, flattened in row-major order; the
    tensor's `shape` (1-D by default) is what the checkpoint stores, as the boxes `flat_boxes` cuts the range into.

    `local` is a contiguous 1-D tensor (a view into the owner's storage, so that DCP loads in place)."""

    def __init__(self, local: torch.Tensor, offset: int, numel: int, shape: Sequence[int] | None = None):
        assert local.dim() == 1 and 0 <= offset and offset + local.numel() <= numel, (local.shape, offset, numel)
        shape = torch.Size([numel] if shape is None else shape)
        assert math.prod(shape) == numel, (shape, numel)
        self.local, self.offset, self.numel, self.shape = local, offset, numel, shape
        if numel == 0:  # an empty tensor is one empty box (DCP records it)
            boxes = [(0, (0,) * len(shape), tuple(shape))]
        else:
            boxes = flat_boxes(shape, offset, offset + local.numel())
        self.boxes = {torch.Size(o): (f - offset, torch.Size(z)) for f, o, z in boxes}

    def size(self) -> torch.Size:
        return self.shape

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=z) for o, (_, z) in self.boxes.items()]

    def box(self, offsets: Sequence[int]) -> torch.Tensor:
        """The box at N-d `offsets`: a view of `local`."""
        start, sizes = self.boxes[torch.Size(offsets)]
        return self.local[start:start + math.prod(sizes)].view(sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.local.dtype)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=properties, size=self.shape))
                for c in self.chunks()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.box(index.offset)

    def staged(self) -> "FlatShard":
        """A CPU copy (what an asynchronous save writes while training goes on)."""
        return FlatShard(self.local.detach().to("cpu", copy=True), self.offset, self.numel, self.shape)

    def flat(self) -> "FlatShard":
        """The same elements as a piece of the 1-D tensor (how checkpoints before 2026-12-03 stored them)."""
        return FlatShard(self.local, self.offset, self.numel)


def whole(tensor: torch.Tensor) -> FlatShard:
    """All of a (contiguous) tensor, as one piece in its shape."""
    return FlatShard(tensor.detach().view(-1), 0, tensor.numel(), tensor.shape)


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default planner, which looks FlatShards up (state dicts here are flat already)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if hasattr(obj, "__get_tensor_shard__"):  # a FlatShard (a piece with DCP's checkpointable hooks)
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


def is_legacy(metadata: Metadata) -> bool:
    """A checkpoint of before 2026-12-03 (every tensor 1-D, model tensors under `model/`)."""
    return any(k.startswith(LEGACY_MODEL_PREFIX) for k in metadata.state_dict_metadata)


def legacy_key(key: str) -> str:
    return key if key.startswith(OPTIM_PREFIX) else LEGACY_MODEL_PREFIX + key


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat dict of FlatShards (its set-up would replace what is not a tensor); a
    checkpoint of the old 1-D layout is asked for the same ranges in that layout."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None and is_legacy(metadata):
            state_dict = {legacy_key(k): v.flat() if isinstance(v, FlatShard) else v.view(-1)
                          for k, v in state_dict.items()}
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if hasattr(obj, "__get_tensor_shard__"):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:  # noqa: ANN001 - DCP's signature
        # DCP's default unpickles stored bytes with torch.load(weights_only=False); this project stores tensors only
        raise pickle.UnpicklingError(f"{read_item.dest_index.fqn!r} is stored as bytes, not as a tensor")


class StagedCopy:
    """DCP AsyncStager: the CPU copies are made by the caller before async_save (one shard's worth per rank)."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class HashedStream:
    """A file being written, each byte also fed to `hash` on its way (what DCP's writer calls: write, tell, flush,
    fileno, close)."""

    def __init__(self, stream: Any, hash: Any):
        self.stream, self.hash, self.size = stream, hash, 0

    def write(self, data: Any) -> int:
        self.hash.update(data)
        self.size += memoryview(data).nbytes
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class HashingFileSystem(FileSystem):
    """DCP's file system, hashing each data file as DCP writes it: the checksum (manifest.py) costs no second read
    of the file. `digests` gets {file name: {"bytes", "digest"}} once a file is written whole."""

    def __init__(self, hasher: Callable[[], Any], digests: dict[str, dict[str, Any]]):
        super().__init__()
        self.hasher, self.digests = hasher, digests

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not DATA_FILE.fullmatch(Path(path).name):
                yield stream
                return
            hashed = HashedStream(stream, self.hasher())
            yield hashed
            self.digests[Path(path).name] = {"bytes": hashed.size, "digest": hashed.hash.hexdigest()}


class Writer(dcp.FileSystemWriter):
    """DCP's file-system writer (one file per rank, fsynced before the save counts as done) that also records
    `aliases` ({second name: stored name}, e.g. a tied head and its embedding) in the metadata: the second name
    points at the same chunks of the same files, so a state dict holding both names loads, nothing is stored
    twice. With a `hasher` (a function returning a new hash object) the data files are hashed as they are written,
    into `digests` (HashingFileSystem)."""

    def __init__(self, path: Path, aliases: dict[str, str] | None = None, hasher: Callable[[], Any] | None = None,
                 digests: dict[str, dict[str, Any]] | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.aliases = dict(aliases or {})
        if hasher is not None:
            self.fs = HashingFileSystem(hasher, {} if digests is None else digests)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stored = metadata.state_dict_metadata
        for alias, name in self.aliases.items():
            if name in stored and alias not in stored:
                stored[alias] = stored[name]
                results = [*results, [WriteResult(MetadataIndex(alias, r.index.offset, r.index.index),
                                                  r.size_in_bytes, r.storage_data)
                                      for rs in results for r in rs if r.index.fqn == name]]
        super().finish(metadata, results)


def writer(path: Path, aliases: dict[str, str] | None = None, hasher: Callable[[], Any] | None = None,
           digests: dict[str, dict[str, Any]] | None = None) -> Writer:
    return Writer(path, aliases, hasher, digests)


def save(state: dict[str, Any], path: Path, group=None, aliases: dict[str, str] | None = None,
         hasher: Callable[[], Any] | None = None, digests: dict[str, dict[str, Any]] | None = None) -> None:
    """Collective over `group` (every rank of it, each with the pieces it owns; `aliases`, `hasher` and `digests`
    as `Writer`'s)."""
    dcp.save(state, storage_writer=writer(path, aliases, hasher, digests), planner=ShardSavePlanner(),
             process_group=group)


def async_save(state: dict[str, Any], path: Path, group, aliases: dict[str, str] | None = None,
               hasher: Callable[[], Any] | None = None, digests: dict[str, dict[str, Any]] | None = None):
    """Start writing CPU-staged `state`; returns DCP's future (done once every rank's files are durable)."""
    staged = {k: v.staged() if isinstance(v, FlatShard) else v for k, v in state.items()}
    return dcp.async_save(staged, storage_writer=writer(path, aliases, hasher, digests), planner=ShardSavePlanner(),
                          process_group=group, async_stager=StagedCopy())


# ---- reading DCP's metadata without running code from the file -------------------------------------------


class MetadataUnpickler(pickle.Unpickler):
    """DCP keeps `.metadata` as a pickle and its FileSystemReader reads it with `pickle.load`, which calls
    whatever a crafted file names (`os.system`, ...). This unpickler resolves only what DCP's own metadata holds:
    its data classes and enums, the storage records of the file-system writer, torch sizes, dtypes and layouts,
    and paths (StorageMeta.checkpoint_id)."""

    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or self.is_metadata_class(module, name) or self.is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    @staticmethod
    def is_metadata_class(module: str, name: str) -> bool:
        value = getattr(dcp_metadata, name, None)
        return module == dcp_metadata.__name__ and inspect.isclass(value) and value.__module__ == module

    @staticmethod
    def is_dtype(module: str, name: str) -> bool:
        return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with `.metadata` read by MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
        check_records(metadata)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


DATA_FILE = re.compile(r"__\d+_\d+\.distcp")  # what writer() names a rank's file


def check_records(metadata: Metadata) -> None:
    """Only what this project writes: tensors (DCP would unpickle a bytes entry with torch.load, weights_only
    off) stored in this folder's own data files at plain offsets (no other path, no decompression transforms).
    Bytes are allowed under a module's extra-state key only: written for torch's own loader, never read here
    (this project reads extra_state.json; ShardLoadPlanner refuses bytes)."""
    for key, entry in metadata.state_dict_metadata.items():
        if type(entry) is BytesStorageMetadata and key.endswith(EXTRA_STATE_SUFFIX):
            continue
        if type(entry) is not TensorStorageMetadata:
            raise pickle.UnpicklingError(f"entry {key!r} is a {type(entry).__name__}, not a stored tensor")
    for index, info in (metadata.storage_data or {}).items():
        path, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(path, str) and DATA_FILE.fullmatch(path) and type(offset) is int and type(length) is int
                and offset >= 0 and length >= 0 and not getattr(info, "transform_descriptors", None)):
            raise pickle.UnpicklingError(f"the storage record of {getattr(index, 'fqn', index)!r} ({path!r}, "
                                         f"{offset!r}, {length!r}) is not one of this project's data files")


def load(state: dict[str, FlatShard], path: Path) -> None:
    """Fill every piece of `state` in place from the checkpoint at `path` (no collectives: each rank reads
    what it asks for, so a rank can load alone, e.g. for export)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(state, storage_reader=SafeReader(path), planner=ShardLoadPlanner(), no_dist=True)
    except (Exception, DCPError) as err:  # DCP wraps per-item I/O errors; name the checkpoint and the cause
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} could not be read: {first_line(err)}") from None


def first_line(err: BaseException) -> str:
    text = str(err)
    if WEIGHTS_ONLY_ERROR in text:  # torch.load's refusal of bytes that are no tensor: the cause sits mid-text
        cause = text.split(WEIGHTS_ONLY_ERROR, 1)[1].split("Check the documentation", 1)[0]
        return f"corrupt tensor data ({' '.join(cause.split())})"
    lines = text.strip().splitlines()
    return lines[-1] if lines else type(err).__name__


WEIGHTS_ONLY_ERROR = "WeightsUnpickler error:"


def read_metadata(path: Path) -> dict[str, Any]:
    """DCP's metadata of every stored tensor (dtype, size) by key."""
    return SafeReader(path).read_metadata().state_dict_metadata


def model_tensors(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{canonical name: (dtype, N-d shape)} of every model tensor (and alias) stored, in either format."""
    try:
        metadata = SafeReader(path).read_metadata()
        stored = metadata.state_dict_metadata
        if is_legacy(metadata):
            shapes = json.loads((path / TENSORS_FILE).read_text())
            return {k: (stored[LEGACY_MODEL_PREFIX + k].properties.dtype, tuple(v)) for k, v in shapes.items()
                    if LEGACY_MODEL_PREFIX + k in stored}
    except Exception as err:
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} could not be read: {first_line(err)}") from None
    return {k: (m.properties.dtype, tuple(m.size)) for k, m in stored.items()
            if isinstance(m, TensorStorageMetadata) and not k.startswith(OPTIM_PREFIX)}


def read_shapes(path: Path) -> dict[str, list[int]]:
    return {k: list(shape) for k, (_, shape) in model_tensors(path).items()}


def check_shapes(path: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor this model needs is in the checkpoint with the same shape; one line naming the first that
    is not."""
    saved = read_shapes(path)
    for name, shape in expected.items():
        if name not in saved:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no tensor {name!r} (shape {list(shape)}) of this model")
        if list(saved[name]) != list(shape):
            raise CheckpointError(f"checkpoint {str(path)!r}: tensor {name!r} has shape {saved[name]} there but "
                                  f"{list(shape)} in this model")


def check_files(path: Path) -> None:
    """Raise DamagedCheckpoint naming the first missing, truncated or unreadable file of a DCP checkpoint."""
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {str(meta_file)!r} is missing")
    try:
        metadata = SafeReader(path).read_metadata()
        if is_legacy(metadata):  # the shapes of the old 1-D format
            if not (path / TENSORS_FILE).is_file():
                raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {str(path / TENSORS_FILE)!r} is "
                                        "missing")
            json.loads((path / TENSORS_FILE).read_text())
    except DamagedCheckpoint:
        raise
    except Exception as err:
        raise DamagedCheckpoint(
            f"checkpoint {str(path)!r} is damaged: unreadable metadata ({first_line(err)})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {str(f)!r} is missing")
        if f.stat().st_size < size:
            raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {str(f)!r} is truncated "
                                    f"({f.stat().st_size} of {size} bytes)")


def is_sharded(path: Path) -> bool:
    return (path / METADATA_FILE).is_file() or (path / TENSORS_FILE).is_file()


def all_reduce_value(value: float, op=dist.ReduceOp.SUM, group=None) -> float:
    """`value` reduced over the ranks of `group` (through the GPU under NCCL, which takes no CPU tensors)."""
    t = torch.tensor([float(value)])
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def agree(ok: bool, group=None) -> bool:
    """True on every rank iff `ok` on every rank (True off-distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    return all_reduce_value(0.0 if ok else 1.0, dist.ReduceOp.MAX, group) == 0.0


def save_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def sizes_per_file(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
