"""Today's consolidated checkpoints (model.safetensors + optimizer.pt, full state on every rank): still resumed,
evaluated and exported; `save_consolidated` is kept for comparison in bench/checkpoint_scale.py only.

    model.safetensors    full fp32 parameters and buffers (experts consolidated over the expert-parallel group)
    extra_state.pt       non-tensor module state (lifecycle event logs)
    optimizer.pt         full fp32 Adam moments per parameter name, Adam's step count
    trainer_state.json, rng_rank{r}.pt, config.yaml, tokenizer files, meta.json, COMPLETE

Saving gathers the whole state on every rank, which is what the sharded format (training/checkpoint.py) avoids.
Loading reads one tensor at a time, and of an expert stack only this rank's experts: weights through
safetensors' slices, moments from optimizer.pt memory-mapped (torch.load(weights_only=True, mmap=True)), so
that a rank never holds the whole state; what it keeps of each tensor is what its optimizer partition owns.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from moep_ds.checkpointing import layout
from moep_ds.checkpointing.model_dir import WEIGHTS_FILE, save_model_dir, stored_extra_state
from moep_ds.checkpointing.model_state import is_expert_param
from moep_ds.moe.shard import full_shape
from moep_ds.checkpointing.sharded import CheckpointError, DamagedCheckpoint, first_line
from moep_ds.training import state as st
from moep_ds.training.rng import rng_state

OPTIMIZER_FILE = "optimizer.pt"


def check_consolidated(ckpt: pathlib.Path) -> None:
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE, "trainer_state.json"):
        if not (ckpt / name).is_file():
            raise DamagedCheckpoint(f"checkpoint {str(ckpt)!r} is damaged: {str(ckpt / name)!r} is missing")
    try:
        with safe_open(str(ckpt / WEIGHTS_FILE), framework="pt") as f:
            f.keys()
        json.loads((ckpt / "trainer_state.json").read_text())
    except Exception as err:  # noqa: BLE001 - any parse error means a damaged file
        raise DamagedCheckpoint(f"checkpoint {str(ckpt)!r} is damaged: {first_line(err)}") from None


def named_unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters by their first name (a tied LM head is stored once, as the embedding)."""
    return list(model.named_parameters())


def gather_experts(t: torch.Tensor, ep_group) -> torch.Tensor:
    """Stacked local experts [E_local, ...] -> all experts [E, ...] (rank r of the group owns a contiguous slice)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, t.contiguous(), group=ep_group)
    return torch.cat(parts, dim=0)


def local_experts(t: Any, ep_group) -> Any:
    """This rank's experts of a stack [E, ...]: a tensor's rows, or a safetensors slice's (read only then)."""
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    n = t.get_shape()[0] // size if hasattr(t, "get_shape") else t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def read_weight(f: Any, name: str, p: torch.Tensor, ep_group, ckpt: pathlib.Path) -> torch.Tensor:
    """Parameter or buffer `name` from the open model.safetensors `f`: this rank's experts of an expert stack;
    one line naming the tensor when its shape is not the model's."""
    if ep_group is not None and is_expert_param(p):
        t = local_experts(f.get_slice(name), ep_group)
    else:
        t = f.get_tensor(name)
    if t.shape != full_shape(p):
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: tensor {name!r} has shape {list(t.shape)} there but "
                              f"{list(full_shape(p))} in this model")
    return t


def collect_full_state(engine, model, ep_group) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Full fp32 params and Adam moments by parameter name (collective: every rank calls it)."""
    params, moments = {}, {}
    backend_device = next(model.parameters()).device
    st.init_optimizer_state(engine.optimizer)
    for name, p in named_unique_params(model):
        values = {"param": st.get_fp32_param(p)}
        for key in st.ADAM_KEYS:
            v = st.get_optimizer_state(p, engine.optimizer, key)
            values[key] = torch.zeros_like(values["param"]) if v is None else v
        if ep_group is not None and is_expert_param(p):
            values = {k: gather_experts(v.to(backend_device), ep_group).cpu() for k, v in values.items()}
        params[name] = values.pop("param")
        moments[name] = values
    return params, moments


def save_consolidated(engine, model, cfg, out: pathlib.Path, trainer_state: dict[str, Any], ep_group=None) -> None:
    """Today's format, written to `out` (collective; every rank holds the full state meanwhile)."""
    params, moments = collect_full_state(engine, model, ep_group)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(rng_state(), out / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        save_model_dir(model, cfg, out, meta={"step": trainer_state["step"]}, params=params)
        torch.save({"moments": moments, "step": st.optimizer_step_count(engine.optimizer)}, out / OPTIMIZER_FILE)
        (out / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        (out / layout.COMPLETE).touch()
    dist.barrier()


def load_consolidated_model(model, ckpt: pathlib.Path, ep_group=None) -> None:
    """Load weights, buffers and extra state into the (unwrapped, not yet engine-owned) model, one tensor at
    a time."""
    extra = stored_extra_state(ckpt)
    own = model.state_dict(keep_vars=True)
    with safe_open(str(ckpt / WEIGHTS_FILE), framework="pt") as f:
        weights = set(f.keys())
        missing = [k for k in own
                   if k not in weights and k not in extra and not (k == "head.weight" and model.cfg.tie_embeddings)]
        if missing:
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} lacks {len(missing)} tensors of this model, e.g. {missing[0]!r}")
        with torch.no_grad():
            for name, t in own.items():
                # ZeRO-3 partitions are set by load_consolidated_engine; extra state is not a tensor
                if name in weights and not hasattr(t, "ds_id"):
                    t.copy_(read_weight(f, name, t, ep_group, ckpt))
    model.load_state_dict(extra, strict=False)


def load_consolidated_engine(engine, model, ckpt: pathlib.Path, ep_group=None) -> dict[str, Any]:
    """Restore fp32 masters and Adam moments/step, one parameter at a time; returns the trainer state."""
    optim = torch.load(ckpt / OPTIMIZER_FILE, weights_only=True, mmap=True)  # read where a rank touches it
    params = named_unique_params(model)
    st.init_optimizer_state(engine.optimizer)
    with safe_open(str(ckpt / WEIGHTS_FILE), framework="pt") as f:
        for name, p in params:
            moments = optim["moments"][name]
            if ep_group is not None and is_expert_param(p):
                moments = {k: local_experts(v, ep_group) for k, v in moments.items()}
            st.set_fp32_param(p, read_weight(f, name, p, ep_group, ckpt))
            for key in st.ADAM_KEYS:
                st.set_optimizer_state(p, engine.optimizer, key, moments[key])
    st.set_optimizer_step_count(engine.optimizer, [p for _, p in params], optim["step"])
    return json.loads((ckpt / "trainer_state.json").read_text())
