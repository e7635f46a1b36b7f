"""The callbacks every run has unless its recipe removes them (`train.callbacks: {validation: null}`) or replaces
them (`{validation: {type: mymodule:MyValidation}}`), by name, in the order of their priority: router thresholds
kept alike on every rank, the expert lifecycle managers, monitoring (metrics.jsonl, TensorBoard, the console),
checkpointing, validation, stop handling. The loss-free balancing update is not among them: its counts travel in
the step's one all-reduce (`TrainModule.reduce_step`), which updates the biases before any callback runs (a
replaced expert's bias must stay 0).

Each is a class with its own small config (`Config`, beside it) and receives only that: none reads the recipe
(what a callback needs of the running trainer, its module, run_dir, rank, step, max_steps, comes through
`self.trainer`). Their settings have two sources, combined in one place (`callback_configs`): the recipe fields
they stand for (`recipe_fields`: `train.log_every`, `train.checkpoint.every_steps` / `every_minutes` / `at_end`,
`train.eval_every`, `train.eval_batches`, `data.seq_len`, and `eval.data_dir` for downstream_eval) and the
callback's own entry, `train.callbacks.<name>: {type: <name>, every_minutes: 30}`. A setting given in one of them
is taken from it; given in both with different values it is an error naming both (one source of truth per
setting). A recipe field at its default counts as not given, so the callback's entry may set it alone.
(`train.checkpoint.keep_last` and `async_save` are the checkpointer's: how it writes, not when.)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from moep_ds.checkpointing.sharded import CheckpointError
from moep_ds.data.dataset import open_split
from moep_ds.errors import UserError
from moep_ds.schema import ConfigError, PositiveFloat, PositiveInt
from moep_ds.training.callbacks.base import CALLBACKS, Callback, EndEvent, EvalEvent, StepEvent, parse_callback
from moep_ds.training.hooks import sync_router_thresholds
from moep_ds.training.lifecycle import LifecycleRunner
from moep_ds.training.monitor import Monitor
from moep_ds.training.run_dir import STOP_FILE
from moep_ds.training.startup import scored_windows
from moep_ds.training.stop import StopRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RouterThresholdsConfig:
    type: str = "router_thresholds"


@CALLBACKS.register("router_thresholds", config=RouterThresholdsConfig)
class RouterThresholdSync(Callback):
    """Expert-choice thresholds averaged over the data-parallel ranks after every step (training/hooks.py)."""

    Config = RouterThresholdsConfig
    priority = 600

    def __init__(self, cfg: RouterThresholdsConfig):
        self.cfg = cfg

    def after_optimizer_step(self, event: StepEvent) -> None:
        sync_router_thresholds(self.trainer.module.model)


@dataclasses.dataclass(kw_only=True)
class LifecycleConfig:
    type: str = "lifecycle"  # the managers' own settings are the router's (model.layers[...].lifecycle)


@CALLBACKS.register("lifecycle", config=LifecycleConfig)
class LifecycleManagers(Callback):
    """The expert lifecycle managers (training/lifecycle.py); their replacements become step events. Their state
    lives in the model's buffers, saved with the train module."""

    Config = LifecycleConfig
    priority = 500

    def __init__(self, cfg: LifecycleConfig):
        self.cfg = cfg

    def setup(self) -> None:
        module = self.trainer.module
        self.manager = LifecycleRunner.for_engine(module.engine, module.plan.group)

    def after_optimizer_step(self, event: StepEvent) -> None:
        event.events.extend(self.manager.after_optimizer_step(event.step))


@dataclasses.dataclass(kw_only=True)
class MonitoringConfig:
    type: str = "monitoring"
    log_every: PositiveInt = 10  # train.log_every: steps between metrics rows (and the first and last step)


@CALLBACKS.register("monitoring", config=MonitoringConfig)
class Monitoring(Callback):
    """metrics.jsonl, expert_utilization.jsonl and TensorBoard (training/monitor.py) on log steps, the events of
    every step, and every evaluation's metrics."""

    Config = MonitoringConfig
    priority = 400

    def __init__(self, cfg: MonitoringConfig):
        self.cfg = cfg

    def setup(self) -> None:
        self.monitor = Monitor(self.trainer.run_dir, self.trainer.module.engine, enabled=self.trainer.rank == 0)

    def after_step(self, event: StepEvent) -> None:
        t = self.trainer
        if event.step % self.cfg.log_every == 0 or event.step in (t.start_step + 1, t.max_steps):
            self.log_row(event)
        self.monitor.log_events(event.step, event.events)

    def on_stop(self, event: StepEvent) -> None:
        if event.nonfinite is not None:  # the step that failed the run is on record, a log step or not
            self.log_row(event)

    def log_row(self, event: StepEvent) -> None:
        t = self.trainer
        losses = dict(zip(event.losses, torch.stack(list(event.losses.values())).tolist()))
        metrics = t.module.metrics(event.step, losses, time.time() - event.started)
        self.monitor.log_step(event.step, metrics, event.stats)
        log.info("step %d/%d loss %.4f lr %.3g %.0f tok/s", event.step, t.max_steps,
                 metrics["loss"], metrics["lr"], metrics["tokens_per_s"])

    def on_evaluation(self, event: EvalEvent) -> None:
        self.monitor.log_step(event.step, event.metrics, {})

    def at_end(self, event: EndEvent) -> None:
        self.monitor.close()


