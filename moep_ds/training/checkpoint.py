"""Sharded training checkpoints: each rank writes and reads only the optimizer state it owns, at any ZeRO stage.

RUN_DIR/checkpoints/step_00000100/
    .metadata, __<rank>_0.distcp   DCP: fp32 masters and buffers under their state_dict() names (a tied head as
                                   an alias), optim/<name>/<key> Adam moments, all in their true shapes
                                   (checkpointing/sharded.py; torch.distributed.checkpoint.load reads them alone)
    extra_state.json               non-tensor module state (lifecycle event logs)
    trainer_state.json             step, Adam's step, data position, lr schedule, loss scaler, engine counters
    rng_rank{r}.pt                 each rank's RNG states (tensors and tuples: loads with weights_only=True)
    config.yaml, meta.json, tokenizer files, COMPLETE

What a rank owns: under ZeRO-1/2 (and DeepSpeed's bf16 optimizer) the fragments of each parameter in its flat
partition (`param._hp_mapping`); under ZeRO-3 the valid part of its padded partition; without partitioning
(ZeRO-0 fp32) an even share of every replicated tensor. Expert parameters are offset by the rank's place in
the expert-parallel group. A load asks for the same pieces of the new layout, and DCP reads whatever saved
pieces overlap them, so world size, expert-parallel size, ZeRO stage and master precision may all change.

A checkpoint is written under `.tmp-<tag>` and renamed once every rank's files are durable (DCP fsyncs and
gathers the ranks' results before its metadata is written), so a crash at any point leaves the previous
complete checkpoint as the newest. With `train.checkpoint.async_save` the ranks copy their pieces to CPU and
training goes on while DCP writes them on a gloo group of their own; the rename happens when the write is done.
"""
from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import pathlib
import random
import re
import shutil
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moep_ds.checkpointing import layout, model_state, sharded
from moep_ds.checkpointing.model_dir import convert_hint, is_consolidated, read_meta, write_recipe_files
from moep_ds.checkpointing.model_state import canonical_name, is_expert_param
from moep_ds.distributed import deepspeed_adapter
from moep_ds.fsutil import disk_full, free_bytes
from moep_ds.checkpointing.sharded import MODEL_PREFIX, OPTIM_PREFIX, CheckpointError, DamagedCheckpoint, FlatShard
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.moe.shard import full_shape
from moep_ds.training import state as st
from moep_ds.training.rng import rng_state

log = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"


# ---- what this rank owns --------------------------------------------------------------------------------


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


def engine_pieces(engine, model, ep: ExpertParallelPlan, for_load: bool) -> dict[str, FlatShard]:
    """Masters and moments this rank owns, as pieces of the global flat tensors (optimizer state must exist)."""
    out = {}
    for name, p in model.named_parameters():
        name = canonical_name(name)
        base, numel = model_state.expert_offset(p_numel(p), is_expert_param(p), ep)
        shape = model_state.global_shape(full_shape(p), is_expert_param(p), ep)
        for start, views in local_pieces(p, engine.optimizer, whole_replicas=for_load):
            for key, view in views.items():
                out[piece_name(name, key)] = FlatShard(view, base + start, numel, shape)
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


# ---- saving ---------------------------------------------------------------------------------------------


