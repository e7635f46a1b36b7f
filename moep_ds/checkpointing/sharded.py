"""Sharded checkpoint state through torch.distributed.checkpoint (DCP): each rank writes the pieces it owns.

Every tensor is stored flattened to 1-D under its canonical name, so that any contiguous range of it is one
DCP chunk: a ZeRO-1/2 fragment (an arbitrary range of the parameter inside a rank's flat partition), a ZeRO-3
partition (the last one padded in memory; only its valid part is written), a slice of stacked experts
[E_local, ...] owned by an expert-parallel rank, or a replica's share of a replicated tensor. DTensor cannot
describe such ranges, so a `FlatShard` implements DCP's checkpointable hooks (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`) and the planners below look it up. At load DCP's planner
reads whichever saved pieces overlap the range a rank asks for: this is the resharding.

The N-d shapes are kept in `tensors.json` beside DCP's `.metadata` and `__<rank>_<i>.distcp` files.
"""
from __future__ import annotations

import inspect
import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException as DCPError  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from moep_ds.errors import SharedUserError

METADATA_FILE = ".metadata"
TENSORS_FILE = "tensors.json"  # {canonical name: [N-d shape]}
MODEL_PREFIX = "model/"  # fp32 parameters (masters) and buffers
OPTIM_PREFIX = "optim/"  # optim/<name>/<state key>


class CheckpointError(SharedUserError):
    """A checkpoint that cannot be used (every rank finds the same), named in one line."""


class DamagedCheckpoint(CheckpointError):
    """Missing, truncated or unreadable files: `--resume auto` falls back to the previous checkpoint."""


class FlatShard:
    """Elements [offset, offset + len(local)) of a tensor of `numel` elements flattened to 1-D.

    `local` is a 1-D tensor (a view into the owner's storage, so that DCP loads in place)."""

    def __init__(self, local: torch.Tensor, offset: int, numel: int):
        assert local.dim() == 1 and 0 <= offset and offset + local.numel() <= numel, (local.shape, offset, numel)
        self.local, self.offset, self.numel = local, offset, numel

    def size(self) -> torch.Size:
        return torch.Size([self.numel])

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.local.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([self.offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.chunk(), properties=properties, size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local

    def staged(self) -> "FlatShard":
        """A CPU copy (what an asynchronous save writes while training goes on)."""
        return FlatShard(self.local.detach().to("cpu", copy=True), self.offset, self.numel)


def whole(tensor: torch.Tensor) -> FlatShard:
    """All of a (contiguous) tensor, as one piece."""
    return FlatShard(tensor.detach().view(-1), 0, tensor.numel())


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default planner, which looks FlatShards up (state dicts here are flat already)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, FlatShard) else super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat dict of FlatShards (its set-up would replace what is not a tensor)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, FlatShard) else super().lookup_tensor(index)

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


def writer(path: Path) -> dcp.FileSystemWriter:
    # one file per rank, fsynced before the save counts as done
    return dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)


def save(state: dict[str, Any], path: Path, group=None) -> None:
    """Collective over `group` (every rank of it, each with the pieces it owns)."""
    dcp.save(state, storage_writer=writer(path), planner=ShardSavePlanner(), process_group=group)


def async_save(state: dict[str, Any], path: Path, group):
    """Start writing CPU-staged `state`; returns DCP's future (done once every rank's files are durable)."""
    staged = {k: v.staged() if isinstance(v, FlatShard) else v for k, v in state.items()}
    return dcp.async_save(staged, storage_writer=writer(path), planner=ShardSavePlanner(), process_group=group,
                          async_stager=StagedCopy())


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
    off) stored in this folder's own data files at plain offsets (no other path, no decompression transforms)."""
    for key, entry in metadata.state_dict_metadata.items():
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
    """DCP's metadata of every stored tensor (dtype, flat size) by key."""
    return SafeReader(path).read_metadata().state_dict_metadata


def read_shapes(path: Path) -> dict[str, list[int]]:
    return json.loads((path / TENSORS_FILE).read_text())


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
    for f in (meta_file, path / TENSORS_FILE):
        if not f.is_file():
            raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {str(f)!r} is missing")
    try:
        metadata = SafeReader(path).read_metadata()
        json.loads((path / TENSORS_FILE).read_text())
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
