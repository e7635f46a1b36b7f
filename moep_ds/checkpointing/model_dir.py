"""Model directories: the recipe + tokenizer + weights layout that checkpoints, imports and evaluation share.

A model directory is a sharded checkpoint (checkpointing/sharded.py) beside the files that make it loadable alone:

    DIR/.metadata, __<r>_0.distcp  the weights (fp32), buffers and extra state, in DCP (model only, or a training
                                   checkpoint's, whose optimizer state these loaders never read)
    DIR/config.yaml                the full recipe (`dump_config(cfg)`)
    DIR/tokenizer.json             (+ tokenizer_config.json, special_tokens_map.json) when the run had a tokenizer
    DIR/meta.json                  {"step": int, "tokens": int, ...}; an imported model's also the source's
                                   special tokens: "special_tokens" (config.json's bos / eos / pad ids) and
                                   "generation_config" (its generation_config.json), which the native export writes

A run directory (`train.output_dir`) holds `checkpoints/step_<N>/` (checkpointing/layout.py: a checkpoint
counts once it contains the empty file `COMPLETE`); `load_model_dir(run_dir)` takes the newest complete one.
A consolidated directory (model.safetensors: the format of before 2026-12-03, `moep-export`'s output) is not
loaded: the loaders name `moep-convert` (checkpointing/convert.py), which turns it into this format once.
`moep-export` still writes one (evaluation/export.py) for readers outside moep_ds.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from moep_ds.checkpointing import layout, manifest, model_state, sharded
from moep_ds.checkpointing.model_state import load_module
from moep_ds.checkpointing.streaming import TensorEntry, sharded_entries
from moep_ds.errors import UserError
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.schema import ConfigError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
EXTRA_FILE = "extra_state.pt"  # non-tensor module state of a consolidated directory
COMPLETE_MARKER = layout.COMPLETE
TIED_HEAD_KEY = "head.weight"
SPECIAL_TOKENS = "special_tokens"  # meta.json: a source's {"bos_token_id", "eos_token_id", "pad_token_id"}
GENERATION_CONFIG = "generation_config"  # meta.json: a source's generation_config.json, as published
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def is_consolidated(path: Path) -> bool:
    """A directory of a consolidated format (model.safetensors, not a sharded checkpoint): moep-convert's input."""
    return (path / WEIGHTS_FILE).is_file() and not sharded.is_sharded(path)


def convert_hint(path: Path) -> str:
    """The one line a loader gives for a consolidated directory."""
    return (f"{str(path)!r} is a consolidated checkpoint ({WEIGHTS_FILE}), a format moep_ds no longer loads: "
            f"run moep-convert {path} --out DST once and use DST")