class CheckpointWriter:
    """Writes a run's checkpoints (collective: every rank calls `save` and `wait` at the same steps)."""

    def __init__(self, run_dir: pathlib.Path, keep_last: int, async_save: bool = False):
        self.root = layout.checkpoint_root(run_dir)
        self.keep_last = keep_last
        self.pending: concurrent.futures.Future | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(1) if async_save else None
        # DCP's asynchronous writer runs collectives from its own thread: they need a (CPU) group of their own
        self.group = dist.new_group(backend="gloo") if async_save else None

    def save(self, engine, model, cfg, step: int, trainer_state: dict[str, Any], *,
             plan: ExpertParallelPlan = SINGLE_PROCESS,
             tokenizer_dir: pathlib.Path | None = None, meta: dict | None = None) -> pathlib.Path:
        self.wait()
        rank = dist.get_rank()
        tag = layout.checkpoint_tag(step)
        tmp, final = self.root / f".tmp-{tag}", self.root / tag
        error = None
        try:
            if rank == 0:
                for stale in self.root.glob(".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir(parents=True)
                layout.remove_left_aside(self.root, rf"{re.escape(layout.STEP_PREFIX)}\d+")  # of a killed replacement
        except OSError as err:
            error = err
        self.check(sharded.agree(error is None), error, tmp, final)
        try:
            torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
            if rank == 0:
                sharded.save_json({**trainer_state, "optimizer_step": st.optimizer_step_count(engine.optimizer)},
                                  tmp / TRAINER_STATE_FILE)
                sharded.save_json(model_state.extra_states(model), tmp / model_state.EXTRA_STATE_FILE)
                write_recipe_files(cfg, tmp, tokenizer_dir, {"step": step, **(meta or {})})
        except OSError as err:
            error = err
        self.check(sharded.agree(error is None), error, tmp, final)
        pieces, aliases = self.pieces(engine, model, plan), model_state.tied_names(model)
        if self.executor is not None:
            upload = sharded.async_save(pieces, tmp, self.group, aliases)
            self.pending = self.executor.submit(self.finish_async, upload, tmp, final)
            return final
        try:
            sharded.save(pieces, tmp, aliases=aliases)
        except (Exception, sharded.DCPError) as err:  # DCP raises the same exception on every rank
            error = err
        self.check(error is None, error, tmp, final)
        if rank == 0:
            self.complete(tmp, final)
        dist.barrier()
        return final

    @staticmethod
    def pieces(engine, model, ep: ExpertParallelPlan) -> dict[str, FlatShard]:
        st.init_optimizer_state(engine.optimizer)
        pieces = engine_pieces(engine, model, ep, for_load=False)
        if dist.get_rank() == 0:  # buffers and extra state (for torch's loader) are the same on every rank
            pieces.update({MODEL_PREFIX + n: sharded.whole(b) for n, b in model_state.buffers(model).items()})
            pieces.update({MODEL_PREFIX + n: v for n, v in model_state.extra_states(model).items()})
        return pieces

    def check(self, ok: bool, error: BaseException | None, tmp: pathlib.Path, final: pathlib.Path) -> None:
        if ok:
            return
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = save_error_reason(error, tmp) if error is not None else "a write failed on another rank"
        raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {reason}; the previous checkpoints are kept")

    def complete(self, tmp: pathlib.Path, final: pathlib.Path) -> None:
        (tmp / layout.COMPLETE).touch()
        layout.apply_umask(tmp)
        layout.replace_dir(tmp, final)
        for old in layout.complete_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)

    def finish_async(self, upload, tmp: pathlib.Path, final: pathlib.Path) -> None:
        try:
            upload.result()
        except (Exception, sharded.DCPError) as err:
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {save_error_reason(err, tmp)}; "
                                  "the previous checkpoints are kept") from None
        if dist.get_rank() == 0:
            self.complete(tmp, final)

    def failed(self) -> bool:
        """Whether the save in flight has already failed; does not block. The trainer agrees on it over the ranks at
        every step (Trainer.reduce_step) and then calls `wait`, which raises the error on every rank: a failed
        asynchronous save stops the run at the first step boundary after the failure, not at the next save."""
        return self.pending is not None and self.pending.done() and self.pending.exception() is not None

    def wait(self) -> None:
        """Block until a save in flight is complete (its error, if any, is raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def save_error_reason(err: BaseException, where: pathlib.Path) -> str:
    """One line for a failed checkpoint write. A full disk says so, with the path and the space left, whatever
    wrapped the OSError: DCP's CheckpointException carries each rank's exception, and torch.save's stream writer
    turns a short write into "[enforce fail at inline_container.cc] unexpected pos N vs M"."""
    causes = list(exception_chain(err))
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in causes)
    if not full and any("unexpected pos" in str(e) or "No space left" in str(e) for e in causes):
        full = free_bytes(where) < DISK_FULL_BYTES
    if full:
        return disk_full(where, free_bytes(where))
    return sharded.first_line(next((e for e in causes if isinstance(e, OSError)), err))


DISK_FULL_BYTES = 64 << 20  # a short write with less than this left on the file system is taken for a full disk


def exception_chain(err: BaseException):
    """`err`, its causes and contexts, and the per-rank exceptions of a DCP CheckpointException."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


# ---- loading --------------------------------------------------------------------------------------------


