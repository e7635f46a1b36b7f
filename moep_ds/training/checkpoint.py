"""Sharded training checkpoints: each rank writes and reads only the optimizer state it owns, at any ZeRO stage.

RUN_DIR/checkpoints/step_00000100/
    .metadata, __<rank>_0.distcp   DCP: fp32 masters and buffers under their state_dict() names (a tied head as
                                   an alias), optim/<name>/<key> Adam moments, all in their true shapes
                                   (checkpointing/sharded.py; torch.distributed.checkpoint.load reads them alone)
    extra_state.json               non-tensor module state (lifecycle event logs)
    trainer_state.json             each part's state_dict under its name (training/trainer_state.py): the
                                   trainer's position, the train module's step state (engine counters, lr
                                   schedule, loss scaler, Adam's step), the data loader's position, each callback's
    rng_rank{r}.pt                 each rank's RNG states (tensors and tuples: loads with weights_only=True)
    config.yaml, meta.json, tokenizer files
    MANIFEST.json                  every file's size and checksum (checkpointing/manifest.py), checked at load
    COMPLETE

What a rank owns (distributed/owned_state.py) is written and read as pieces of the global flat tensors, so world
size, expert-parallel size, ZeRO stage and master precision may all change between save and load.

`Checkpointer` is the one seam: it saves the run's parts, a mapping of names to objects with `state_dict` /
`load_state_dict` (torchtitan's CheckpointManager(states={...})): the train module (whose model and engine also give
the tensors), the trainer, the data loader, the callbacks (`NamedStates`). Resuming, training/assemble.py picks the
checkpoint, whose trainer state `check_checkpoint` reads once (its bytes checksum-verified, then parsed) before
anything is built; `restore` then puts every part back in one place.

A checkpoint is written under `.tmp-<tag>` and renamed once every rank's files are durable (DCP fsyncs and
gathers the ranks' results before its metadata is written), so a crash at any point leaves the previous
complete checkpoint as the newest. With `train.checkpoint.async_save` the ranks copy their pieces to CPU and
training goes on while DCP writes them on a gloo group of their own; the rename happens when the write is done.
Before COMPLETE each rank hashes the files it wrote and rank 0 writes the manifest of them all (`seal`); resuming,
the ranks verify it in shares and agree (`check_checkpoint`), so flipped bytes make a checkpoint damaged.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import pathlib
import random
import re
import shutil
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from moep_ds.checkpointing import layout, manifest, model_state, sharded
from moep_ds.checkpointing.model_dir import convert_hint, is_consolidated, read_meta, write_recipe_files
from moep_ds.checkpointing.sharded import MODEL_PREFIX, CheckpointError, DamagedCheckpoint, FlatShard
from moep_ds.distributed import optimizer_state as st
from moep_ds.distributed.owned_state import commit_partitions, owned_pieces
from moep_ds.fsutil import disk_full_reason, exception_chain
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.training import trainer_state
from moep_ds.training.rng import rng_state
from moep_ds.training.trainer_state import TRAIN_MODULE, TrainerState

log = logging.getLogger(__name__)

TRAINER_STATE_FILE = trainer_state.FILE


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NamedStates:
    """Named parts as one (the callbacks): each one's non-empty `state_dict` under its name; loading gives each the
    state saved under its name, and one the checkpoint has none for keeps its own."""

    def __init__(self, parts: Mapping[str, Any]):
        self.parts = parts

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: state for name, part in self.parts.items() if (state := part.state_dict())}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        for name, part in self.parts.items():
            if name in state:
                part.load_state_dict(state[name])


# ---- saving ---------------------------------------------------------------------------------------------


class CheckpointWriter:
    """Writes a run's checkpoints (collective: every rank calls `save` and `wait` at the same steps)."""

    def __init__(self, run_dir: pathlib.Path, keep_last: int, async_save: bool = False,
                 checksum: str | None = manifest.ALGORITHM):
        self.root = layout.checkpoint_root(run_dir)
        self.keep_last = keep_last
        self.checksum = checksum  # None: no manifest (bench/checkpoint_scale.py measures the difference)
        self.pending: concurrent.futures.Future | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(1) if async_save else None
        # DCP's asynchronous writer runs collectives from its own thread: they need a (CPU) group of their own
        self.group = dist.new_group(backend="gloo") if async_save else None

    def save(self, engine, model, cfg, step: int, state: TrainerState, *,
             plan: ExpertParallelPlan = SINGLE_PROCESS,
             tokenizer_dir: pathlib.Path | None = None, meta: dict | None = None) -> pathlib.Path:
        """Write checkpoint `step` of `engine` (a distributed.engine.Engine) over `model`, with the parts' `state`
        and the recipe `cfg`; returns its final path (asynchronous: where it will be once written)."""
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
                trainer_state.write(state, tmp)
                sharded.save_json(model_state.extra_states(model), tmp / model_state.EXTRA_STATE_FILE)
                write_recipe_files(cfg, tmp, tokenizer_dir, {"step": step, **(meta or {})})
        except OSError as err:
            error = err
        self.check(sharded.agree(error is None), error, tmp, final)
        pieces, aliases = self.pieces(engine, model, plan), model_state.tied_names(model)
        # the data files are hashed as they are written (into `written`); seal() hashes the rest
        written, hasher = {}, self.checksum and functools.partial(manifest.hasher, self.checksum)
        if self.executor is not None:
            upload = sharded.async_save(pieces, tmp, self.group, aliases, hasher=hasher, digests=written)
            self.pending = self.executor.submit(self.finish_async, upload, tmp, final, written)
            return final
        try:
            sharded.save(pieces, tmp, aliases=aliases, hasher=hasher, digests=written)
        except (Exception, sharded.DCPError) as err:  # DCP raises the same exception on every rank
            error = err
        self.check(error is None, error, tmp, final)
        self.seal(tmp, final, written)
        if rank == 0:
            self.complete(tmp, final)
        dist.barrier()
        return final

    @staticmethod
    def pieces(engine, model, ep: ExpertParallelPlan) -> dict[str, FlatShard]:
        st.init_optimizer_state(engine.optimizer)
        pieces = owned_pieces(engine.optimizer, model, ep, for_load=False)
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

    def seal(self, tmp: pathlib.Path, final: pathlib.Path, written: dict[str, dict], group=None) -> None:
        """Every rank hashes the files it wrote, in parallel (its data file was hashed as it was written: `written`);
        rank 0 writes the manifest of them all (collective over `group`; CheckpointError on every rank if any rank
        failed)."""
        if self.checksum is None:
            return
        rank, error, files = dist.get_rank(), None, {}
        try:
            own = manifest.own_files(tmp, rank)
            files = {**manifest.records(tmp, [n for n in own if n not in written], self.checksum),
                     **{n: r for n, r in written.items() if n in own}}
        except OSError as err:
            error = err
        gathered = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(files if error is None else save_error_reason(error, tmp), gathered, dst=0, group=group)
        if rank == 0 and error is None:
            failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
            try:
                if failed:
                    raise OSError(f"rank {failed[0][0]} could not hash its files: {failed[0][1]}")
                manifest.write(tmp, {n: f for g in gathered for n, f in g.items()}, self.checksum)
            except OSError as err:
                error = err
        self.check(sharded.agree(error is None, group), error, tmp, final)

    def complete(self, tmp: pathlib.Path, final: pathlib.Path) -> None:
        (tmp / layout.COMPLETE).touch()
        layout.apply_umask(tmp)
        layout.replace_dir(tmp, final)
        for old in layout.complete_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)

    def finish_async(self, upload, tmp: pathlib.Path, final: pathlib.Path, written: dict[str, dict]) -> None:
        try:
            upload.result()
        except (Exception, sharded.DCPError) as err:
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {save_error_reason(err, tmp)}; "
                                  "the previous checkpoints are kept") from None
        self.seal(tmp, final, written, self.group)  # on the save's own group: training goes on on the default one
        if dist.get_rank() == 0:
            self.complete(tmp, final)

    def failed(self) -> bool:
        """Whether the save in flight has already failed; does not block. The ranks agree on it at every step (the
        checkpointing callback's `checkpoint_failed` flag, in TrainModule.reduce_step) and then call `wait`, which raises the error on every rank: a failed
        asynchronous save stops the run at the first step boundary after the failure, not at the next save."""
        return self.pending is not None and self.pending.done() and self.pending.exception() is not None

    def wait(self) -> None:
        """Block until a save in flight is complete (its error, if any, is raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def save_error_reason(err: BaseException, where: pathlib.Path) -> str:
    """One line for a failed checkpoint write: a full disk says so with the path and the space left (fsutil's
    disk_full_reason, whatever wrapped the OSError), any other error is the first OSError's line."""
    return disk_full_reason(err, where) or sharded.first_line(
        next((e for e in exception_chain(err) if isinstance(e, OSError)), err))


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


