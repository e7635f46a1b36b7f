"""One start-up function, `assemble`: everything a run builds before its first step, returned as `RunParts` for the
Trainer (training/trainer.py). In order: the DeepSpeed config read and reconciled (before the ranks meet), the
process group, the run directory claimed, the data prepared, the model with this rank's experts (with the weights
of the checkpoint it resumes from, read before the engine exists), the DeepSpeed engine, the loader, the
TrainModule and the checkpointer. The checkpoint resumed is chosen here, once (`load_resumed_model`: a damaged one
skipped under --resume auto, all ranks agreeing), and its trainer state read and parsed once: the DeepSpeed config
takes its global batch, the data check its seq_len and seed, and the Trainer restores every part from it
(Checkpointer.restore).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moep_ds.checkpointing import sharded
from moep_ds.data.dataset import open_split
from moep_ds.data.prepare import check_meta, check_tokenizer_fits, prepare
from moep_ds.data.sampler import BatchLoader
from moep_ds.distributed.engine import Engine, initialize
from moep_ds.distributed.ds_validation import check_with_deepspeed
from moep_ds.distributed.expert_parallel import check_parallel_layout, expert_parallel_plan, setup_expert_parallel
from moep_ds.distributed.process_group import init_distributed, setup_logging, world_size_to_be
from moep_ds.distributed.rank_errors import agreed, raise_agreed
from moep_ds.errors import SharedUserError, UserError
from moep_ds.models.accounting import meta_param_report
from moep_ds.training import checkpoint as ckpt_io
from moep_ds.training.balancing import install_count_reducers
from moep_ds.training.blocks import apply_block_options
from moep_ds.training.branch import resolve_start_step
from moep_ds.training.ds_config import precision, read_ds_config, reconcile, zero_stage
from moep_ds.training.host_memory import RELEASE_THRESHOLD, return_freed_buffers_to_os
from moep_ds.training.init_from import initialise_from_source
from moep_ds.training.monitor import drop_rows_after
from moep_ds.training.optim import build_optimizer, build_scheduler, param_groups
from moep_ds.training.resume_batch import reconcile_resumed
from moep_ds.training.resume_data import check_same_data
from moep_ds.training.run_dir import claim_run_dir, start_branch
from moep_ds.training.startup import build_rank_model, check_output_dir, peak_flops, set_aside, total_steps
from moep_ds.training.train_module import TrainModule
from moep_ds.training.trainer_state import TrainerState

if TYPE_CHECKING:
    from moep_ds.train_config import TrainConfig
    from moep_ds.training.recipe import Recipe

log = logging.getLogger(__name__)

PREPARE_TIMEOUT = datetime.timedelta(hours=12)


@dataclasses.dataclass(eq=False)
class RunParts:
    """What `assemble` builds for the Trainer."""

    cfg: Recipe
    ds: dict[str, Any]  # the reconciled DeepSpeed config
    rank: int
    world: int
    device: torch.device
    run_dir: pathlib.Path
    prepared: pathlib.Path  # the packed corpus and its tokenizer
    meta: dict[str, Any]  # of the prepared corpus
    module: TrainModule
    checkpointer: ckpt_io.Checkpointer
    max_steps: int
    start_step: int  # where a fresh run starts: train.start_step (training/branch.py), else 0
    resume_from: pathlib.Path | None = None
    resumed: TrainerState | None = None  # its trainer state, read and version-checked, not yet restored


def prepare_data(cfg: Recipe, rank: int, local_rank: int) -> tuple[pathlib.Path, dict]:
    """Rank 0 prepares (or reuses) the packed corpus; then the first rank of every other node, which finds it
    complete where the nodes share the cache folder and prepares its node's copy where they do not; then the rest,
    who find it complete. The ranks wait in monitored barriers of a gloo group of their own with PREPARE_TIMEOUT,
    not the collectives' timeout (DeepSpeed's DEEPSPEED_TIMEOUT, 10 minutes), which tokenizing a large corpus on
    first use could outlast. A rank that fails still comes to the barrier; then it reports its error in one line and
    the others exit quietly (rank_errors.py), where they ended in the barrier's traceback once it was gone. Copies
    prepared on several nodes must agree (a sentencepiece tokenizer trained on a sample could differ)."""
    waiting = dist.new_group(backend="gloo")
    prepared = None
    for turn in (rank == 0, rank != 0 and local_rank == 0, local_rank != 0):
        error = None
        try:
            prepared = prepare(cfg.data) if turn else prepared
        except UserError as err:
            error = err
        dist.monitored_barrier(group=waiting, timeout=PREPARE_TIMEOUT, wait_all_ranks=True)
        raise_agreed(error, group=waiting)  # one line from the preparing rank, the others exit quietly
    meta = agreed(lambda: check_meta(prepared, vocab_size=cfg.model.vocab_size), group=waiting)
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, (meta.get("tokenizer_sha256"), meta["train_tokens"]), group=waiting)
    dist.destroy_process_group(waiting)
    if len(set(copies)) > 1:
        raise SharedUserError(f"the ranks prepared different corpora ({len(set(copies))} tokenizers / token counts "
                              f"for {str(prepared)!r}): nodes that do not share $MOEP_CACHE_DIR each prepared their "
                              "own; run moep-prepare once into a shared MOEP_CACHE_DIR")
    return prepared, meta


def new_model(cfg: Recipe, ds: dict[str, Any]):
    """(The model with this rank's experts only (its expert-parallel plan, moe/plan.py), under ZeRO-3 with this
    rank's partition of every parameter only (distributed/zero3.py), the plan); initialised from the seed alike
    on every rank, at every expert-parallel size and ZeRO stage."""
    plan = expert_parallel_plan(cfg.model, cfg.train.expert_parallel_size)
    model = build_rank_model(cfg.model, ds, cfg.train.seed, plan)
    setup_expert_parallel(model, plan, cfg.train.expert_comm)
    install_count_reducers(model)
    return model, plan


def run_config(cfg: Recipe, raw_ds: dict[str, Any], world: int, found: tuple[pathlib.Path, TrainerState] | None,
               allow_batch_change: bool, rank: int) -> dict[str, Any]:
    """The DeepSpeed config of a run that resumes `found` = (checkpoint, its trainer state) or starts fresh (None):
    reconciled with the checkpoint's global batch (training/resume_batch.py), the data checked against the
    checkpoint's (resume_data.py), DeepSpeed's own validation and the parallel layout."""
    ds = reconcile_resumed(raw_ds, cfg.train, world, found, allow_batch_change)
    check_same_data(found, cfg.data.seq_len, cfg.train.seed, warn=rank == 0)
    run_dir = str(pathlib.Path(cfg.train.output_dir))
    ds.setdefault("tensorboard", {"enabled": True, "output_path": run_dir, "job_name": "tensorboard"})
    check_with_deepspeed(ds)
    check_parallel_layout(cfg, ds, world)
    return ds


def load_resumed_model(cfg: Recipe, raw_ds: dict[str, Any], resume: str | None, run_dir: pathlib.Path, rank: int,
                       world: int, allow_batch_change: bool = False):
    """(model, plan, ds, (checkpoint, its TrainerState) or None): the checkpoint to resume, its state read once, the
    DeepSpeed config of its global batch (`run_config`) and the model with its weights. `--resume auto` skips a
    damaged newest checkpoint: all ranks agree on each candidate (its manifest and state, then its weights) before
    the engine, the only holder of optimizer state, exists; the config is that of the checkpoint resumed, not of
    one skipped. Only a run without checkpoints starts fresh: were none of them loadable, training from step 0 would
    overwrite the run's logs and its rotation delete them."""
    candidates = ckpt_io.resume_candidates(resume, run_dir)
    for i, ckpt in enumerate(candidates):
        error, state = None, None
        try:
            state = ckpt_io.check_checkpoint(ckpt)  # the trainer state, read once, before any weight is read
        except sharded.DamagedCheckpoint as err:
            error = err
        if sharded.agree(error is None):
            ds = run_config(cfg, raw_ds, world, (ckpt, state), allow_batch_change, rank)
            model, plan = new_model(cfg, ds)
            try:
                ckpt_io.load_model_state(model, ckpt, plan)
            except sharded.DamagedCheckpoint as err:
                error = err
            if sharded.agree(error is None):
                if rank == 0:
                    set_aside(candidates[:i])
                return model, plan, ds, (ckpt, state)
        if resume != "auto":
            raise error or sharded.DamagedCheckpoint(f"checkpoint {str(ckpt)!r} could not be read on every rank")
        log.warning("skipping damaged checkpoint %s: %s", ckpt, error or "unreadable on another rank")
    if candidates:  # every rank agreed on each: all raise this
        raise sharded.CheckpointError(
            f"--resume auto: all {len(candidates)} checkpoint(s) in {str(candidates[0].parent)!r} are damaged, "
            f"the newest is {str(candidates[0])!r} (see the warnings above); move them away to train from step 0")
    ds = run_config(cfg, raw_ds, world, None, allow_batch_change, rank)
    return (*new_model(cfg, ds), ds, None)


def build_engine(train: TrainConfig, ds: dict[str, Any], model, plan, device: torch.device, max_steps: int,
                 start_step: int) -> Engine:
    apply_block_options(model, activation_checkpointing=train.activation_checkpointing,
                        compile=train.compile)
    if train.activation_checkpointing and device.type == "cpu" and return_freed_buffers_to_os():
        # without this glibc keeps most of what checkpointing frees (training/host_memory.py)
        log.info("activation checkpointing on CPU: host buffers of >= %d KiB go back to the OS when freed",
                 RELEASE_THRESHOLD >> 10)
    return initialize(
        model, param_groups(model, train.optimizer), lambda groups: build_optimizer(groups, train.optimizer),
        lambda optimizer: build_scheduler(optimizer, train.schedule, max_steps, start_step), ds, plan)


def assemble(cfg: Recipe, ds_config_path: str | dict | None, resume: str | None, *, overwrite: bool = False,
             allow_batch_change: bool = False) -> RunParts:
    """The run's parts, up to the first step (module docstring)."""
    # a bad file fails before the ranks meet (init_distributed waits for all of them and compiles an op)
    raw_ds = read_ds_config(ds_config_path)
    reconcile(raw_ds, cfg.train, world_size_to_be())
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    run_dir = pathlib.Path(cfg.train.output_dir)
    # the config as the recipe gives it, checked before the run creates anything; a resume reconciles it again with
    # its checkpoint's global batch once the checkpoint is chosen (load_resumed_model)
    run_config(cfg, raw_ds, world, None, allow_batch_change, rank)
    check_output_dir(cfg.train.output_dir)
    claim_run_dir(run_dir, resume, overwrite)
    # before any tokenizing (prepare_data), which a tokenizer larger than the model would waste
    agreed(check_tokenizer_fits, cfg.data, cfg.model.vocab_size, run=rank == 0)
    prepared, meta = prepare_data(cfg, rank, int(os.environ.get("LOCAL_RANK", rank)))
    dataset = open_split(prepared, "train", cfg.data.seq_len)
    model, plan, ds, found = load_resumed_model(cfg, raw_ds, resume, run_dir, rank, world, allow_batch_change)
    resume_from, state = found or (None, None)
    max_steps = total_steps(cfg.train, len(dataset), ds["train_batch_size"])
    start_step = resolve_start_step(cfg, max_steps, resuming=resume_from is not None)  # 0 unless branching
    engine = build_engine(cfg.train, ds, model, plan, device, max_steps, start_step)
    report = meta_param_report(cfg.model, cfg.data.seq_len)  # of the whole model
    log.info("model: %s | %s | ZeRO-%d | %d ranks | expert parallel %d | %d steps", report.as_dict(), precision(ds),
             zero_stage(ds), world, cfg.train.expert_parallel_size, max_steps)
    loader = BatchLoader(dataset, micro_batch_size=ds["train_micro_batch_size_per_gpu"],
                         grad_accum=ds["gradient_accumulation_steps"], dp_rank=rank, dp_size=world,
                         seed=cfg.train.seed, shuffle=cfg.data.order == "shuffled")
    module = TrainModule(engine=engine, model=model, plan=plan, loader=loader, ds=ds, report=report,
                         tokens_per_step=ds["train_batch_size"] * cfg.data.seq_len, device=device,
                         seq_len=cfg.data.seq_len, peak_flops=peak_flops(cfg.train, device))
    parts = RunParts(cfg=cfg, ds=ds, rank=rank, world=world, device=device, run_dir=run_dir, prepared=prepared,
                     meta=meta, module=module, checkpointer=ckpt_io.Checkpointer(run_dir, cfg, prepared),
                     max_steps=max_steps, start_step=start_step)
    if resume_from is None:  # a fresh start: the weights of model.init_from, when the recipe names a source
        module.start_at(start_step)
        initialise_from_source(engine, model, cfg, plan)
        return parts
    ckpt_io.check_same_tokenizer(state, meta, resume_from)
    log.info("resumed from %s at step %d", resume_from, state.step)
    if rank == 0:
        ckpt_io.warn_length_change(state, max_steps, resume_from)
        ckpt_io.warn_model_changes(cfg.model, resume_from)
        if start_branch(run_dir, resume_from, state.step) is None:  # an older checkpoint: a new branch
            drop_rows_after(run_dir, state.step)
    return dataclasses.replace(parts, resume_from=resume_from, resumed=state)
