"""The training loop under DeepSpeed: build, resume, step, and call the callbacks (training/callbacks/) that log,
checkpoint, evaluate and stop. What a step trains is `TrainModule` (training/train_module.py); the trainer's own
state in a checkpoint is `TrainerState` (training/trainer_state.py).
"""
from __future__ import annotations

import datetime
import logging
import os
import pathlib
import time

import torch.distributed as dist

from moep_ds.checkpointing import layout
from moep_ds.config import Config
from moep_ds.data.dataset import open_split
from moep_ds.data.prepare import check_meta, check_tokenizer_fits, prepare
from moep_ds.data.sampler import BatchLoader
from moep_ds.distributed.expert_parallel import check_parallel_layout
from moep_ds.distributed.launcher import launcher_generations  # noqa: F401 - re-exported
from moep_ds.distributed.process_group import init_distributed, leave_process_group, setup_logging, world_size_to_be
from moep_ds.distributed.rank_errors import agreed, raise_agreed
from moep_ds.errors import SharedUserError, UserError
from moep_ds.training import checkpoint as ckpt_io
from moep_ds.training.analyze import analyze, markdown
from moep_ds.training.balancing import LossFreeBalancing
from moep_ds.training.callbacks import (
    Callback, EndEvent, LoadEvent, SaveEvent, StepEvent, build_callback, builtin, parse_callback,
)
from moep_ds.training.ds_config import check_with_deepspeed, read_ds_config, reconcile
from moep_ds.training.init_from import initialise_from_source
from moep_ds.training.monitor import drop_rows_after
from moep_ds.training.resume_batch import reconcile_resumed, resume_state, saved_global_batch
from moep_ds.training.resume_data import check_same_data
from moep_ds.training.run_dir import claim_run_dir
from moep_ds.training.startup import (  # noqa: F401 - re-exported for callers of before
    PEAK_TFLOPS_BF16, build_rank_model, check_output_dir, peak_flops, scored_windows, set_aside, total_steps,
)
from moep_ds.training.stop import INTERRUPT_ECHO_S, StopRequest, launcher_chain, parent_pid  # noqa: F401
from moep_ds.training.train_module import TrainModule
from moep_ds.training.trainer_state import TrainerState

log = logging.getLogger(__name__)

PREPARE_TIMEOUT = datetime.timedelta(hours=12)


def prepare_data(cfg: Config, rank: int, local_rank: int) -> tuple[pathlib.Path, dict]:
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


