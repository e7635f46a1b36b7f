"""The callbacks every run has unless its recipe removes them (`train.callbacks: {validation: null}`) or replaces
them (`{validation: {type: mymodule:MyValidation}}`), by name, in the order of their priority: router thresholds
kept alike on every rank, the expert lifecycle managers, monitoring (metrics.jsonl, TensorBoard, the console),
checkpointing, validation, stop handling. The loss-free balancing update is not among them: its counts travel in
the step's one all-reduce (`TrainModule.reduce_step`), which updates the biases before any callback runs (a
replaced expert's bias must stay 0)."""
from __future__ import annotations

import logging
import time

import torch

from moep_ds.checkpointing.sharded import CheckpointError
from moep_ds.data.dataset import open_split
from moep_ds.training.callbacks.base import CALLBACKS, Callback, EndEvent, EvalEvent, StepEvent
from moep_ds.training.hooks import sync_router_thresholds
from moep_ds.training.lifecycle import LifecycleRunner
from moep_ds.training.monitor import Monitor
from moep_ds.training.run_dir import STOP_FILE
from moep_ds.training.startup import scored_windows
from moep_ds.training.stop import StopRequest

log = logging.getLogger(__name__)


@CALLBACKS.register("router_thresholds")
class RouterThresholdSync(Callback):
    """Expert-choice thresholds averaged over the data-parallel ranks after every step (training/hooks.py)."""

    priority = 600

    def after_optimizer_step(self, event: StepEvent) -> None:
        sync_router_thresholds(self.trainer.module.model)


@CALLBACKS.register("lifecycle")
class LifecycleManagers(Callback):
    """The expert lifecycle managers (training/lifecycle.py); their replacements become step events."""

    priority = 500

    def setup(self) -> None:
        module = self.trainer.module
        self.manager = LifecycleRunner.for_engine(module.engine, module.plan.group)

    def after_optimizer_step(self, event: StepEvent) -> None:
        event.events.extend(self.manager.after_optimizer_step(event.step))


@CALLBACKS.register("monitoring")
class Monitoring(Callback):
    """metrics.jsonl, expert_utilization.jsonl and TensorBoard (training/monitor.py) on log steps, the events of
    every step, and every evaluation's metrics."""

    priority = 400

    def setup(self) -> None:
        self.monitor = Monitor(self.trainer.run_dir, self.trainer.module.engine, enabled=self.trainer.rank == 0)

    def after_step(self, event: StepEvent) -> None:
        t = self.trainer
        if event.step % t.cfg.train.log_every == 0 or event.step in (t.start_step + 1, t.max_steps):
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


@CALLBACKS.register("checkpointing")
class Checkpointing(Callback):
    """Decides when to checkpoint: on request to stop, every train.checkpoint.every_steps, every
    train.checkpoint.every_minutes (a flag of the step's all-reduce, so that every rank saves at the same step),
    and at the end; saves through the trainer's one checkpointer. A non-finite step is never saved (the trainer calls
    no after_step for it), so it rotates no earlier checkpoint out. An asynchronous save that failed on any rank
    stops the run at the next step boundary, on every rank. At the end, a save still in flight completes before the
    process may exit."""

    priority = 300

    def setup(self) -> None:
        self.last_save = time.time()

    def flags(self) -> dict[str, bool]:
        minutes = self.trainer.cfg.train.checkpoint.every_minutes
        due = minutes is not None and (time.time() - self.last_save) >= 60 * minutes
        return {"checkpoint_due": due, "checkpoint_failed": self.trainer.checkpointer.failed()}

    def after_optimizer_step(self, event: StepEvent) -> None:
        if event.flags.get("checkpoint_failed"):  # its error on every rank now, not at the next save
            self.trainer.checkpointer.wait()
            raise CheckpointError("an asynchronous checkpoint save failed on another rank (see its error)")

    def after_step(self, event: StepEvent) -> None:
        cfg = self.trainer.cfg.train.checkpoint
        step_due = cfg.every_steps is not None and event.step % cfg.every_steps == 0
        end_due = cfg.at_end and event.step == self.trainer.max_steps
        if event.stop or event.flags.get("checkpoint_due") or step_due or end_due:
            self.trainer.save()
            self.last_save = time.time()

    def at_end(self, event: EndEvent) -> None:
        self.trainer.checkpointer.wait()


@CALLBACKS.register("validation")
class Validation(Callback):
    """The validation loss every train.eval_every steps and at the end, after the step's checkpoint: an evaluation
    that fails must not take the step's training with it. The windows are checked at setup, not at the first
    evaluation."""

    priority = 200

    def setup(self) -> None:
        t = self.trainer
        self.val = None
        if t.cfg.train.eval_every:
            self.val = open_split(t.prepared, "val", t.cfg.data.seq_len)
            self.windows = scored_windows(len(self.val), t.cfg.train, t.module.ds, path=t.prepared)

    def after_step(self, event: StepEvent) -> None:
        every = self.trainer.cfg.train.eval_every
        if every and (event.step % every == 0 or event.step == self.trainer.max_steps):
            val_loss = self.trainer.module.evaluate(self.val, self.windows)
            self.trainer.fire("on_evaluation", EvalEvent(event.step, {"val_loss": val_loss}))
            log.info("step %d val_loss %.4f", event.step, val_loss)


@CALLBACKS.register("stop")
class StopHandling(Callback):
    """Signals, the launcher going away and RUN_DIR/STOP (watched on rank 0) ask to stop (training/stop.py); the
    request is the `stop` flag of the step's all-reduce, so that every rank stops at the same step."""

    priority = 100

    def setup(self) -> None:
        t = self.trainer
        self.request = StopRequest(stop_file=t.run_dir / STOP_FILE if t.rank == 0 else None)

    def flags(self) -> dict[str, bool]:
        return {"stop": self.request.requested}

    def on_stop(self, event: StepEvent) -> None:
        if event.nonfinite is None:  # a non-finite step fails the run: the trainer says so
            log.warning("stopped at step %d on request; resume with --resume auto", event.step)


BUILTIN = ("router_thresholds", "lifecycle", "monitoring", "checkpointing", "validation", "stop")
