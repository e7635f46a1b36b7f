"""The trainer's own state in a checkpoint (`trainer_state.json` beside the weights): typed, versioned, written and
read here only.

Version 1 is the dict the trainer wrote before this class existed (no `version` key; `max_steps` and
`global_batch_size` absent in the oldest ones); version 2 adds `version` (and, since 2026-12-04, `seq_len` and
`tokens`: training/resume_data.py); version 3 adds `callbacks` (each named callback's `state_dict`) and keeps
Adam's step as `optimizer_step` (versions 1-2 wrote it beside the rest). All
three read; a newer version is refused before anything is restored. Unknown keys are kept in `extra` so that a
state read and written again loses nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moep_ds.checkpointing.sharded import CheckpointError

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
        if not isinstance(state, dict):
            raise CheckpointError(f"{where}: trainer state is not a mapping ({type(state).__name__})")
        version = state.get("version", 1)
        if version not in range(1, VERSION + 1):
            raise CheckpointError(f"{where}: trainer state version {version!r} is newer than this moep_ds reads "
                                  f"(1 to {VERSION})")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [k for k in ("step", "global_samples", "data") if k not in state]
        if missing:
            raise CheckpointError(f"{where}: trainer state lacks {', '.join(missing)}")
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
