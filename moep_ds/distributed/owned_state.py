"""What this rank owns of the fp32 masters and Adam moments, as pieces of the global flat tensors (a checkpoint
writes and reads these through DCP: checkpointing/sharded.py).

Under ZeRO-1/2 (and DeepSpeed's bf16 optimizer) the fragments of each parameter in its flat partition
(`param._hp_mapping`); under ZeRO-3 the valid part of its padded partition; without partitioning (ZeRO-0 fp32) an
even share of every replicated tensor. Expert parameters are offset by the rank's place in the expert-parallel
group. A load asks for the same pieces of the new layout, and DCP reads whatever saved pieces overlap them, so
world size, expert-parallel size, ZeRO stage and master precision may all change.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moep_ds.checkpointing import model_state, sharded
from moep_ds.checkpointing.model_state import canonical_name, is_expert_param
from moep_ds.checkpointing.sharded import MODEL_PREFIX, OPTIM_PREFIX, FlatShard
from moep_ds.distributed import deepspeed_adapter
from moep_ds.distributed import optimizer_state as st
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.moe.shard import full_shape


def replica_share(numel: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of replica `rank`'s even share of a tensor that `size` ranks hold whole."""
    return rank * numel // size, (rank + 1) * numel // size


def replica_position(p: torch.nn.Parameter) -> tuple[int, int]:
    """(rank, size) among the ranks holding the same whole copy of an unpartitioned parameter."""
    if is_expert_param(p) and hasattr(p, "group_name"):
        group = deepspeed_adapter.expert_data_parallel_group(p.group_name)
        return dist.get_rank(group), dist.get_world_size(group)
    return dist.get_rank(), dist.get_world_size()


def local_pieces(p: torch.nn.Parameter, optimizer, whole_replicas: bool) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """[(flat offset within the local parameter, {"param": fp32 master view, key: moment view})] held here.

    `whole_replicas`: a rank loading an unpartitioned parameter needs all of it; saving, it writes its share."""
    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition, padded at the end of the last one
        start, valid = model_state.zero3_partition(p)
        views = {key: st.local_partition(p, key) for key in ("param", *st.ADAM_KEYS)}
        return [(start, {k: v.narrow(0, 0, valid) for k, v in views.items()})] if valid else []
    if deepspeed_adapter.has_fragment_mapping(p):  # ZeRO-1/2, bf16 optimizer: a fragment of the rank's partition
        frag = deepspeed_adapter.fragment(p, st.ADAM_KEYS)
        return [] if frag is None else [frag]
    master = st.master(p)  # ZeRO-0 bf16/fp16: the fp32 master beside the module's parameter
    state = st.inner_optimizer(optimizer).state.get(master, {})
    views = {"param": master.data.view(-1), **{k: state[k].view(-1) for k in st.ADAM_KEYS if k in state}}
    start, stop = (0, p.numel()) if whole_replicas else replica_share(p.numel(), *replica_position(p))
    return [(start, {k: v[start:stop] for k, v in views.items()})] if stop > start else []


def owned_pieces(optimizer, model, ep: ExpertParallelPlan, for_load: bool) -> dict[str, FlatShard]:
    """Masters and moments this rank owns, as pieces of the global flat tensors (optimizer state must exist)."""
    out = {}
    for name, p in model.named_parameters():
        name = canonical_name(name)
        base, numel = model_state.expert_offset(p_numel(p), is_expert_param(p), ep)
        shape = model_state.global_shape(full_shape(p), is_expert_param(p), ep)
        for start, views in local_pieces(p, optimizer, whole_replicas=for_load):
            for key, view in views.items():
                out[piece_name(name, key)] = FlatShard(view, base + start, numel, shape)
    return out


def written_model_pieces(model, ep: ExpertParallelPlan) -> dict[str, FlatShard]:
    """What this rank writes of a model split over the ranks without an optimizer (moep-import under a launcher):
    its ZeRO-3 partitions and its experts, and of a parameter it holds as a whole copy its even share among the
    ranks holding the same copy; buffers and extra state from rank 0. Together the ranks write every element once."""
    held = model_state.module_pieces(model, ep, partitions=True)
    out = {}
    for name, p in model.named_parameters():
        key = MODEL_PREFIX + canonical_name(name)
        if hasattr(p, "ds_id"):  # this rank's partition (none when it holds only padding)
            if key in held:
                out[key] = held[key]
            continue
        piece = held[key]
        start, stop = replica_share(p.numel(), *replica_position(p))
        if stop > start:
            out[key] = FlatShard(piece.local[start:stop], piece.offset + start, piece.numel, piece.shape)
    if dist.get_rank() == 0:
        out.update({MODEL_PREFIX + n: sharded.whole(b) for n, b in model_state.buffers(model).items()})
        out.update({MODEL_PREFIX + n: v for n, v in model_state.extra_states(model).items()})
    return out


def piece_name(name: str, key: str) -> str:
    return MODEL_PREFIX + name if key == "param" else f"{OPTIM_PREFIX}{name}/{key}"


def commit_partitions(model, pieces: dict[str, FlatShard]) -> None:
    """Write loaded ZeRO-3 partitions back through DeepSpeed (they are copies when the optimizer is offloaded),
    and the working partition the model computes with from the master (the model itself loaded none)."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            for key in ("param", *st.ADAM_KEYS):
                piece = pieces.get(piece_name(canonical_name(name), key))
                if piece is not None:
                    st.set_local_partition(p, key, piece.local)
            with torch.no_grad():
                p.ds_tensor.data.copy_(st.local_partition(p, "param").to(p.ds_tensor.dtype))


def p_numel(p: torch.nn.Parameter) -> int:
    return p.ds_numel if hasattr(p, "ds_id") else p.numel()