class Trainer(TrainModule):
    """The loop: each step trains (`train_step`), makes its one all-reduce (`reduce_step`, which also updates the
    loss-free balancing biases), then calls the callbacks' hooks (training/callbacks/base.py lists them): the
    built-in ones (router thresholds, lifecycle, monitoring, checkpointing, validation, stop handling), then those
    of the recipe's train.callbacks, then the `callbacks` given here."""

    def __init__(self, cfg: Config, ds_config_path: str | None, resume: str | None, *, overwrite: bool = False,
                 allow_batch_change: bool = False, callbacks: list[Callback] | tuple = ()):
        """Everything up to the first step. A start-up that fails removes train.output_dir if it created it: each
        rank looks before the ranks meet in init_distributed, so before any of them can have created it."""
        created = layout.first_missing(cfg.train.output_dir)
        try:
            self.set_up(cfg, ds_config_path, resume, overwrite, allow_batch_change)
            self.add_callbacks(callbacks)
        except BaseException:
            layout.remove_new_dir(cfg.train.output_dir, created)
            raise

    def set_up(self, cfg: Config, ds_config_path: str | None, resume: str | None, overwrite: bool = False,
               allow_batch_change: bool = False) -> None:
        self.cfg = cfg
        # a bad file fails before the ranks meet (init_distributed waits for all of them and compiles an op)
        raw_ds = read_ds_config(ds_config_path)
        reconcile(raw_ds, cfg.train, world_size_to_be())
        self.device = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        setup_logging(self.rank)
        self.run_dir = pathlib.Path(cfg.train.output_dir)
        ds = reconcile_resumed(raw_ds, cfg.train, self.world, resume, self.run_dir, allow_batch_change)
        check_same_data(resume_state(resume, self.run_dir), cfg.data.seq_len, cfg.train.seed, warn=self.rank == 0)
        ds.setdefault("tensorboard", {"enabled": True, "output_path": str(self.run_dir), "job_name": "tensorboard"})
        check_with_deepspeed(ds)
        self.ds = ds
        check_parallel_layout(cfg, ds, self.world)
        check_output_dir(cfg.train.output_dir)
        claim_run_dir(self.run_dir, resume, overwrite)
        # before any tokenizing (prepare_data), which a tokenizer larger than the model would waste
        agreed(check_tokenizer_fits, cfg.data, cfg.model.vocab_size, run=self.rank == 0)
        self.prepared, self.meta = prepare_data(cfg, self.rank, int(os.environ.get("LOCAL_RANK", self.rank)))
        self.resume = resume
        self.dataset = open_split(self.prepared, "train", cfg.data.seq_len)
        self.val = self.open_validation()
        self.engine, self.model, self.ep_plan = self.build_engine()
        self.balancing = LossFreeBalancing(self.model)
        self.accum = ds["gradient_accumulation_steps"]
        self.loader = BatchLoader(self.dataset, micro_batch_size=ds["train_micro_batch_size_per_gpu"],
                                  grad_accum=self.accum, dp_rank=self.rank, dp_size=self.world, seed=cfg.train.seed,
                                  shuffle=cfg.data.order == "shuffled")
        self.step = 0 if self.resume_from is not None else self.start_at(self.start_step)
        self.tokens_per_step = ds["train_batch_size"] * cfg.data.seq_len
        self.state = None  # the resumed checkpoint's TrainerState
        if self.resume_from is not None:
            state = ckpt_io.load_engine_state(self.engine, self.model, self.resume_from, self.ep_plan)
            ckpt_io.check_same_tokenizer(state, self.meta, self.resume_from)
            self.state = TrainerState.from_state_dict(state, str(self.resume_from))  # version 1 or 2
            self.loader.load_state_dict(self.state.data, global_batch_size=saved_global_batch(state))
            self.step = self.state.step
            log.info("resumed from %s at step %d", self.resume_from, self.step)
            if self.rank == 0:
                ckpt_io.warn_length_change(state, self.max_steps, self.resume_from)
                ckpt_io.warn_model_changes(cfg.model, self.resume_from)
                drop_rows_after(self.run_dir, self.step)
        else:  # a fresh start: the weights of model.init_from, when the recipe names a source
            initialise_from_source(self.engine, self.model, cfg, self.ep_plan)
        self.checkpoints = ckpt_io.CheckpointWriter(self.run_dir, cfg.train.checkpoint.keep_last,
                                                    async_save=cfg.train.checkpoint.async_save)

    def add_callbacks(self, callbacks) -> None:
        """The built-in callbacks, the recipe's (train.callbacks) and `callbacks`, in that order; then on_load."""
        self.callbacks: list[Callback] = [cls(self) for cls in (
            builtin.RouterThresholdSync, builtin.ExpertLifecycle, builtin.Monitoring, builtin.Checkpointing,
            builtin.Validation, builtin.StopHandling)]
        self.stop = self.callbacks[-1]  # `requested` goes into the step's all-reduce
        users = [build_callback(parse_callback(entry, f"train.callbacks[{i}]"))
                 for i, entry in enumerate(self.cfg.train.callbacks)] + list(callbacks)
        for callback in users:
            callback.trainer = self
        self.callbacks += users
        if self.resume_from is not None:
            self.fire("on_load", LoadEvent(self.step, self.resume_from, self.state))

    def fire(self, hook: str, event, reverse: bool = False) -> None:
        """Call `hook` of every callback in order (at_end: in reverse, the way they were set up, so that
        checkpointing completes its saves before monitoring closes the logs)."""
        for callback in reversed(self.callbacks) if reverse else self.callbacks:
            getattr(callback, hook)(event)

    def trainer_state(self) -> TrainerState:
        scheduler = self.engine.lr_scheduler
        return TrainerState(
            step=self.step, max_steps=self.max_steps, global_samples=self.engine.global_samples,
            skipped_steps=self.engine.skipped_steps, data=self.loader.state_dict(),
            global_batch_size=self.ds["train_batch_size"],
            lr_scheduler={"last_epoch": scheduler.last_epoch} if scheduler is not None else None,
            loss_scaler=ckpt_io.loss_scaler_state(self.engine), world_size=self.world,
            expert_parallel_size=self.cfg.train.expert_parallel_size, seed=self.cfg.train.seed,
            tokenizer_sha256=self.meta.get("tokenizer_sha256"), seq_len=self.cfg.data.seq_len,
            tokens=self.tokens_read())

    def save(self) -> None:
        path = self.checkpoints.save(
            self.engine, self.model, self.cfg, self.step, self.trainer_state().state_dict(), plan=self.ep_plan,
            tokenizer_dir=self.prepared, meta={"tokens": self.tokens_read(), **self.report.as_dict()},
        )
        self.last_save = time.time()
        self.fire("on_save", SaveEvent(self.step, path))

    def fit(self) -> int:
        self.last_save = time.time()
        self.engine.train()
        stopped = False
        while self.step < self.max_steps:
            event = StepEvent(self.step + 1, started=time.time())
            self.fire("before_step", event)
            sums, event.stats = self.train_step()
            self.step += 1
            event.losses, stop, event.save_due = self.reduce_step(sums, self.last_save)  # before any callback
            event.stop = stop or self.step == self.cfg.train.exit_at_step
            self.fire("after_optimizer_step", event)
            self.fire("after_step", event)  # monitoring, then the step's checkpoint, then evaluations
            if event.stop:
                self.fire("on_stop", event)
                stopped = True
                break
        self.fire("at_end", EndEvent(self.step, stopped), reverse=True)
        if self.rank == 0:
            self.log_analysis()
        return 0

    def log_analysis(self) -> None:
        """The utilisation summary (moep-analyze) of the finished run; a log it cannot read (edited, or written
        by another program) is a warning: the training itself and its checkpoints are complete."""
        try:
            summary = analyze(self.run_dir)
        except UserError as err:
            log.warning("no utilisation summary: %s", err)
            return
        log.info("expert utilisation (moep-analyze %s):\n%s", self.run_dir, markdown(summary))


def fit(cfg: Config, ds_config_path: str | None = None, resume: str | None = None, **options) -> int:
    """Train (`options`: overwrite, allow_batch_change, callbacks); every rank leaves the process group together at
    the end. A rank that fails leaves without waiting for the others, which may be in another collective
    (cli.exit_joined ends it; the launcher stops the rest)."""
    code = Trainer(cfg, ds_config_path, resume, **options).fit()
    leave_process_group()
    return code
