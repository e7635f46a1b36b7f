"""The run's state in a checkpoint besides the tensors (`trainer_state.json` beside the weights): each part's
`state_dict` under its own name, typed, versioned, written and read here only (`write`, `read`).

Version 4 (2026-12-07) keeps the parts apart, as torchtitan's CheckpointManager(states={...}) does:

    {"version": 4,
     "trainer":      {"step", "max_steps", "world_size", "expert_parallel_size", "seed", "tokenizer_sha256"},
     "train_module": {"global_steps", "global_samples", "skipped_steps", "lr_scheduler", "loss_scaler",
                      "optimizer_step", "seq_len", "tokens"},
     "data_loader":  {"epoch", "global_batch", ["offset"], "global_batch_size"},
     "callbacks":    {name: that callback's state_dict}}

Versions 1 to 3 were one flat record of the same fields (`data` for the loader's position). Version 1 is the dict
the trainer wrote before this class existed (no `version` key; `max_steps` and `global_batch_size` absent in the
oldest ones); version 2 adds `version` (and, since 2026-12-04, `seq_len` and `tokens`: training/resume_data.py);
version 3 adds `callbacks` and keeps Adam's step as `optimizer_step`. They read into the parts through one function
(`from_flat`), so everything after the read sees version 4 alone; a newer version is refused before anything is
restored. Unknown top-level keys are kept in `extra` so that a state read and written again loses nothing. A field of
the wrong type (`"step": "abc"`: an edited or corrupted file that still parses) makes the checkpoint damaged, as a
truncated file does: `--resume auto` skips it.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any

from moep_ds.checkpointing import sharded
from moep_ds.checkpointing.sharded import CheckpointError, DamagedCheckpoint

FILE = "trainer_state.json"

VERSION = 4

TRAINER, TRAIN_MODULE, DATA_LOADER, CALLBACKS = "trainer", "train_module", "data_loader", "callbacks"

JSONObject = dict[str, Any]

# the fields of each part that the resume reads, with their types (a part may keep more); the required ones first
FIELDS: dict[str, dict[str, Any]] = {
    TRAINER: {"step": int, "max_steps": int | None, "world_size": int | None, "expert_parallel_size": int | None,
              "seed": int | None, "tokenizer_sha256": str | None},
    TRAIN_MODULE: {"global_samples": int, "global_steps": int, "skipped_steps": int | None,
                   "lr_scheduler": JSONObject | None, "loss_scaler": JSONObject | None, "optimizer_step": int | None,
                   "seq_len": int | None, "tokens": int | None},
    DATA_LOADER: {"epoch": int, "global_batch": int, "offset": int, "global_batch_size": int | None},
}
REQUIRED = {TRAINER: ("step",), TRAIN_MODULE: ("global_samples", "global_steps"),
            DATA_LOADER: ("epoch", "global_batch")}

# versions 1-3: the same fields side by side, the loader's position as `data`
FLAT_FIELDS: dict[str, Any] = {**FIELDS[TRAINER],
                               **{k: v for k, v in FIELDS[TRAIN_MODULE].items() if k != "global_steps"},
                               "skipped_steps": int, "data": JSONObject, "global_batch_size": int | None,
                               CALLBACKS: dict[str, JSONObject]}


@dataclasses.dataclass
class TrainerState:
    """Each part's state under its name (module docstring); the accessors name what the checks before a resume read."""

    trainer: JSONObject
    train_module: JSONObject
    data_loader: JSONObject
    callbacks: dict[str, JSONObject] = dataclasses.field(default_factory=dict)
    extra: JSONObject = dataclasses.field(default_factory=dict)

    step = property(lambda self: self.trainer["step"])
    max_steps = property(lambda self: self.trainer.get("max_steps"))
    world_size = property(lambda self: self.trainer.get("world_size"))
    seed = property(lambda self: self.trainer.get("seed"))
    tokenizer_sha256 = property(lambda self: self.trainer.get("tokenizer_sha256"))
    global_samples = property(lambda self: self.train_module["global_samples"])
    seq_len = property(lambda self: self.train_module.get("seq_len"))
    tokens = property(lambda self: self.train_module.get("tokens"))
    global_batch_size = property(lambda self: self.data_loader.get("global_batch_size"))  # its position counts in it

    @classmethod
    def of(cls, parts: Mapping[str, Any]) -> TrainerState:
        """The state of `parts` (name -> an object with `state_dict`) as a checkpoint keeps it."""
        return cls.from_state_dict({"version": VERSION, **{name: part.state_dict() for name, part in parts.items()}},
                                   "the state to save")

    def parts(self) -> dict[str, JSONObject]:
        return {TRAINER: self.trainer, TRAIN_MODULE: self.train_module, DATA_LOADER: self.data_loader,
                CALLBACKS: self.callbacks}

    def state_dict(self) -> JSONObject:
        return {"version": VERSION, **self.parts(), **self.extra}

    @classmethod
    def from_state_dict(cls, state: Any, where: str = "the checkpoint") -> TrainerState:
        """The state `state` (a checkpoint's FILE as read, any version; `where`: the checkpoint, for the errors)."""
        if not isinstance(state, dict):
            raise DamagedCheckpoint(f"{where}: trainer state is not a mapping ({type(state).__name__})")
        version = state.get("version", 1)
        if not conforms(version, int):
            raise damaged(where, "version", version, "an integer")
        if version not in range(1, VERSION + 1):
            raise CheckpointError(f"{where}: trainer state version {version!r} is newer than this moep_ds reads "
                                  f"(1 to {VERSION})")
        if version < 4:
            state = from_flat(state, where)
        for part, fields in FIELDS.items():
            check_part(state.get(part), part, fields, where)
        callbacks = state.get(CALLBACKS) or {}
        if not conforms(callbacks, dict[str, JSONObject]):
            raise damaged(where, CALLBACKS, callbacks, "an object of objects")
        extra = {k: v for k, v in state.items() if k not in (*FIELDS, CALLBACKS, "version")}
        return cls(trainer=state[TRAINER], train_module=state[TRAIN_MODULE], data_loader=state[DATA_LOADER],
                   callbacks=callbacks, extra=extra)


