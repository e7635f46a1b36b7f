"""The trainer's own state in a checkpoint (`trainer_state.json` beside the weights): typed, versioned, written and
read here only.

Version 1 is the dict the trainer wrote before this class existed (no `version` key; `max_steps` and
`global_batch_size` absent in the oldest ones); version 2 adds `version` (and, since 2026-12-04, `seq_len` and
`tokens`: training/resume_data.py); version 3 adds `callbacks` (each named callback's `state_dict`) and keeps
Adam's step as `optimizer_step` (versions 1-2 wrote it beside the rest). All
three read; a newer version is refused before anything is restored. Unknown keys are kept in `extra` so that a
state read and written again loses nothing. A field of the wrong type (`"step": "abc"`: an edited or corrupted
file that still parses) makes the checkpoint damaged, as a truncated file does: `--resume auto` skips it.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from moep_ds.checkpointing.sharded import CheckpointError, DamagedCheckpoint

FILE = "trainer_state.json"

VERSION = 3


@dataclasses.dataclass
class TrainerState:
    step: int
    global_samples: int
    data: dict[str, Any]
    max_steps: int | None = None
    skipped_steps: int = 0
    global_batch_size: int | None = None
    lr_scheduler: dict[str, Any] | None = None
    loss_scaler: dict[str, Any] | None = None
    optimizer_step: int | None = None
    world_size: int | None = None
    expert_parallel_size: int | None = None
    seed: int | None = None
    tokenizer_sha256: str | None = None
    seq_len: int | None = None  # data.seq_len (since 2026-12-04, as tokens)
    tokens: int | None = None  # tokens read up to `step` (training/resume_data.py)
    callbacks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {"version": VERSION, **fields, **self.extra}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], where: str = "the checkpoint") -> TrainerState:
        """The state `state` (a checkpoint's FILE as read; `where`: the checkpoint, for the errors)."""
        check_fields(state, where)
        version = state.get("version", 1)
        if version not in range(1, VERSION + 1):
            raise CheckpointError(f"{where}: trainer state version {version!r} is newer than this moep_ds reads "
                                  f"(1 to {VERSION})")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [k for k in ("step", "global_samples", "data") if k not in state]
        if missing:
            raise DamagedCheckpoint(f"{where}: trainer state lacks {', '.join(missing)}")
        known = {k: v for k, v in state.items() if k in names}
        if known.get("skipped_steps") is None:
            known["skipped_steps"] = 0
        if known.get("callbacks") is None:
            known["callbacks"] = {}
        extra = {k: v for k, v in state.items() if k not in names and k != "version"}
        return cls(**known, extra=extra)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        other = self.from_state_dict(state)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(other, f.name))


def check_fields(state: Any, where: str = "the checkpoint") -> None:
    """DamagedCheckpoint unless `state` is a mapping whose version and known fields have their types (the dataclass
    annotations); fields left out are not checked here (TrainerState.from_state_dict names the required ones)."""
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{where}: trainer state is not a mapping ({type(state).__name__})")
    hints = {"version": int, **typing.get_type_hints(TrainerState)}
    for key, value in state.items():
        if key in hints and key != "extra" and not conforms(value, hints[key]):
            if value is None and key in ("skipped_steps", "callbacks"):
                continue  # null reads as the default (0, {})
            raise damaged(where, key, value, type_text(hints[key]))


def damaged(where: str, key: str, value: Any, expected: str) -> DamagedCheckpoint:
    head = f"checkpoint {where!r}" if where != "the checkpoint" else where
    path = f"{where}/{FILE}" if where != "the checkpoint" else FILE
    return DamagedCheckpoint(f"{head} is damaged: {path!r} field {key} ({shown(value)}) must be {expected}")


def shown(value: Any) -> str:
    """As the file has it (JSON), cut to 60 characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def conforms(value: Any, hint: Any) -> bool:
    """Whether JSON data `value` has the annotated type `hint` (int, str, None, Any, unions and dict[K, V] of them;
    a bool is not an int here, though Python counts it as one)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        return isinstance(value, dict) and all(conforms(k, key_hint) and conforms(v, value_hint)
                                               for k, v in value.items())
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_text(hint: Any) -> str:
    """`int | None` -> "an integer or null", as the JSON file would spell it."""
    names = {int: "an integer", str: "a string", type(None): "null"}
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return " or ".join(names.get(a) or ("an object of objects" if typing.get_args(a)[1] is not Any else "an object")
                       for a in args)
