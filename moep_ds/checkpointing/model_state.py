"""A model's tensors under canonical names, as pieces of the global (unsharded) tensors.

Canonical names are the single-device model's state-dict names: wrappers that torch.compile (`_orig_mod`) and
activation checkpointing (`_checkpoint_wrapped_module`) insert are dropped, and expert tensors, stacked on
dim 0 as [E_local, ...] and sharded contiguously over the expert-parallel group, are named and shaped as the
full stack [E, ...] (an expert's global index is its row). A checkpoint therefore does not depend on the
layout that wrote it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moep_ds.checkpointing import sharded
from moep_ds.checkpointing.sharded import MODEL_PREFIX, FlatShard
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.moe.shard import full_shape

WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")
EXTRA_STATE_FILE = "extra_state.json"  # non-tensor module state (get_extra_state), canonical keys


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def is_expert_param(p: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter (stacked experts, sharded over the expert-parallel group)."""
    return getattr(p, "allreduce", True) is False


def expert_offset(local_numel: int, expert: bool, ep: ExpertParallelPlan) -> tuple[int, int]:
    """(offset of this rank's piece, numel of the global tensor), both flat: rank r of the plan holds experts
    [r*L, (r+1)*L) of every stage."""
    return (ep.rank * local_numel, local_numel * ep.size) if expert else (0, local_numel)


def zero3_partition(p: torch.Tensor) -> tuple[int, int]:
    """(flat offset, valid length) of this rank's ZeRO-3 partition of `p` (DeepSpeed's layout: equal partitions
    of the flattened parameter in rank order, the last padded at its end)."""
    import torch.distributed as dist

    part = p.ds_tensor.numel()
    start = dist.get_rank(group=p.ds_process_group) * part
    return start, max(0, min(part, p.ds_numel - start))


def global_shape(shape: torch.Size, expert: bool, ep: ExpertParallelPlan) -> tuple[int, ...]:
    return (shape[0] * ep.size, *shape[1:]) if expert else tuple(shape)


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by canonical name (tied parameters appear once, under named_parameters)."""
    return {canonical_name(k): v for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}


def extra_states(model: nn.Module) -> dict[str, Any]:
    return {canonical_name(k): v for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)}


def shapes(model: nn.Module, ep: ExpertParallelPlan = SINGLE_PROCESS) -> dict[str, tuple[int, ...]]:
    """Global shapes of every parameter (also ZeRO-3-partitioned ones) and buffer, by canonical name."""
    out = {canonical_name(n): global_shape(full_shape(p), is_expert_param(p), ep) for n, p in model.named_parameters()}
    out.update({n: tuple(b.shape) for n, b in buffers(model).items()})
    return out


def tied_names(model: nn.Module) -> dict[str, str]:
    """{second name: stored name} of every parameter known under several names (a head tied to the embedding):
    a checkpoint records the second name as an alias of the first (`sharded.Writer`), so that `state_dict()`,
    which lists both, loads with torch alone."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(name)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def module_pieces(model: nn.Module, ep: ExpertParallelPlan = SINGLE_PROCESS, partitions: bool = False
                  ) -> dict[str, FlatShard]:
    """Every parameter and buffer of `model` as it is held here (local experts at their offset), in its global
    shape: the target of a load into the module itself, before an engine owns it. ZeRO-3 parameters are left
    out (a trainer loads them through the engine, into its fp32 masters) unless `partitions`: then each is this
    rank's partition, in the working precision (a model without an optimizer, e.g. for evaluation)."""
    out = {}
    for name, p in model.named_parameters():
        shape = global_shape(full_shape(p), is_expert_param(p), ep)
        if hasattr(p, "ds_id"):  # partitioned as it was built (ZeRO-3)
            start, valid = zero3_partition(p)
            if partitions and valid:
                out[MODEL_PREFIX + canonical_name(name)] = FlatShard(p.ds_tensor.data.view(-1)[:valid], start,
                                                                     p.ds_numel, shape)
            continue
        offset, numel = expert_offset(p.numel(), is_expert_param(p), ep)
        out[MODEL_PREFIX + canonical_name(name)] = FlatShard(p.data.view(-1), offset, numel, shape)
    out.update({MODEL_PREFIX + n: sharded.whole(b) for n, b in buffers(model).items()})
    return out


def save_module(model: nn.Module, path: Path) -> None:
    """The model part of a sharded checkpoint from one process holding the whole model (a converter, a test):
    every parameter and buffer whole, tied names recorded, non-tensor state (also in extra_state.json). `path` is
    created; the recipe files are the caller's (`model_dir.write_recipe_files`)."""
    path.mkdir(parents=True, exist_ok=True)
    sharded.dcp.save({**module_pieces(model), **extra_states(model)},
                     storage_writer=sharded.writer(path, tied_names(model)), planner=sharded.ShardSavePlanner(),
                     no_dist=True)
    sharded.save_json(extra_states(model), path / EXTRA_STATE_FILE)


def load_extra_states(model: nn.Module, path: Path) -> None:
    f = path / EXTRA_STATE_FILE
    saved = json.loads(f.read_text()) if f.is_file() else {}
    wanted = {k: canonical_name(k) for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)}
    model.load_state_dict({k: saved[c] for k, c in wanted.items() if c in saved}, strict=False)


def load_module(model: nn.Module, path: Path, ep: ExpertParallelPlan = SINGLE_PROCESS,
                partitions: bool = False) -> None:
    """Parameters (the fp32 masters, in the model's precision), buffers and extra state of a sharded checkpoint
    into `model`, in place; each process reads only the pieces it holds (its experts; with `partitions` its
    ZeRO-3 partitions: `module_pieces`), never the optimizer state."""
    sharded.check_shapes(path, shapes(model, ep))
    with torch.no_grad():
        sharded.load(module_pieces(model, ep, partitions), path)
    load_extra_states(model, path)
