"""The recipe's `train:` section: optimizer, schedule, length, checkpointing, logging, parallelism. It sits beside
training/ rather than in it so that the root recipe (moep_ds/config.py), above training in the import graph, reads it
without importing training code (and training, which reads it too, imports no root recipe): schema only.

The DeepSpeed JSON owns batch sizes, ZeRO stage, precision, clipping and offload. The optional
`micro_batch_size`, `global_batch_size` and `grad_clip` here let a recipe state the values it was tuned
for: they fill a DeepSpeed config that leaves them out ("auto") and must agree with one that sets them.
Activation checkpointing and compilation belong to the recipe alone (a DeepSpeed JSON with its own
`activation_checkpointing` or `compile` section is refused).
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from moep_ds.moe.all_to_all import ExpertCommConfig
from moep_ds.schema import (
    Between, ConfigError, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, fail,
)


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    lr: PositiveFloat = 3e-4
    betas: list[Annotated[float, Between(0.0, 1.0, hi_open=True)]] = dataclasses.field(
        default_factory=lambda: [0.9, 0.95]
    )
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    # parameters exempt from weight decay: "1d" = every 1-D parameter of a layer or of an expert (biases, norm scales;
    # a stacked expert parameter's rows are its experts: the experts' biases [E, F]), "embedding" = the embedding
    # tables (and a head tied to them); GPT-NeoX / Pythia decays embeddings: [1d]
    no_decay: list[Literal["1d", "embedding"]] = dataclasses.field(default_factory=lambda: ["1d", "embedding"])

    def validate(self, path: str) -> None:
        if len(self.betas) != 2:
            fail(f"{path}.betas", self.betas, "must be a list of two numbers")


@dataclasses.dataclass(kw_only=True)
class ScheduleConfig:
    # cosine / linear: warm-up, then decay over the steps after it to the floor at max_steps.
    # neox_annealing: GPT-NeoX v1.0's AnnealingLR with lr-decay-style cosine, the schedule Pythia trained with:
    # step s (0-based) runs at lr * s / warmup_steps up to s = warmup_steps, then at
    # max(min lr, lr/2 (cos(pi (min(s, max_steps - warmup_steps) - warmup_steps) / max_steps) + 1)): the cosine
    # spans max_steps from the end of warm-up, so it reaches the floor before the end (Pythia-1B: step ~115,141)
    kind: Literal["cosine", "linear", "constant", "neox_annealing"] = "cosine"
    warmup_steps: NonNegativeInt = 100
    min_lr_ratio: Annotated[float, Between(0.0, 1.0)] = 0.1  # the floor, as a fraction of the peak lr
    # a run started fresh at step N > 0 (train.start_step, a branch from a published checkpoint, with a new
    # optimizer): step N + j, j < rewarmup_steps, runs at (j + 1) / rewarmup_steps of the schedule's lr at step
    # N + rewarmup_steps (a linear ramp from 0 that reaches the schedule there); 0: the schedule's lr from step N
    rewarmup_steps: NonNegativeInt = 0


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    # every_steps, every_minutes and at_end are the built-in checkpointing callback's settings (its own config,
    # training/callbacks/builtin.py, takes them from here or from train.callbacks.checkpointing; not both)
    every_steps: PositiveInt | None = 1000
    every_minutes: PositiveFloat | None = None  # minutes of training since the last save it triggered, over resumes
    keep_last: PositiveInt = 3
    at_end: bool = True
    async_save: bool = False  # write in the background (DCP async_save); training goes on meanwhile


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    output_dir: str = "runs/default"
    seed: NonNegativeInt = 1234
    max_steps: PositiveInt | None = None  # optimizer steps; null: derived from `epochs`, which it overrides
    epochs: PositiveFloat | None = None
    exit_at_step: PositiveInt | None = None  # checkpoint and exit there (Megatron's exit-interval); schedule unchanged
    # a fresh run's first step (training/branch.py): its step counter, lr schedule and data position begin at
    # step N, as if steps 0..N-1 had run (to continue a published checkpoint of step N on the batches it would
    # have seen next); null: N of model.init_from "hf:REPO@stepN", else 0. A resumed run continues its checkpoint
    start_step: NonNegativeInt | None = None
    micro_batch_size: PositiveInt | None = None
    global_batch_size: PositiveInt | None = None
    grad_clip: PositiveFloat | None = None
    expert_parallel_size: PositiveInt = 1
    # how the expert-parallel all-to-all moves tokens (moe/all_to_all.py): `dedup` (a token crosses to a rank once)
    # on by default; each option off gives the blocking per-expert path, to compare with or to debug
    expert_comm: ExpertCommConfig = dataclasses.field(default_factory=ExpertCommConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log_every: PositiveInt = 10
    eval_every: PositiveInt | None = None
    # global batches of validation windows per evaluation (Megatron's eval_iters): the same at any number of ranks
    eval_batches: PositiveInt = 8
    peak_tflops: PositiveFloat | None = None  # per device, for the MFU estimate; null: known GPUs only
    # recompute each block's activations in backward (torch non-reentrant checkpoint; training/blocks.py)
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each block in place (Module.compile(); parameter names unchanged)
    # callbacks the trainer runs at its hooks besides the built-in ones (training/callbacks/), by name:
    # {evals: {type: downstream_eval, tasks: [...]}}; a type is a registered name or module:Class of the user's own
    # module; `validation: null` removes a built-in callback (a built-in name with a config replaces it). The list
    # form [{type: downstream_eval, ...}] names each by its type. Read here as {name: mapping or null}; each entry is
    # parsed into its callback's own config class when the trainer is built (build_trainer, before any tensor)
    callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def preprocess(cls, raw: dict[str, Any], path: str) -> dict[str, Any]:
        if "callbacks" not in raw:
            return raw
        return {**raw, "callbacks": callback_entries(raw["callbacks"], f"{path}.callbacks" if path else "callbacks")}


def callback_entries(value: Any, path: str) -> dict[str, Any]:
    """train.callbacks as {name: its mapping (`type` and options), or None to remove the built-in callback of that
    name}; the list form names each entry by its type (`type_2`, ... for a repeated one). The shape only: resolving
    a type imports its module (a user's own, for module:Class), which reading a recipe does not do
    (training/callbacks/base.py parse_callbacks parses the entries). An entry already parsed is kept."""
    if isinstance(value, list):
        named: dict[str, Any] = {}
        for i, entry in enumerate(value):
            entry = callback_entry(entry, f"{path}[{i}]")
            name, n = entry_type(entry), 1
            while name in named:
                n += 1
                name = f"{entry_type(entry)}_{n}"
            named[name] = entry
        return named
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {value!r} must be a mapping of names to callbacks ({{name: {{type: ...}}}}, "
                          "or name: null to remove a built-in one)")
    return {str(name): None if entry is None else callback_entry(entry, f"{path}.{name}")
            for name, entry in value.items()}


def callback_entry(value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "type"):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConfigError(f"{path}: {value!r} must be a mapping with a 'type' key (a callback's registered name, or "
                          "module:Class)")
    return value


def entry_type(entry: Any) -> str:
    return entry.type if dataclasses.is_dataclass(entry) else entry["type"]