def check_checkpoint(ckpt: pathlib.Path) -> TrainerState:
    """The checkpoint's trainer state (version checked); DamagedCheckpoint naming the first unusable file; a
    consolidated checkpoint is refused (moep-convert)."""
    if is_consolidated(ckpt):
        raise CheckpointError(convert_hint(ckpt))
    data = trainer_state.read_bytes(ckpt)  # once: its checksum is verified on these bytes, then they are parsed
    check_together(ckpt, {TRAINER_STATE_FILE: data} if data is not None else None)
    if data is None and "imported_from" in read_meta(ckpt):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} holds a model only (moep-import), no training state to "
                              "resume: start a run from it with model.init_from")
    return trainer_state.read(ckpt, data)


def check_together(ckpt: pathlib.Path, read: dict[str, bytes] | None = None) -> None:
    """`manifest.check` with the checksums verified in shares by the ranks in parallel (collective where
    distributed): every rank raises the same DamagedCheckpoint, that of the lowest rank that found one. `read`: files
    read already (name -> bytes), verified on those bytes."""
    if not (dist.is_available() and dist.is_initialized()):
        return manifest.check(ckpt, already=read)
    error = None
    try:
        manifest.check(ckpt, dist.get_rank(), dist.get_world_size(), read)
    except DamagedCheckpoint as err:
        error = str(err)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, error)
    first = next((e for e in found if e is not None), None)
    if first is not None:
        raise DamagedCheckpoint(first)


