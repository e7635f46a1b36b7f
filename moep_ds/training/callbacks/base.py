"""The trainer's hooks: a `Callback` with no-op methods, the typed events they receive, and the registry of the
names a recipe may give.

A run's callbacks are named: the built-in ones (training/callbacks/builtin.py: router_thresholds, lifecycle,
monitoring, checkpointing, validation, stop), the recipe's `train.callbacks` (a mapping name -> config; a built-in
name replaces that callback, `null` removes it) and those given to the Trainer. They run in order of `priority`
(higher first; at_end in reverse), the order given breaking ties (built-in, recipe, Trainer's). Each callback gets
its own config, never the recipe: builtin.py `callback_configs` is the one place the recipe's fields
(train.log_every, train.checkpoint.every_minutes, ...) map into the built-in callbacks' configs.

Hooks, in the order the trainer calls them in one step (training/trainer.py):
  before_step(StepEvent)           before the step's micro-batches
  after_optimizer_step(StepEvent)  after the step's one all-reduce (losses, balancing counts, every callback's
                                   `flags`) and the loss-free balancing update; a callback may append to
                                   `event.events`
  after_step(StepEvent)            logging, then checkpointing (on_save), then evaluation (on_evaluation)
  on_save(SaveEvent)               a checkpoint was written (or started, when saving asynchronously)
  on_evaluation(EvalEvent)         an evaluation produced metrics (validation loss, downstream accuracies)
  on_stop(StepEvent)               the run stops early on request (signal, STOP file, exit_at_step), or at a
                                   non-finite step (event.nonfinite), whose only hook this is: nothing of that step
                                   is kept, and the run then fails (at_end still runs, then on_error)
  at_end(EndEvent)                 after the last step, on every rank
  on_error(ErrorEvent)             the loop failed (the error is raised again once every callback has seen it)
and once, before the first step, `setup()` (the trainer and its parts exist) and, when the run resumed from a
checkpoint, on_load(LoadEvent) after `load_state_dict` gave each callback the state its `state_dict` saved.
Every rank calls every hook: a callback that runs a collective runs it on all ranks alike.

State a callback keeps across a resume (`state_dict`) is updated in after_optimizer_step: every callback's
after_optimizer_step runs before the step's checkpoint (saved in the checkpointing callback's after_step), so the
checkpoint of step N holds what the callbacks knew at the end of step N (as the trainer's loss-free balancing and
lifecycle state); what after_step, on_evaluation and on_save change after that is in the next checkpoint.

`flags()` are this rank's requests for the step: they travel in the step's one all-reduce, and `event.flags` holds
each flag set on any rank. `stop` ends the run after the step (with a checkpoint); any callback may set it.

A recipe's `type` is a registered name (`CALLBACKS.names()`), or `module:Class` / `module.Class`, which imports
the user's own Python module (on PYTHONPATH) to find the class. A class's options are its `Config` dataclass
(one with a `type: str` field), parsed strictly; without one, `type` is the only key.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from moep_ds.registry import Registry
from moep_ds.schema import ConfigError, parse_dataclass
from moep_ds.train_config import callback_entries


@dataclasses.dataclass
class StepEvent:
    step: int  # the step just taken (before_step: the step about to be taken)
    losses: dict[str, Any] = dataclasses.field(default_factory=dict)  # averaged over ranks, on the device
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # this rank's routing statistics
    stop: bool = False  # the run stops after this step
    flags: dict[str, bool] = dataclasses.field(default_factory=dict)  # the callbacks' flags, set on any rank
    started: float = 0.0  # time.time() at the step's start
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # discrete events (lifecycle)
    nonfinite: str | None = None  # what was not finite in the step on any rank ("loss (nan on rank 1)"): a failure


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


@dataclasses.dataclass
class ErrorEvent:
    step: int  # the last step completed
    error: BaseException


class Callback:
    """Subclass and override the hooks you need; `self.trainer` is set when the trainer takes the callback, then
    `setup()` runs."""

    trainer: Any  # the Trainer (training/trainer.py), not imported here: the trainer imports its callbacks
    priority: int = 0  # higher runs earlier; the built-in ones run before a callback of priority 0

    def setup(self) -> None:
        pass

    def flags(self) -> dict[str, bool]:
        """This rank's requests for the step just trained (e.g. {"stop": True}), OR-ed over the ranks."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What this callback keeps across a resume (JSON-serialisable), saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

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

    def on_error(self, event: ErrorEvent) -> None:
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
    """One entry of train.callbacks, as its callback's config dataclass (one already parsed is kept)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "type"):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict) or "type" not in value:
        raise ConfigError(f"{path}: {value!r} must be a mapping with a 'type' key (one of "
                          f"{', '.join(CALLBACKS.names())}, or module:Class)")
    CALLBACKS.resolve(value["type"], f"{path}.type")
    return parse_dataclass(CALLBACKS.config_class(value["type"]), value, path)


def parse_callbacks(value: Any, path: str) -> dict[str, Any]:
    """train.callbacks as {name: config dataclass, or None to remove the built-in callback of that name}: the
    entries as the recipe reads them (train_config.callback_entries: the mapping form, or the list form named by
    type), each parsed into its callback's Config. Resolving a type imports its module (a user's own for
    module:Class): build_trainer does it, before anything is built; reading a recipe does not."""
    return {name: None if entry is None else parse_callback(entry, f"{path}.{name}")
            for name, entry in callback_entries(value, path).items()}


def build_callback(cfg: Any) -> Callback:
    CALLBACKS.resolve(cfg.type, "train.callbacks")
    cls = CALLBACKS.get(cfg.type)
    return cls(cfg) if hasattr(cls, "Config") else cls()


def ordered(callbacks: dict[str, Callback]) -> list[tuple[str, Callback]]:
    """(name, callback) by priority, higher first; the order given breaks ties."""
    return sorted(callbacks.items(), key=lambda item: -item[1].priority)
