"""The trainer's callbacks: the hooks and events (base.py), the built-in callbacks (builtin.py) and those a recipe
may name in train.callbacks (downstream_eval.py). Importing this package registers all of them."""
from moep_ds.training.callbacks.base import (  # noqa: F401
    CALLBACKS, Callback, CallbackConfig, EndEvent, ErrorEvent, EvalEvent, LoadEvent, SaveEvent, StepEvent,
    build_callback, ordered, parse_callback, parse_callbacks,
)
from moep_ds.training.callbacks import builtin, downstream_eval  # noqa: F401 - registers their names