class TrainingClock:
    """Seconds of training since the last reset, counted from the start of the first step this process runs: the
    start-up, a resume's loading and the time between a stop and its resume are not training. A resume carries the
    seconds its checkpoint held over (`carried`)."""

    def __init__(self, carried: float = 0.0):
        self.carried, self.since = carried, None

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def seconds(self) -> float:
        return self.carried + (0.0 if self.since is None else time.time() - self.since)

    def reset(self) -> None:
        self.carried, self.since = 0.0, time.time()


@dataclasses.dataclass(kw_only=True)
class CheckpointingConfig:
    type: str = "checkpointing"
    every_steps: PositiveInt | None = 1000  # train.checkpoint.every_steps
    # train.checkpoint.every_minutes: a checkpoint once the run has trained this long since the last one this
    # setting triggered (or since its first step), counting the training time over stops and resumes
    every_minutes: PositiveFloat | None = None
    at_end: bool = True  # train.checkpoint.at_end


@CALLBACKS.register("checkpointing", config=CheckpointingConfig)
class Checkpointing(Callback):
    """Decides when to checkpoint: on request to stop, every `every_steps`, every `every_minutes` (a flag of the
    step's all-reduce, so that every rank saves at the same step), and at the end; saves through the trainer's one
    checkpointer. A non-finite step is never saved (the trainer calls no after_step for it), so it rotates no earlier
    checkpoint out. An asynchronous save that failed on any rank stops the run at the next step boundary, on every
    rank. At the end, a save still in flight completes before the process may exit.

    `every_minutes` bounds the training a crash can lose, so its clock counts training time, not wall time (a job
    that waits a day in the queue between a stop and its resume has lost nothing, and saving at its first step
    would be a wasted save): the clock is in the checkpoint (`state_dict`), and a run stopped at minute 3 of 5 saves
    after 2 more minutes of training once resumed. Like `every_steps`, it is a cadence of its own: only the saves it
    triggers restart it (as Lightning's ModelCheckpoint(train_time_interval=...)); the other saves only lose less."""

    Config = CheckpointingConfig
    priority = 300

    def __init__(self, cfg: CheckpointingConfig):
        self.cfg = cfg
        self.clock = TrainingClock()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.cfg.every_minutes is None else {"trained_seconds": self.clock.seconds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = TrainingClock(float(state.get("trained_seconds", 0.0)))

    def flags(self) -> dict[str, bool]:
        minutes = self.cfg.every_minutes
        due = minutes is not None and self.clock.seconds() >= 60 * minutes
        return {"checkpoint_due": due, "checkpoint_failed": self.trainer.checkpointer.failed()}

    def before_step(self, event: StepEvent) -> None:
        self.clock.start(event.started)

    def after_optimizer_step(self, event: StepEvent) -> None:
        if event.flags.get("checkpoint_failed"):  # its error on every rank now, not at the next save
            self.trainer.checkpointer.wait()
            raise CheckpointError("an asynchronous checkpoint save failed on another rank (see its error)")

    def after_step(self, event: StepEvent) -> None:
        cfg = self.cfg
        step_due = cfg.every_steps is not None and event.step % cfg.every_steps == 0
        end_due = cfg.at_end and event.step == self.trainer.max_steps
        if event.flags.get("checkpoint_due"):  # due on any rank: every rank restarts its clock, before the save
            self.clock.reset()  # so that the checkpoint holds the clock this save restarts
        if event.stop or event.flags.get("checkpoint_due") or step_due or end_due:
            self.trainer.save()

    def at_end(self, event: EndEvent) -> None:
        self.trainer.checkpointer.wait()


@dataclasses.dataclass(kw_only=True)
class ValidationConfig:
    type: str = "validation"
    every: PositiveInt | None = None  # train.eval_every: steps between evaluations (and the last step); null: none
    batches: PositiveInt = 8  # train.eval_batches: global batches of validation windows per evaluation
    seq_len: PositiveInt | None = None  # data.seq_len: the windows' length (from the recipe, which always has one)


@CALLBACKS.register("validation", config=ValidationConfig)
class Validation(Callback):
    """The validation loss every `every` steps and at the end, after the step's checkpoint: an evaluation that fails
    must not take the step's training with it. The windows are checked at setup, not at the first evaluation."""

    Config = ValidationConfig
    priority = 200

    def __init__(self, cfg: ValidationConfig):
        self.cfg = cfg

    def setup(self) -> None:
        t = self.trainer
        self.val = None
        if self.cfg.every:
            self.val = open_split(t.prepared, "val", self.cfg.seq_len)
            self.windows = scored_windows(len(self.val), self.cfg.batches, t.module.ds, t.prepared, self.cfg.every)

    def after_step(self, event: StepEvent) -> None:
        every = self.cfg.every
        if every and (event.step % every == 0 or event.step == self.trainer.max_steps):
            val_loss = self.trainer.module.evaluate(self.val, self.windows)
            self.trainer.fire("on_evaluation", EvalEvent(event.step, {"val_loss": val_loss}))
            log.info("step %d val_loss %.4f", event.step, val_loss)


@dataclasses.dataclass(kw_only=True)
class StopConfig:
    type: str = "stop"


@CALLBACKS.register("stop", config=StopConfig)
class StopHandling(Callback):
    """Signals, the launcher going away and RUN_DIR/STOP (watched on rank 0) ask to stop (training/stop.py); the
    request is the `stop` flag of the step's all-reduce, so that every rank stops at the same step."""

    Config = StopConfig
    priority = 100

    def __init__(self, cfg: StopConfig):
        self.cfg = cfg

    def setup(self) -> None:
        t = self.trainer
        self.request = StopRequest(stop_file=t.run_dir / STOP_FILE if t.rank == 0 else None)

    def flags(self) -> dict[str, bool]:
        return {"stop": self.request.requested}

    def on_stop(self, event: StepEvent) -> None:
        if event.nonfinite is None:  # a non-finite step fails the run: the trainer says so
            log.warning("stopped at step %d on request; resume with --resume auto", event.step)


BUILTIN = ("router_thresholds", "lifecycle", "monitoring", "checkpointing", "validation", "stop")

NOT_DEFAULT = object()  # a recipe value that always counts as given (data.seq_len: the recipe always has one)


def recipe_fields(train, *, seq_len: int, eval_data_dir: str | None) -> dict[str, dict[str, tuple]]:
    """The recipe fields the callbacks' settings stand for, by callback type and field: (recipe path, value, the
    recipe's default). `train` is the recipe's train section; the values of other sections are passed alone."""
    default = type(train)()  # the train section's defaults
    checkpoint = {field: (f"train.checkpoint.{field}", getattr(train.checkpoint, field),
                          getattr(default.checkpoint, field)) for field in ("every_steps", "every_minutes", "at_end")}
    return {
        "monitoring": {"log_every": ("train.log_every", train.log_every, default.log_every)},
        "checkpointing": checkpoint,
        "validation": {"every": ("train.eval_every", train.eval_every, default.eval_every),
                       "batches": ("train.eval_batches", train.eval_batches, default.eval_batches),
                       "seq_len": ("data.seq_len", seq_len, NOT_DEFAULT)},
        "downstream_eval": {"data_dir": ("eval.data_dir", eval_data_dir, None)},
    }


def with_recipe(config: Any, fields: dict[str, tuple], path: str) -> Any:
    """`config` with the settings the recipe gives (`fields`, of `recipe_fields`): a recipe field given (not at its
    default) fills a setting the callback's entry leaves at its default; both given and different is an error."""
    own_defaults = {f.name: f.default for f in dataclasses.fields(config)}
    changes = {}
    for field, (recipe_path, value, default) in fields.items():
        own = getattr(config, field)
        if value == own or value == default:  # NOT_DEFAULT equals no value
            continue
        if own != own_defaults[field]:
            raise ConfigError(f"{path}.{field} ({own!r}) and {recipe_path} ({value!r}) set the same setting with "
                              "different values: give it in one of them")
        changes[field] = value
    return dataclasses.replace(config, **changes) if changes else config


def callback_configs(train, *, seq_len: int, eval_data_dir: str | None = None) -> dict[str, Any]:
    """Every callback's config by name, the one place the recipe maps into them: the built-in ones, changed by
    train.callbacks (a name: null removes a built-in one, None here; an entry, parsed into its type's Config, adds one
    or replaces the built-in one of its name), each of a known type given the recipe fields it stands for
    (`recipe_fields`, `with_recipe`). Its own result read back as train.callbacks gives that result again:
    build_trainer checks the recipe with it before anything is built, and the Trainer builds from it."""
    configs: dict[str, Any] = {name: CALLBACKS.config_class(name)() for name in BUILTIN}
    for name, entry in train.callbacks.items():
        if entry is None and name not in BUILTIN:
            raise UserError(f"train.callbacks.{name}: null removes a built-in callback, and {name!r} is none "
                            f"(built-in: {', '.join(BUILTIN)})")
        configs[name] = None if entry is None else parse_callback(entry, f"train.callbacks.{name}")
    fields = recipe_fields(train, seq_len=seq_len, eval_data_dir=eval_data_dir)
    return {name: None if config is None else
            with_recipe(config, fields.get(config.type, {}), f"train.callbacks.{name}")
            for name, config in configs.items()}