def resume_candidates(resume: str | None, run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Checkpoints to try, in order: `auto` = the complete ones, newest first; a path = that one only."""
    if resume is None:
        return []
    if resume == "auto":
        return list(reversed(layout.complete_checkpoints(run_dir)))
    path = pathlib.Path(resume)
    if not layout.is_complete(path):
        raise CheckpointError(f"--resume {resume!r} is not a complete checkpoint directory")
    return [path]


def check_checkpoint(ckpt: pathlib.Path) -> None:
    """DamagedCheckpoint naming the first unusable file; a consolidated checkpoint is refused (moep-convert)."""
    if is_consolidated(ckpt):
        raise CheckpointError(convert_hint(ckpt))
    sharded.check_files(ckpt)
    if not (ckpt / TRAINER_STATE_FILE).exists() and "imported_from" in read_meta(ckpt):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} holds a model only (moep-import), no training state to "
                              "resume: start a run from it with model.init_from")
    try:
        json.loads((ckpt / TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"checkpoint {str(ckpt)!r} is damaged: {str(ckpt / TRAINER_STATE_FILE)!r} "
                                f"({sharded.first_line(err)})") from None


def load_model_state(model, ckpt: pathlib.Path, plan: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """Weights, buffers and extra state into the (unwrapped, not yet engine-owned) model."""
    model_state.load_module(model, ckpt, plan)


def load_engine_state(engine, model, ckpt: pathlib.Path, plan: ExpertParallelPlan = SINGLE_PROCESS) -> dict[str, Any]:
    """Restore fp32 masters, Adam moments/step, schedule, loss scaler, counters and RNG; returns trainer state."""
    state = json.loads((ckpt / TRAINER_STATE_FILE).read_text())
    st.init_optimizer_state(engine.optimizer)
    pieces = engine_pieces(engine, model, plan, for_load=True)
    with torch.no_grad():
        sharded.load(pieces, ckpt)
    commit_partitions(model, pieces)
    st.refresh_working_copies(engine.optimizer)
    st.set_optimizer_step_count(engine.optimizer, [p for p in model.parameters()], state["optimizer_step"])
    restore_trainer_state(engine, state)
    restore_rng(ckpt, dist.get_rank(), state)
    return state


def restore_trainer_state(engine, state: dict[str, Any]) -> None:
    if engine.lr_scheduler is not None:
        restore_schedule(engine.lr_scheduler, state["lr_scheduler"]["last_epoch"])
    scaler = st.loss_scaler(engine.optimizer)
    if scaler is not None and state.get("loss_scaler"):
        for key, value in state["loss_scaler"].items():
            setattr(scaler, key, value)
    engine.global_steps = state["step"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state.get("skipped_steps", 0)


def check_same_tokenizer(state: dict[str, Any], meta: dict[str, Any], ckpt: pathlib.Path) -> None:
    saved, current = state.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved and current and saved != current:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was trained with tokenizer sha256 {saved[:12]}..., but data.tokenizer of this "
            f"run has {current[:12]}...; resume with the data the checkpoint was trained on")


def warn_model_changes(model_cfg: Any, ckpt: pathlib.Path) -> list[str]:
    """Settings of the model that differ from those the checkpoint was trained with, logged as one warning. Shapes
    are checked when the weights load; this names what a shape cannot show (an activation, a router rule, a
    norm's epsilon), e.g. after a flavour's default changed or when a recipe was edited between runs."""
    from moep_ds.checkpointing.model_dir import CONFIG_FILE, load_recipe
    from moep_ds.schema import to_dict

    try:
        saved = to_dict(load_recipe(ckpt)[1].model)
    except Exception as err:  # noqa: BLE001 - an old or edited config.yaml: the comparison is advice only
        log.warning("could not compare the model with %s: %s", ckpt / CONFIG_FILE, err)
        return []
    changes = differences(saved, to_dict(model_cfg), "model")
    if changes:
        log.warning("the model differs from the one %s was trained with: %s%s", ckpt, "; ".join(changes[:5]),
                    f" (and {len(changes) - 5} more)" if len(changes) > 5 else "")
    return changes


def warn_length_change(state: dict[str, Any], max_steps: int, ckpt: pathlib.Path) -> bool:
    """Warn when the run's length differs from the one the checkpoint was saved in (a longer run, an edited recipe,
    epochs counted anew): the lr schedule follows the new length from the checkpoint's step on."""
    saved = state.get("max_steps")  # absent in checkpoints of before 2026-12-02
    if saved is None or saved == max_steps:
        return False
    log.warning("the run is %d steps long now, %d when %s was saved: the lr schedule follows %d from step %d on",
                max_steps, saved, ckpt, max_steps, state["step"])
    return True


def differences(saved: Any, now: Any, path: str) -> list[str]:
    """'path (saved there, now here)' for every leaf that differs between two nested dict/list trees."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for key in sorted(set(saved) | set(now), key=str)
                for d in differences(saved.get(key), now.get(key), f"{path}.{key}")]
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if saved == now else [f"{path} ({saved!r} there, {now!r} now)"]


def restore_schedule(scheduler, last_epoch: int) -> None:
    """Put the schedule at `last_epoch` and set every group's lr from it. The schedule is a function of the
    step alone, so this works whatever the number of parameter groups (expert parallelism adds MoE groups),
    unlike LRScheduler.load_state_dict, which also leaves the groups' current lr stale."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        scheduler.step()


def loss_scaler_state(engine) -> dict[str, Any] | None:
    scaler = st.loss_scaler(engine.optimizer)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}


def restore_rng(ckpt: pathlib.Path, rank: int, state: dict[str, Any]) -> None:
    """Same world size: each rank continues its own RNG streams; otherwise streams are re-seeded per rank."""
    path = ckpt / f"rng_rank{rank}.pt"
    rng = None
    if state.get("world_size") == dist.get_world_size() and path.is_file():
        try:
            rng = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - a file of pickled objects (numpy arrays) is refused: re-seed instead
            log.warning("%s holds pickled objects; re-seeding the RNG streams instead", path)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        seed = state.get("seed", 0) * 1000003 + state["step"] * 101 + rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
