"""The training loop under DeepSpeed: each step trains (the TrainModule, training/train_module.py), makes its one
all-reduce, then calls the named callbacks (training/callbacks/) that log, checkpoint, evaluate and stop. The run's
parts are built by training/assemble.py; a checkpoint saves and restores them through one Checkpointer
(training/checkpoint.py); the trainer's own state in it is `TrainerState` (training/trainer_state.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from moep_ds.checkpointing import layout
from moep_ds.distributed.process_group import leave_process_group
from moep_ds.errors import TrainingFailed, UserError
from moep_ds.training.analyze import analyze, markdown
from moep_ds.training.assemble import RunParts, assemble
from moep_ds.training.callbacks import (
    Callback, EndEvent, ErrorEvent, LoadEvent, SaveEvent, StepEvent, build_callback, ordered,
)
from moep_ds.training.callbacks.builtin import callback_configs
from moep_ds.training.checkpoint import NamedStates
from moep_ds.training.run_dir import RunDirInUse
from moep_ds.training.run_lock import release_run_dir
from moep_ds.training.startup import total_steps  # noqa: F401 - re-exported
from moep_ds.training.stop import StopRequest, launcher_chain, launcher_generations  # noqa: F401 - re-exported
from moep_ds.training.trainer_state import CALLBACKS, DATA_LOADER, TRAIN_MODULE, TRAINER, TrainerState

if TYPE_CHECKING:
    from moep_ds.training.recipe import Recipe

log = logging.getLogger(__name__)


class Trainer:
    """The loop over a run's built parts (`RunParts`) and a named set of callbacks: the built-in ones
    (callbacks/builtin.py), then the recipe's train.callbacks (a name: null entry removes a built-in one, a
    built-in name with a config replaces it), then `callbacks` (a mapping of names, or a list named by class),
    run in the order of their priority."""

    def __init__(self, parts: RunParts, callbacks: dict[str, Callback] | list[Callback] | tuple = ()):
        self.parts = parts
        self.cfg, self.module, self.checkpointer = parts.cfg, parts.module, parts.checkpointer
        self.rank, self.world, self.device = parts.rank, parts.world, parts.device
        self.run_dir, self.prepared = parts.run_dir, parts.prepared
        self.max_steps, self.start_step = parts.max_steps, parts.start_step
        self.step = parts.start_step
        self.callbacks = named_callbacks(callback_configs(self.cfg.train, seq_len=self.cfg.data.seq_len,
                                                          eval_data_dir=self.cfg.eval.data_dir), callbacks)
        self.order = ordered(self.callbacks)
        for _, callback in self.order:
            callback.trainer = self
            callback.setup()
        if parts.resumed is not None:  # every part from the state read once (training/assemble.py), in one place
            self.checkpointer.restore(parts.resume_from, parts.resumed, self.checkpoint_parts())
            self.fire("on_load", LoadEvent(self.step, parts.resume_from, parts.resumed))

    def fire(self, hook: str, event, reverse: bool = False) -> None:
        """Call `hook` of every callback in order (at_end: in reverse, so that checkpointing completes its saves
        before monitoring closes the logs)."""
        for _, callback in reversed(self.order) if reverse else self.order:
            getattr(callback, hook)(event)

    def flags(self) -> dict[str, bool]:
        """The callbacks' flags for this step on this rank (a name set by several callbacks is set if any set it)."""
        out: dict[str, bool] = {}
        for _, callback in self.order:
            for name, value in callback.flags().items():
                out[name] = out.get(name, False) or bool(value)
        return out

    def save(self) -> None:
        """Checkpoint the run at this step through the checkpointer (collective)."""
        path = self.checkpointer.save(self.step, self.checkpoint_parts())
        self.fire("on_save", SaveEvent(self.step, path))

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own part of a checkpoint, its position (the other parts': `checkpoint_parts`)."""
        cfg = self.cfg
        return {"step": self.step, "max_steps": self.max_steps, "world_size": self.world,
                "expert_parallel_size": cfg.train.expert_parallel_size, "seed": cfg.train.seed,
                "tokenizer_sha256": self.parts.meta.get("tokenizer_sha256")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]

    def checkpoint_parts(self) -> dict[str, Any]:
        """The parts a checkpoint keeps, by name, in the order a resume restores them (each with `state_dict` and
        `load_state_dict`): the TrainModule (its tensors too), its data loader, the trainer's position, the
        callbacks (each one's state under its name)."""
        return {TRAIN_MODULE: self.module, DATA_LOADER: self.module.loader, TRAINER: self,
                CALLBACKS: NamedStates(dict(self.order))}

    def checkpoint_state(self) -> TrainerState:
        """What a checkpoint of this step keeps besides the weights and moments: every part's state."""
        return TrainerState.of(self.checkpoint_parts())

    def fit(self) -> int:
        """Train to max_steps or a stop. A non-finite step raises TrainingFailed on every rank alike, after at_end (a
        save still in flight completes; the logs are closed)."""
        self.module.engine.train()
        event, stopped = None, False
        try:
            while self.step < self.max_steps and not stopped:
                event = self.run_step()
                stopped = event.stop
            self.fire("at_end", EndEvent(self.step, stopped), reverse=True)
            if stopped and event.nonfinite is not None:
                raise TrainingFailed(f"non-finite {event.nonfinite} at step {event.step}: training stopped without "
                                     f"saving step {event.step}; the checkpoints before it are kept")
        except BaseException as err:
            self.report_error(err)
            raise
        if self.rank == 0:
            self.log_analysis()
        return 0

    def run_step(self) -> StepEvent:
        """One step and its hooks. A non-finite loss or gradient norm on any rank (the step's all-reduce agrees on it:
        event.nonfinite) stops the run at once: the step's only hook is on_stop (monitoring logs its row), so no
        callback keeps state from it and no checkpoint holds it or rotates an earlier one out."""
        event = StepEvent(self.step + 1, started=time.time())
        self.fire("before_step", event)
        sums, event.stats = self.module.train_step()
        self.step += 1
        event.losses, event.flags, event.nonfinite = self.module.reduce_step(sums, self.flags())  # before any hook
        event.stop = (event.nonfinite is not None or event.flags.get("stop", False)
                      or self.step == self.cfg.train.exit_at_step)
        if event.nonfinite is None:
            self.fire("after_optimizer_step", event)
            self.fire("after_step", event)  # monitoring, then the step's checkpoint, then evaluations
        if event.stop:
            self.fire("on_stop", event)
        return event

    def report_error(self, err: BaseException) -> None:
        """on_error of every callback; an error of one of them is logged, and the others still see the first."""
        for name, callback in self.order:
            try:
                callback.on_error(ErrorEvent(self.step, err))
            except Exception as inner:  # noqa: BLE001 - the run's own error is the one raised
                log.warning("callback %r failed in on_error: %s", name, inner)

    def log_analysis(self) -> None:
        """The utilisation summary (moep-analyze) of the finished run; a log it cannot read (edited, or written
        by another program) is a warning: the training itself and its checkpoints are complete."""
        try:
            summary = analyze(self.run_dir)
        except UserError as err:
            log.warning("no utilisation summary: %s", err)
            return
        log.info("expert utilisation (moep-analyze %s):\n%s", self.run_dir, markdown(summary))


def named_callbacks(configs: dict[str, Any], given: dict[str, Callback] | list[Callback] | tuple) -> dict[str, Callback]:
    """The callbacks of `configs` (callbacks/builtin.py `callback_configs`: the built-in ones and the recipe's, None
    for one removed), then those given to the Trainer (a list is named by class: `MyCallback`, `MyCallback_2`, ...)."""
    callbacks: dict[str, Callback] = {name: build_callback(config) for name, config in configs.items()
                                      if config is not None}
    if not isinstance(given, dict):
        named = {}
        for callback in given:
            name, n = type(callback).__name__, 1
            while name in named:
                n += 1
                name = f"{type(callback).__name__}_{n}"
            named[name] = callback
        given = named
    callbacks.update(given)
    return callbacks


def build_trainer(cfg: Recipe, ds_config_path: str | dict | None = None, resume: str | None = None, *,
                  overwrite: bool = False, allow_batch_change: bool = False,
                  callbacks: dict[str, Callback] | list[Callback] | tuple = ()) -> Trainer:
    """The run's parts (training/assemble.py) and its Trainer. A start-up that fails removes train.output_dir if it
    created it: each rank looks before the ranks meet in init_distributed, so before any of them can have created
    it. The recipe's train.callbacks are parsed into their configs first, with the recipe fields the built-in ones stand
    for (a wrong type or option, or a setting given twice with two values, fails before anything is built), here
    rather than when the recipe is read: resolving a type imports its module."""
    # checked here, built by the Trainer: the recipe stays as written (its config.yaml in the checkpoints too, which a
    # later run may read with other train.log_every or checkpoint settings)
    callback_configs(cfg.train, seq_len=cfg.data.seq_len, eval_data_dir=cfg.eval.data_dir)
    created = layout.first_missing(cfg.train.output_dir)
    try:
        return Trainer(assemble(cfg, ds_config_path, resume, overwrite=overwrite,
                                allow_batch_change=allow_batch_change), callbacks)
    except RunDirInUse:  # the folder is another live run's, created by it at the same time
        raise
    except BaseException:
        release_run_dir(cfg.train.output_dir)  # the lock file as found (training/run_lock.py)
        layout.remove_new_dir(cfg.train.output_dir, created)
        raise


def fit(cfg: Recipe, ds_config_path: str | None = None, resume: str | None = None, **options) -> int:
    """Train (`options`: overwrite, allow_batch_change, callbacks); every rank leaves the process group together at
    the end. A rank that fails leaves without waiting for the others, which may be in another collective
    (cli.exit_joined ends it; the launcher stops the rest); a non-finite step fails every rank at the same step, and
    they leave together first (a launcher stops the others when one exits non-zero: not while they finish a save)."""
    trainer = build_trainer(cfg, ds_config_path, resume, **options)
    try:
        code = trainer.fit()
    except TrainingFailed:
        leave_process_group()
        raise
    leave_process_group()
    return code
