"""Weights by our canonical names, each read only when it is needed, and copied into what a process holds.

    weights = source_weights(source, model_cfg)     # {canonical name: Weight}: checked against the recipe
    fill_pieces(module_pieces(model, ep), weights)  # each piece: only the rows that hold it, a chunk at a time

A `Weight` reads one tensor of the full (global) model in fp32: from a Hugging Face checkpoint (hf_weights.py,
through the architecture's map), from a moep_ds checkpoint or model directory, or an upcycled expert stack
(upcycle.py, which builds only the experts asked for). A process fills the pieces it holds (its experts, its
ZeRO-3 partitions, the fp32 masters of its optimizer partition) one tensor at a time: never the whole model
twice, and under expert parallelism never another rank's experts.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch

from moep_ds.checkpointing.sharded import MODEL_PREFIX, FlatShard
from moep_ds.errors import UserError

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20  # fp32 bytes of one weight read at once, in whole rows (copy_in_chunks)


@dataclasses.dataclass(frozen=True)
class Weight:
    """One tensor of the full model: its global shape and how to read it (fp32), or rows [first, end) of it."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    read_rows: Callable[[int, int], torch.Tensor] | None = None

    def rows(self, first: int, end: int) -> torch.Tensor:
        if self.read_rows is not None:
            return self.read_rows(first, end)
        t = self.read()
        return t if (first, end) == (0, self.shape[0] if self.shape else 1) else t[first:end]


def flat_range(weight: Weight, offset: int, numel: int) -> torch.Tensor:
    """Elements [offset, offset + numel) of the flattened tensor, reading only the rows that hold them."""
    if len(weight.shape) < 2:
        return weight.read().reshape(-1)[offset:offset + numel]
    row = math.prod(weight.shape[1:])
    first, end = offset // row, -(-(offset + numel) // row)
    start = offset - first * row
    return weight.rows(first, end).reshape(-1)[start:start + numel]


def fill_pieces(pieces: dict[str, FlatShard], weights: dict[str, Weight], keep: set[str] = frozenset(),
                source: str = "SRC") -> None:
    """Copy every piece (keys MODEL_PREFIX + canonical name) from `weights`. Names in `keep` are left as they are
    (an upcycled router keeps its seeded initialisation). Tensors on either side without a counterpart are errors."""
    wanted = {k.removeprefix(MODEL_PREFIX) for k in pieces if k.startswith(MODEL_PREFIX)}
    check_names(wanted, weights, keep, source)
    with torch.no_grad():
        for key, piece in pieces.items():
            name = key.removeprefix(MODEL_PREFIX)
            if name in keep or not key.startswith(MODEL_PREFIX):
                continue
            weight = weights[name]
            if math.prod(weight.shape) != piece.numel:
                raise UserError(f"{source}: tensor {name!r} has shape {list(weight.shape)} there, {piece.numel} "
                                "elements in the model the recipe builds")
            copy_in_chunks(piece, weight)


def copy_in_chunks(piece: FlatShard, weight: Weight) -> None:
    """piece.local <- its range of `weight`. A weight that reads rows alone is copied CHUNK_BYTES of whole rows at a
    time (chunk edges at multiples of that many rows of the full tensor), so that no more than a chunk of it is
    read at once: an embedding is never whole in memory twice. Other weights are read whole (they are small, or
    computed from several tensors)."""
    n = piece.local.numel()
    if weight.read_rows is None or len(weight.shape) < 2 or n == 0:
        piece.local.copy_(flat_range(weight, piece.offset, n))
        return
    row = math.prod(weight.shape[1:])
    step = max(1, CHUNK_BYTES // (4 * row)) * row  # fp32 elements: whole rows
    start, end = piece.offset, piece.offset + n
    while start < end:
        stop = min(end, (start // step + 1) * step)
        piece.local[start - piece.offset:stop - piece.offset].copy_(flat_range(weight, start, stop - start))
        start = stop


def check_names(wanted: set[str], weights: dict[str, Weight], keep: set[str], source: str) -> None:
    missing = sorted(wanted - set(weights) - set(keep))
    if missing:
        raise UserError(f"{source} lacks {len(missing)} tensor(s) of the model the recipe builds: {missing[:5]}")


def check_shapes(weights: dict[str, Weight], shapes: dict[str, tuple[int, ...]], keep: set[str], source: str) -> None:
    """The weights cover the model exactly (`shapes`: canonical names, global shapes), apart from `keep`."""
    check_names(set(shapes), weights, keep, source)
    unknown = sorted(set(weights) - set(shapes))
    if unknown:
        raise UserError(f"{source} has {len(unknown)} tensor(s) the model the recipe builds lacks: {unknown[:5]}")
    for name, shape in shapes.items():
        if name not in keep and tuple(weights[name].shape) != tuple(shape):
            raise UserError(f"{source}: tensor {name!r} has shape {list(weights[name].shape)} there but "
                            f"{list(shape)} in the model the recipe builds")


def checkpoint_weights(folder: Path, cfg: Any) -> dict[str, Weight]:
    """The weights of a moep_ds checkpoint, run or model directory (its own recipe `cfg`), each read alone."""
    from moep_ds.checkpointing.model_dir import stored_weights

    entries, _ = stored_weights(folder, cfg)
    return {e.name: Weight(e.shape, lambda e=e: as_fp32(e.read())) for e in entries}


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors in fp32; integer buffers (counters) as they are."""
    return t.float() if t.is_floating_point() else t


__all__ = ["Weight", "check_shapes", "checkpoint_weights", "fill_pieces", "flat_range"]
