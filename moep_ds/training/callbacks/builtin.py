"""The callbacks every run has, in the order the trainer runs them (training/trainer.py `builtin_callbacks`):
router thresholds kept alike on every rank, the expert lifecycle managers, monitoring (metrics.jsonl,
TensorBoard, the console), checkpointing, validation, stop handling. The loss-free balancing update is not
among them: its counts travel in the step's one all-reduce (`TrainModule.reduce_step`), which updates the
biases before any callback runs (a replaced expert's bias must stay 0)."""
from __future__ import annotations

import logging
import time

import torch

from moep_ds.training.callbacks.base import Callback, EndEvent, EvalEvent, StepEvent
from moep_ds.training.ds_config import precision
from moep_ds.training.hooks import sync_router_thresholds
from moep_ds.training.lifecycle import ExpertLifecycleCallback
from moep_ds.training.monitor import Monitor
from moep_ds.training.run_dir import STOP_FILE
from moep_ds.training.stop import StopRequest

log = logging.getLogger(__name__)


class RouterThresholdSync(Callback):
    """Expert-choice thresholds averaged over the data-parallel ranks after every step (training/hooks.py)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_optimizer_step(self, event: StepEvent) -> None:
        sync_router_thresholds(self.trainer.engine.module)


class ExpertLifecycle(Callback):
    """The expert lifecycle managers (training/lifecycle.py); their replacements become step events."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.manager = ExpertLifecycleCallback.for_engine(trainer.engine, trainer.ep_plan.group)

    def after_optimizer_step(self, event: StepEvent) -> None:
        event.events.extend(self.manager.after_optimizer_step(event.step))


class Monitoring(Callback):
    """metrics.jsonl, expert_utilization.jsonl and TensorBoard (training/monitor.py) on log steps, the events of
    every step, and every evaluation's metrics."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.monitor = Monitor(trainer.run_dir, trainer.engine, enabled=trainer.rank == 0)

    def after_step(self, event: StepEvent) -> None:
        t = self.trainer
        if event.step % t.cfg.train.log_every == 0 or event.step in (t.start_step + 1, t.max_steps):
            losses = dict(zip(event.losses, torch.stack(list(event.losses.values())).tolist()))
            if t.engine.skipped_steps and precision(t.ds) == "fp16":
                losses["skipped_steps"] = float(t.engine.skipped_steps)
            metrics = t.metrics(losses, time.time() - event.started)
            self.monitor.log_step(event.step, metrics, event.stats)
            log.info("step %d/%d loss %.4f lr %.3g %.0f tok/s", event.step, t.max_steps,
                     metrics["loss"], metrics["lr"], metrics["tokens_per_s"])
        self.monitor.log_events(event.step, event.events)

    def on_evaluation(self, event: EvalEvent) -> None:
        self.monitor.log_step(event.step, event.metrics, {})

    def at_end(self, event: EndEvent) -> None:
        self.monitor.close()


class Checkpointing(Callback):
    """A checkpoint on request to stop, when one is due by time or step count, and at the end; at the end of the
    run, a save still in flight completes before the process may exit."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_step(self, event: StepEvent) -> None:
        cfg = self.trainer.cfg.train
        step_due = cfg.checkpoint.every_steps is not None and event.step % cfg.checkpoint.every_steps == 0
        end_due = cfg.checkpoint.at_end and event.step == self.trainer.max_steps
        if event.stop or event.save_due or step_due or end_due:
            self.trainer.save()

    def at_end(self, event: EndEvent) -> None:
        self.trainer.checkpoints.wait()


class Validation(Callback):
    """The validation loss every train.eval_every steps and at the end, after the step's checkpoint: an evaluation
    that fails must not take the step's training with it."""

    def __init__(self, trainer):
        self.trainer = trainer

    def after_step(self, event: StepEvent) -> None:
        every = self.trainer.cfg.train.eval_every
        if every and (event.step % every == 0 or event.step == self.trainer.max_steps):
            val_loss = self.trainer.evaluate()
            self.trainer.fire("on_evaluation", EvalEvent(event.step, {"val_loss": val_loss}))
            log.info("step %d val_loss %.4f", event.step, val_loss)


class StopHandling(Callback):
    """Signals, the launcher going away and RUN_DIR/STOP (watched on rank 0) ask to stop (training/stop.py);
    `requested` goes into the step's all-reduce, so that every rank stops at the same step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.request = StopRequest(stop_file=trainer.run_dir / STOP_FILE if trainer.rank == 0 else None)

    @property
    def requested(self) -> bool:
        return self.request.requested

    def on_stop(self, event: StepEvent) -> None:
        log.warning("stopped at step %d on request; resume with --resume auto", event.step)
