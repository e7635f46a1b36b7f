"""The trainer's hooks: a `Callback` with no-op methods, the typed events they receive, and the registry of the
names a recipe may give (`train.callbacks: [{type: NAME, ...options}]`).

Hooks, in the order the trainer calls them in one step (training/trainer.py):
  before_step(StepEvent)           before the step's micro-batches
  after_optimizer_step(StepEvent)  after the step's one all-reduce (losses, balancing counts, stop flags) and the
                                   loss-free balancing update; a callback may append to `event.events`
  after_step(StepEvent)            logging, then checkpointing (on_save), then evaluation (on_evaluation)
  on_save(SaveEvent)               a checkpoint was written (or started, when saving asynchronously)
  on_evaluation(EvalEvent)         an evaluation produced metrics (validation loss, downstream accuracies)
  on_stop(StepEvent)               the run stops early on request (signal, STOP file, exit_at_step)
  at_end(EndEvent)                 after the last step, on every rank
and once, before the first step, on_load(LoadEvent) when the run resumed from a checkpoint.
Every rank calls every hook: a callback that runs a collective runs it on all ranks alike.

A recipe's `type` is a registered name (`CALLBACKS.names()`), or `module:Class` / `module.Class`, which imports
the user's own Python module (on PYTHONPATH) to find the class. A class's options are its `Config` dataclass
(one with a `type: str` field), parsed strictly; without one, `type` is the only key.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from moep_ds.registry import Registry
from moep_ds.schema import ConfigError, parse_dataclass

if TYPE_CHECKING:
    from moep_ds.training.trainer import Trainer


@dataclasses.dataclass
class StepEvent:
    step: int  # the step just taken (before_step: the step about to be taken)
    losses: dict[str, Any] = dataclasses.field(default_factory=dict)  # averaged over ranks, on the device
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # this rank's routing statistics
    stop: bool = False  # the run stops after this step
    save_due: bool = False  # a time-based checkpoint is due (any rank)
    started: float = 0.0  # time.time() at the step's start
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # discrete events (lifecycle)


@dataclasses.dataclass
class EvalEvent:
    step: int
    metrics: dict[str, float]  # e.g. {"val_loss": 2.3} or {"eval/grammar_pairs/acc": 0.61}


@dataclasses.dataclass
class SaveEvent:
    step: int
    path: Any  # the checkpoint folder


@dataclasses.dataclass
class LoadEvent:
    step: int
    path: Any
    state: Any  # the TrainerState read


@dataclasses.dataclass
class EndEvent:
    step: int
    stopped: bool  # stopped on request before max_steps


class Callback:
    """Subclass and override the hooks you need; `self.trainer` is set when the trainer takes the callback."""

    trainer: Trainer

    def before_step(self, event: StepEvent) -> None:
        pass

    def after_optimizer_step(self, event: StepEvent) -> None:
        pass

    def after_step(self, event: StepEvent) -> None:
        pass

    def on_save(self, event: SaveEvent) -> None:
        pass

    def on_evaluation(self, event: EvalEvent) -> None:
        pass

    def on_load(self, event: LoadEvent) -> None:
        pass

    def on_stop(self, event: StepEvent) -> None:
        pass

    def at_end(self, event: EndEvent) -> None:
        pass


@dataclasses.dataclass(kw_only=True)
class CallbackConfig:
    """The options of a callback class without a Config of its own: its name only."""
    type: str


class CallbackRegistry(Registry):
    """Registered names, plus `module:Class` / `module.Class` imported on first use."""

    def resolve(self, name: Any, path: str) -> None:
        if not isinstance(name, str) or name in self._components:
            return
        module, sep, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not module:
            raise ConfigError(f"{path}: {self.unknown(name)}; or module:Class for a class of your own")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{path}: cannot import {name!r} ({err})") from None
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise ConfigError(f"{path}: {name!r} is not a subclass of moep_ds.training.callbacks.Callback")
        self.register(name, getattr(cls, "Config", CallbackConfig))(cls)


CALLBACKS = CallbackRegistry("callback")


def parse_callback(value: Any, path: str) -> Any:
    """One entry of train.callbacks, as its callback's config dataclass."""
    if not isinstance(value, dict) or "type" not in value:
        raise ConfigError(f"{path}: {value!r} must be a mapping with a 'type' key (one of "
                          f"{', '.join(CALLBACKS.names())}, or module:Class)")
    CALLBACKS.resolve(value["type"], f"{path}.type")
    return parse_dataclass(CALLBACKS.config_class(value["type"]), value, path)


def build_callback(cfg: Any) -> Callback:
    CALLBACKS.resolve(cfg.type, "train.callbacks")
    cls = CALLBACKS.get(cfg.type)
    return cls(cfg) if hasattr(cls, "Config") else cls()