def load_model_state(model, ckpt: pathlib.Path, plan: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """Weights, buffers and extra state into the (unwrapped, not yet engine-owned) model."""
    model_state.load_module(model, ckpt, plan)


def load_pieces(engine, model, ckpt: pathlib.Path, plan: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """The fp32 masters and Adam moments this rank owns from `ckpt` into `engine` (a distributed.engine.Engine),
    and the model's working copies made to match them."""
    st.init_optimizer_state(engine.optimizer)
    pieces = owned_pieces(engine.optimizer, model, plan, for_load=True)
    with torch.no_grad():
        sharded.load(pieces, ckpt)
    commit_partitions(model, pieces)
    st.refresh_working_copies(engine.optimizer)


def check_same_tokenizer(state: TrainerState, meta: dict[str, Any], ckpt: pathlib.Path) -> None:
    saved, current = state.tokenizer_sha256, meta.get("tokenizer_sha256")
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


def warn_length_change(state: TrainerState, max_steps: int, ckpt: pathlib.Path) -> bool:
    """Warn when the run's length differs from the one the checkpoint was saved in (a longer run, an edited recipe,
    epochs counted anew): the lr schedule follows the new length from the checkpoint's step on."""
    saved = state.max_steps  # absent in checkpoints of before 2026-12-02
    if saved is None or saved == max_steps:
        return False
    log.warning("the run is %d steps long now, %d when %s was saved: the lr schedule follows %d from step %d on",
                max_steps, saved, ckpt, max_steps, state.step)
    return True


def differences(saved: Any, now: Any, path: str) -> list[str]:
    """'path (saved there, now here)' for every leaf that differs between two nested dict/list trees."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for key in sorted(set(saved) | set(now), key=str)
                for d in differences(saved.get(key), now.get(key), f"{path}.{key}")]
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if saved == now else [f"{path} ({saved!r} there, {now!r} now)"]


def restore_rng(ckpt: pathlib.Path, rank: int, state: TrainerState) -> None:
    """Same world size: each rank continues its own RNG streams; otherwise streams are re-seeded per rank."""
    path = ckpt / f"rng_rank{rank}.pt"
    rng = None
    if state.world_size == dist.get_world_size() and path.is_file():
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
        seed = (state.seed or 0) * 1000003 + state.step * 101 + rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)


class TensorPart(Stateful, Protocol):
    """The part whose tensors a checkpoint holds as pieces (the TrainModule): its model, the engine that owns the
    masters and moments, the expert-parallel plan the model was built with."""

    engine: Any
    model: Any
    plan: ExpertParallelPlan

    def checkpoint_meta(self) -> dict[str, Any]: ...  # for meta.json (tokens read, parameter counts)


class Checkpointer:
    """The one seam through which a run saves and resumes its parts (module docstring; collective: every rank calls
    `save`, `restore` and `wait` at the same steps)."""

    def __init__(self, run_dir: pathlib.Path, cfg: Any, tokenizer_dir: pathlib.Path | None):
        train = cfg.train.checkpoint
        self.writer = CheckpointWriter(run_dir, train.keep_last, async_save=train.async_save)
        self.cfg = cfg
        self.tokenizer_dir = tokenizer_dir

    def save(self, step: int, parts: Mapping[str, Stateful]) -> pathlib.Path:
        """Checkpoint `parts` at optimizer step `step`: the tensors of parts["train_module"] (a TensorPart) as
        pieces, each part's `state_dict` under its name."""
        module: TensorPart = parts[TRAIN_MODULE]  # type: ignore[assignment]
        return self.writer.save(module.engine, module.model, self.cfg, step, TrainerState.of(parts), plan=module.plan,
                                tokenizer_dir=self.tokenizer_dir, meta=module.checkpoint_meta())

    def restore(self, ckpt: pathlib.Path, state: TrainerState, parts: Mapping[str, Stateful]) -> None:
        """Every part from `ckpt`, whose `state` check_checkpoint read: the train module's masters and moments (its
        weights were loaded into the model before the engine existed), the RNG streams, then each part's state in
        the order of `parts` (a part the checkpoint has no state for keeps its own)."""
        module: TensorPart = parts[TRAIN_MODULE]  # type: ignore[assignment]
        load_pieces(module.engine, module.model, ckpt, module.plan)
        restore_rng(ckpt, dist.get_rank(), state)
        saved = state.parts()
        for name, part in parts.items():
            if name in saved:
                part.load_state_dict(saved[name])

    def failed(self) -> bool:
        return self.writer.failed()

    def wait(self) -> None:
        self.writer.wait()
