"""Consolidated ("universal") checkpoints: resumable at any data-parallel or expert-parallel size.

RUN_DIR/checkpoints/step_00000100/
    model.safetensors    full fp32 parameters and buffers (experts consolidated over the expert-parallel group)
    extra_state.pt       non-tensor module state (e.g. lifecycle event logs)
    optimizer.pt         full fp32 Adam moments per parameter name, Adam's step count
    trainer_state.json   step, data position, lr schedule, loss scaler, engine counters
    rng_rank{r}.pt       each rank's RNG states
    config.yaml, tokenizer files, meta.json, COMPLETE

A checkpoint is written under `.tmp-<tag>` and renamed once every rank has finished, so a crash at any
point leaves the previous complete checkpoint as the newest one. DeepSpeed's own MoE checkpoint format
needs one submodule per expert and cannot change the expert-parallel size, hence this format; the
partitioned-state API (training/state.py) moves full tensors in and out of any ZeRO stage.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moep_ds.errors import UserError
from moep_ds.evaluation.model_dir import COMPLETE_MARKER as COMPLETE
from moep_ds.evaluation.model_dir import save_model_dir
from moep_ds.training import state as st

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    pass


def checkpoint_root(run_dir: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / COMPLETE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def resolve_resume(resume: str | None, run_dir: str | pathlib.Path) -> pathlib.Path | None:
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = pathlib.Path(resume)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"--resume {resume!r} is not a complete checkpoint directory")
    return path


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True) is False


def named_unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters by their first name (a tied LM head is stored once, as the embedding)."""
    return list(model.named_parameters())


def gather_experts(t: torch.Tensor, ep_group) -> torch.Tensor:
    """Stacked local experts [E_local, ...] -> all experts [E, ...] (rank r of the group owns a contiguous slice)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, t.contiguous(), group=ep_group)
    return torch.cat(parts, dim=0)


def local_experts(t: torch.Tensor, ep_group) -> torch.Tensor:
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


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


def save_checkpoint(
    engine, model, cfg, run_dir: pathlib.Path, step: int, trainer_state: dict[str, Any], *,
    ep_group=None, tokenizer_dir: pathlib.Path | None = None, keep_last: int = 3, meta: dict | None = None,
) -> pathlib.Path:
    rank = dist.get_rank()
    root = checkpoint_root(run_dir)
    tag = f"step_{step:08d}"
    tmp, final = root / f".tmp-{tag}", root / tag
    if rank == 0:
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    params, moments = collect_full_state(engine, model, ep_group)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        save_model_dir(model, cfg, tmp, tokenizer_dir=tokenizer_dir, meta={"step": step, **(meta or {})},
                       params=params)
        torch.save({"moments": moments, "step": st.optimizer_step_count(engine.optimizer)}, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    dist.barrier()
    if rank == 0:
        (tmp / COMPLETE).touch()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)
    dist.barrier()
    return final


def load_model_state(model, ckpt: pathlib.Path, ep_group=None) -> None:
    """Load weights, buffers and extra state into the (unwrapped, not yet engine-owned) model."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    extra_path = ckpt / "extra_state.pt"
    if extra_path.is_file():
        tensors.update(torch.load(extra_path, weights_only=False))
    own = model.state_dict()
    for name, p in model.named_parameters():
        if ep_group is not None and is_expert_param(p) and name in tensors:
            tensors[name] = local_experts(tensors[name], ep_group)
    missing = [k for k in own if k not in tensors and not (k == "head.weight" and model.cfg.tie_embeddings)]
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {len(missing)} tensors of this model, e.g. {missing[0]!r}")
    model.load_state_dict(tensors, strict=False)


def load_engine_state(engine, model, ckpt: pathlib.Path, ep_group=None) -> dict[str, Any]:
    """Restore fp32 masters, Adam moments/step, schedule, loss scaler and counters; returns trainer state."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    optim = torch.load(ckpt / "optimizer.pt", weights_only=False)
    params = named_unique_params(model)
    st.init_optimizer_state(engine.optimizer)
    for name, p in params:
        values = {"param": tensors[name], **optim["moments"][name]}
        if ep_group is not None and is_expert_param(p):
            values = {k: local_experts(v, ep_group) for k, v in values.items()}
        st.set_fp32_param(p, values["param"])
        for key in st.ADAM_KEYS:
            st.set_optimizer_state(p, engine.optimizer, key, values[key])
    st.set_optimizer_step_count(engine.optimizer, [p for _, p in params], optim["step"])
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if engine.lr_scheduler is not None:
        restore_schedule(engine.lr_scheduler, state["lr_scheduler"]["last_epoch"])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and state.get("loss_scaler"):
        for key, value in state["loss_scaler"].items():
            setattr(scaler, key, value)
    engine.global_steps = state["step"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state.get("skipped_steps", 0)
    restore_rng(ckpt, dist.get_rank(), state)
    return state


def check_same_tokenizer(state: dict[str, Any], meta: dict[str, Any], ckpt: pathlib.Path) -> None:
    saved, current = state.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved and current and saved != current:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was trained with tokenizer sha256 {saved[:12]}..., but data.tokenizer of this "
            f"run has {current[:12]}...; resume with the data the checkpoint was trained on")


def restore_schedule(scheduler, last_epoch: int) -> None:
    """Put the schedule at `last_epoch` and set every group's lr from it. The schedule is a function of the
    step alone, so this works whatever the number of parameter groups (expert parallelism adds MoE groups),
    unlike LRScheduler.load_state_dict, which also leaves the groups' current lr stale."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        scheduler.step()


def loss_scaler_state(engine) -> dict[str, Any] | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}


def rng_state() -> dict[str, Any]:
    out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(ckpt: pathlib.Path, rank: int, state: dict[str, Any]) -> None:
    """Same world size: each rank continues its own RNG streams; otherwise streams are re-seeded per rank."""
    path = ckpt / f"rng_rank{rank}.pt"
    if state.get("world_size") == dist.get_world_size() and path.is_file():
        rng = torch.load(path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        seed = state.get("seed", 0) * 1000003 + state["step"] * 101 + rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
