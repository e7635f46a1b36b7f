"""Weights written one tensor at a time, so that an export never holds the whole model.

    entries = sharded_entries(model_dir, model_shapes)        # a sharded checkpoint (DCP)
    write_safetensors(out / "model.safetensors", entries)      # header first, then each tensor as it is read

A `TensorEntry` is a tensor's name, dtype and shape and a function that reads it from a sharded checkpoint (only
that tensor's pieces, torch.distributed.checkpoint). safetensors' writers take every tensor at once; its file
format (an 8-byte little-endian header length, a JSON header of dtypes, shapes and byte offsets, then the raw
bytes in that order) lets the header be written from the names, dtypes and shapes alone, so at most one tensor is
in memory at a time (an export of a 1B-parameter model would otherwise hold its 4 GB twice).

Floating tensors are written in fp32, as every export holds them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Callable, Sequence

import torch

from moep_ds.checkpointing import manifest, sharded
from moep_ds.checkpointing.sharded import MODEL_PREFIX
from moep_ds.errors import UserError

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def write_safetensors(path: Path, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `entries`, written one tensor at a time (readable by safetensors' `safe_open`)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = e.read()
            if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise AssertionError(f"{e.name}: read {t.dtype} {tuple(t.shape)}, announced {e.dtype} {e.shape}")
            f.write(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
            del t  # before the next read: one tensor at a time


def sharded_entries(path: Path, shapes: dict[str, tuple[int, ...]], prefix: str = "") -> list[TensorEntry]:
    """The model tensors `shapes` (canonical names) of the sharded checkpoint at `path`, each read alone."""
    manifest.check(path)  # every file whole and as written (its checksum) before a byte is exported
    sharded.check_shapes(path, shapes)
    saved = sharded.model_tensors(path)

    def read(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        sharded.load({MODEL_PREFIX + name: sharded.whole(t)}, path)
        return t.to(stored_dtype(dtype))

    entries = []
    for name, shape in shapes.items():
        dtype = saved[name][0]
        entries.append(TensorEntry(prefix + name, stored_dtype(dtype), tuple(shape),
                                   lambda n=name, d=dtype, s=tuple(shape): read(n, d, s)))
    return entries


def check_safetensors(file: Path, shapes: dict[str, tuple[int, ...]], key_prefix: str = ""
                      ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{key: (dtype, shape)} of a safetensors file (its header only), after checking that it holds every tensor
    `shapes` names (as `key_prefix + name`) in that shape: one line naming the first that it does not."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        saved = {k: (DTYPES_BY_NAME[f.get_slice(k).get_dtype()], tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    missing = [n for n in shapes if key_prefix + n not in saved]
    if missing:
        raise UserError(f"{file} does not match the model built from its config.yaml: missing {missing[:5]} "
                        f"({len(missing)})")
    for name, shape in shapes.items():
        if saved[key_prefix + name][1] != tuple(shape):
            raise UserError(f"{file} does not match the model built from its config.yaml: {name!r} has shape "
                            f"{list(saved[key_prefix + name][1])} there but {list(shape)} in the model")
    return saved


__all__ = ["TensorEntry", "check_safetensors", "sharded_entries", "stored_dtype", "write_safetensors"]
