"""The trainer's callbacks: the hooks and events (base.py), the built-in callbacks (builtin.py) and those a recipe
may name in train.callbacks (downstream_eval.py)."""
from moep_ds.training.callbacks.base import (  # noqa: F401
    CALLBACKS, Callback, CallbackConfig, EndEvent, EvalEvent, LoadEvent, SaveEvent, StepEvent, build_callback,
    parse_callback,
)
from moep_ds.training.callbacks import downstream_eval  # noqa: F401 - registers downstream_eval