def save_model_dir(
    model: torch.nn.Module,
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (a CausalLM held whole by this one process), its recipe `cfg` (root Config), the tokenizer
    files and `meta` to the new directory `out_dir`, as a sharded checkpoint of the model alone
    (`model_state.save_module`); it appears all at once (written to a temporary sibling, then renamed)."""
    with layout.atomic_dir(out_dir) as tmp:
        model_state.save_module(model, tmp)
        write_recipe_files(cfg, tmp, tokenizer_dir, meta)
    return Path(out_dir)


def stored_weights(model_dir: Path, cfg: Any, prefix: str = "") -> tuple[list[TensorEntry], dict[str, Any]]:
    """The weights of a sharded checkpoint, each read only when it is written (stored as `prefix + name`), after
    checking them against the model its recipe builds (on the meta device); and the non-tensor state. Nothing
    here holds more than one tensor."""
    from moep_ds.models.causal_lm import build_model

    with torch.device("meta"):
        shapes = model_state.shapes(build_model(cfg.model))
    f = model_dir / model_state.EXTRA_STATE_FILE
    return sharded_entries(model_dir, shapes, prefix), json.loads(f.read_text()) if f.is_file() else {}


def write_recipe_files(cfg: Any, out: Path, tokenizer_dir: str | os.PathLike | None, meta: dict | None) -> None:
    """config.yaml, meta.json and the tokenizer files: what makes a weights directory loadable on its own."""
    from moep_ds.recipe_yaml import dump_yaml
    from moep_ds.schema import to_dict

    (out / CONFIG_FILE).write_text(dump_yaml(cfg.raw if isinstance(cfg, StoredRecipe) else to_dict(cfg)),
                                   encoding="utf-8")
    (out / META_FILE).write_text(json.dumps(meta or {}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer_dir is not None:
        from moep_ds.data.tokenizer import copy_tokenizer

        copy_tokenizer(tokenizer_dir, out)
        for f in out.iterdir():
            if f.is_file():
                layout.apply_umask(f)


def read_meta(model_dir: Path) -> dict[str, Any]:
    f = model_dir / META_FILE
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{f} is not valid JSON: {err}") from None


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model directory (a sharded checkpoint) itself, or the newest complete checkpoint of a run directory;
    a consolidated one is refused in one line naming moep-convert."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        raise UserError(f"checkpoint {str(p)!r} is not a directory (expected a model or run directory)")
    if not sharded.is_sharded(p):
        newest = layout.newest_checkpoint(p)
        if is_consolidated(p) or (newest is not None and is_consolidated(newest)):
            raise UserError(convert_hint(p if is_consolidated(p) else newest))
        if newest is None:
            raise UserError(
                f"{str(p)!r} is neither a model directory (no {sharded.METADATA_FILE}) nor a run directory with a "
                f"complete checkpoint (checkpoints/step_<N>/ holding {COMPLETE_MARKER})")
        log.info("using checkpoint %s (step %s) of run %s", newest.name, read_meta(newest).get("step"), p)
        p = newest
    if not (p / CONFIG_FILE).is_file():
        raise UserError(f"checkpoint {str(p)!r} has no {CONFIG_FILE}")
    return p


@dataclasses.dataclass
class StoredRecipe:
    """A stored recipe as the floors below the root recipe read it: the plain data (overrides applied) and its model
    section, parsed and checked as the root would (moep_ds.config parses the whole: `config_from_dict(raw)`)."""

    raw: dict[str, Any]
    model: Any  # models.config.ModelConfig

    @classmethod
    def parse(cls, raw: dict[str, Any], overrides: list[str] | None = None) -> StoredRecipe:
        import moep_ds.components  # noqa: F401 - fills the registries
        from moep_ds.models.config import ModelConfig
        from moep_ds.models.plan import check_routed_layout
        from moep_ds.recipe_yaml import apply_override
        from moep_ds.schema import PositiveInt, parse

        raw = copy.deepcopy(raw)
        for override in overrides or []:
            apply_override(raw, override)
        if not isinstance(raw.get("model"), dict):
            raise ConfigError("model: required section is missing")
        model = parse(ModelConfig, raw["model"], "model")
        train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
        check_routed_layout(model, parse(PositiveInt, train.get("expert_parallel_size", 1),
                                         "train.expert_parallel_size"))
        return cls(raw, model)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> tuple[Path, StoredRecipe]:
    """(resolved model directory, its recipe with `overrides` applied), without building the model."""
    from moep_ds.recipe_yaml import read_yaml

    model_dir = resolve_model_dir(path)
    return model_dir, StoredRecipe.parse(read_yaml(model_dir / CONFIG_FILE), overrides)


def load_model_dir(path: str | os.PathLike, overrides: list[str] | None = None) -> tuple[Any, Any, Any, dict]:
    """Load a model or run directory: (model in eval mode, root Config, tokenizer or None, meta dict).

    `overrides` (`a.b=v` strings) apply to the stored recipe, e.g. a router's eval_mode. meta gets
    "model_dir", the directory actually loaded.
    """
    from moep_ds.models.causal_lm import build_model

    model_dir, cfg = load_recipe(path, overrides)
    model = build_model(cfg.model)
    load_weights(model, model_dir)
    model.eval()
    return model, cfg, *tokenizer_and_meta(model_dir)


def tokenizer_and_meta(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer of a model directory (None without tokenizer.json) and its meta.json plus "model_dir"."""
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file():
        from moep_ds.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    return tokenizer, {**read_meta(model_dir), "model_dir": str(model_dir)}


def load_weights(model: torch.nn.Module, model_dir: Path, partitions: bool = False,
                 ep: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """The weights, buffers and extra state of a sharded checkpoint into `model`. With `partitions` the model is
    built partitioned (ZeRO-3, no optimizer), with `ep` it holds expert-parallel rank ep.rank's experts: each rank
    reads what it holds only."""
    if not sharded.is_sharded(model_dir):
        raise UserError(convert_hint(model_dir) if is_consolidated(model_dir) else
                        f"checkpoint {str(model_dir)!r} has no {sharded.METADATA_FILE}")
    manifest.check(model_dir)
    load_module(model, model_dir, ep, partitions=partitions)