def from_flat(state: JSONObject, where: str) -> JSONObject:
    """A version 1-3 record as the version 4 parts (the one conversion of the old layout). Its fields' types are
    checked under their flat names; the data position counts in the saved global batch, or (before 2026-12-03,
    when it was not saved) the engine's sample count over its steps, a constant global batch then."""
    for key, value in state.items():
        if key in FLAT_FIELDS and not conforms(value, FLAT_FIELDS[key]):
            if value is None and key in ("skipped_steps", CALLBACKS):
                continue  # null reads as the default (0, {})
            raise damaged(where, key, value, type_text(FLAT_FIELDS[key]))
    missing = [k for k in ("step", "global_samples", "data") if k not in state]
    if missing:
        raise DamagedCheckpoint(f"{where}: trainer state lacks {', '.join(missing)}")
    step, samples, batch = state["step"], state["global_samples"], state.get("global_batch_size")
    if not batch:
        batch = samples // step if step and samples % step == 0 else None
    module = {k: state[k] for k in FIELDS[TRAIN_MODULE] if k in state}
    known = {*FLAT_FIELDS, "version"}
    return {TRAINER: {k: state[k] for k in FIELDS[TRAINER] if k in state},
            TRAIN_MODULE: {**module, "global_steps": step, "skipped_steps": state.get("skipped_steps") or 0},
            DATA_LOADER: {**state["data"], "global_batch_size": batch}, CALLBACKS: state.get(CALLBACKS) or {},
            **{k: v for k, v in state.items() if k not in known}}


def check_part(part: Any, name: str, fields: dict[str, Any], where: str) -> None:
    """DamagedCheckpoint unless part `name` is a mapping with its required fields and the types of FIELDS."""
    if not isinstance(part, dict):
        raise damaged(where, name, part, "an object")
    for key, value in part.items():
        if key in fields and not conforms(value, fields[key]):
            raise damaged(where, f"{name}.{key}", value, type_text(fields[key]))
    missing = [f"{name}.{k}" for k in REQUIRED[name] if k not in part]
    if missing:
        raise DamagedCheckpoint(f"{where}: trainer state lacks {', '.join(missing)}")


def read_bytes(ckpt: pathlib.Path) -> bytes | None:
    """The file's bytes, None where it cannot be read (`read` then names why); the resume's checksum pass verifies
    these bytes (training/checkpoint.py check_checkpoint), so that the file is opened once."""
    try:
        return (ckpt / FILE).read_bytes()
    except OSError:
        return None


def read(ckpt: pathlib.Path, data: bytes | None = None) -> TrainerState:
    """The trainer state of checkpoint `ckpt` (from its bytes `data` where read_bytes read them), parsed once: every
    check and restore of a resume takes it from here."""
    try:
        raw = json.loads(data if data is not None else (ckpt / FILE).read_bytes())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"checkpoint {str(ckpt)!r} is damaged: {str(ckpt / FILE)!r} "
                                f"({sharded.first_line(err)})") from None
    return TrainerState.from_state_dict(raw, str(ckpt))


def write(state: TrainerState, folder: pathlib.Path) -> None:
    sharded.save_json(state.state_dict(), folder / FILE)


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
