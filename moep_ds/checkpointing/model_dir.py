"""Model directories: the weights + recipe + tokenizer layout that checkpoints, exports and evaluation share.
(`load_model_dir` also reads the Hugging Face directories that `moep-export --hf` writes, and the sharded
checkpoints of training, checkpointing/sharded.py, whose fp32 weights it reads without the optimizer state.)

    DIR/model.safetensors   consolidated fp32 state dict, keys = CausalLM.state_dict() keys
                            (`head.weight` omitted when the embeddings are tied)
    DIR/config.yaml         the full recipe (`dump_config(cfg)`)
    DIR/tokenizer.json      (+ tokenizer_config.json, special_tokens_map.json) when the run had a tokenizer
    DIR/meta.json           {"step": int, "tokens": int, ...}
    DIR/extra_state.pt      non-tensor module state (the expert lifecycle's event log), when there is any

A run directory (`train.output_dir`) holds `checkpoints/step_<N>/` (checkpointing/layout.py: a checkpoint
counts once it contains the empty file `COMPLETE`); `load_model_dir(run_dir)` takes the newest complete one.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from moep_ds.checkpointing import layout, model_state, sharded
from moep_ds.checkpointing.model_state import load_module
from moep_ds.checkpointing.streaming import (
    TensorEntry, check_safetensors, module_entries, safetensors_entries, sharded_entries, write_safetensors,
)
from moep_ds.errors import UserError
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
EXTRA_FILE = "extra_state.pt"  # non-tensor module state, as the trainer's checkpoints keep it
COMPLETE_MARKER = layout.COMPLETE
TIED_HEAD_KEY = "head.weight"


def state_entries(model: torch.nn.Module, tie_embeddings: bool, params: dict[str, torch.Tensor] | None = None,
                  prefix: str = "") -> list[TensorEntry]:
    """Every tensor of the state dict, each copied to fp32 (floating ones) on the CPU only when it is written; the
    tied head (a second name for the embedding) is left out, since safetensors stores no aliases. `params`
    (full fp32 parameters gathered from ZeRO partitions) replace the module's copies."""
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    state.update(params or {})
    return module_entries(state, [k for k in state if not (tie_embeddings and k == TIED_HEAD_KEY)], prefix)


def save_model_dir(
    model: torch.nn.Module,
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    meta: dict[str, Any] | None = None,
    params: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` (a CausalLM), its recipe `cfg` (root Config), the tokenizer files and `meta` to `out_dir`
    (`save_weights_dir`)."""
    entries = state_entries(model, cfg.model.tie_embeddings, params)
    return save_weights_dir(entries, model_state.extra_states(model), cfg, out_dir, tokenizer_dir=tokenizer_dir,
                            meta=meta)


def save_weights_dir(
    entries: list[TensorEntry],
    extra: dict[str, Any],
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """A model directory of the weights `entries` (written one at a time), the non-tensor state `extra`, the
    recipe `cfg`, the tokenizer files and `meta`.

    A new `out_dir` appears all at once (written to a temporary sibling, then renamed). Into an existing
    directory (e.g. a checkpoint that also holds optimizer shards) each file is replaced atomically and other
    files are left alone; completeness of a checkpoint is its `COMPLETE` marker, written by the trainer.
    """
    out = Path(out_dir)
    if out.exists():
        write_model_files(entries, extra, cfg, out, tokenizer_dir, meta)
        return out
    with layout.atomic_dir(out) as tmp:
        write_model_files(entries, extra, cfg, tmp, tokenizer_dir, meta)
    return out


def write_model_files(entries: list[TensorEntry], extra: dict[str, Any], cfg, out: Path, tokenizer_dir,
                      meta) -> None:
    """Each file is written beside its final name and renamed (other files of `out` are left alone)."""

    def put(name: str, write) -> None:
        tmp = out / f".{name}.tmp"
        write(tmp)
        layout.apply_umask(tmp)
        os.replace(tmp, out / name)

    put(WEIGHTS_FILE, lambda f: write_safetensors(f, entries, metadata={"format": "pt"}))
    if extra:  # e.g. the expert lifecycle's event log
        put(EXTRA_FILE, lambda f: torch.save(extra, f))
    write_recipe_files(cfg, out, tokenizer_dir, meta)


def stored_weights(model_dir: Path, cfg: Any, prefix: str = "") -> tuple[list[TensorEntry], dict[str, Any]]:
    """The weights of a model directory or sharded checkpoint, each read only when it is written (stored as
    `prefix + name`), after checking them against the model its recipe builds (on the meta device); and the
    non-tensor state. Nothing here holds more than one tensor."""
    from moep_ds.models.causal_lm import build_model

    with torch.device("meta"):
        shapes = model_state.shapes(build_model(cfg.model))
    if sharded.is_sharded(model_dir):
        f = model_dir / model_state.EXTRA_STATE_FILE
        return sharded_entries(model_dir, shapes, prefix), json.loads(f.read_text()) if f.is_file() else {}
    entries = safetensors_entries(model_dir / WEIGHTS_FILE, shapes, weights_key_prefix(model_dir), prefix)
    return entries, stored_extra_state(model_dir)


def weights_key_prefix(model_dir: Path) -> str:
    """What names a tensor in model.safetensors before its moep_ds key: "model." in a Hugging Face export."""
    return "model." if hf_export_recipe(model_dir) is not None else ""


def stored_extra_state(model_dir: Path) -> dict[str, Any]:
    """The non-tensor module state of a model directory (the expert lifecycle's event log), {} without any."""
    f = model_dir / EXTRA_FILE
    return torch.load(f, weights_only=True) if f.is_file() else {}


def write_recipe_files(cfg: Any, out: Path, tokenizer_dir: str | os.PathLike | None, meta: dict | None) -> None:
    """config.yaml, meta.json and the tokenizer files: what makes a weights directory loadable on its own."""
    from moep_ds.config import dump_config

    (out / CONFIG_FILE).write_text(dump_config(cfg), encoding="utf-8")
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
    """A model directory (consolidated or sharded) itself, or the newest complete checkpoint of a run directory."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        raise UserError(f"checkpoint {str(p)!r} is not a directory (expected a model or run directory)")
    if (p / WEIGHTS_FILE).is_file():
        if not (p / CONFIG_FILE).is_file() and hf_export_recipe(p) is None:
            raise UserError(f"model directory {str(p)!r} has {WEIGHTS_FILE} but no {CONFIG_FILE}")
        return p
    if sharded.is_sharded(p):
        if not (p / CONFIG_FILE).is_file():
            raise UserError(f"checkpoint {str(p)!r} has no {CONFIG_FILE}")
        return p
    newest = layout.newest_checkpoint(p)
    if newest is None:
        raise UserError(
            f"{str(p)!r} is neither a model directory (no {WEIGHTS_FILE}) nor a run directory with a complete "
            f"checkpoint (checkpoints/step_<N>/ holding {COMPLETE_MARKER})"
        )
    log.info("using checkpoint %s (step %s) of run %s", newest.name, read_meta(newest).get("step"), p)
    return newest


def load_state_dict_into(model: torch.nn.Module, state: dict[str, torch.Tensor], tied: bool, source: Path) -> None:
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        detail = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise UserError(f"{source} does not match the model built from its config.yaml: {detail}") from None
    # extra state (event logs) is history, not needed to run the model
    missing = [k for k in missing if not (tied and k == TIED_HEAD_KEY) and not k.endswith("._extra_state")]
    if missing or unexpected:
        raise UserError(
            f"{source} does not match the model built from its config.yaml: missing {missing[:5]} "
            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )


def hf_export_recipe(model_dir: Path) -> dict[str, Any] | None:
    """The recipe of a `moep-export --hf` directory (its config.json keeps the model section), else None."""
    f = model_dir / "config.json"
    if (model_dir / CONFIG_FILE).is_file() or not f.is_file():
        return None
    try:
        hf = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # a damaged export, not "no config.yaml"
        raise UserError(f"{str(f)!r} is not valid JSON: {err}") from None
    return {"model": hf["moep_model"]} if isinstance(hf, dict) and "moep_model" in hf else None


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> tuple[Path, Any]:
    """(resolved model directory, its recipe with `overrides` applied), without building the model.

    A Hugging Face export directory works too: its recipe is the model section kept in config.json."""
    from moep_ds.config import config_from_dict, read_yaml

    model_dir = resolve_model_dir(path)
    raw = hf_export_recipe(model_dir) or read_yaml(model_dir / CONFIG_FILE)
    return model_dir, config_from_dict(raw, overrides)


def load_model_dir(path: str | os.PathLike, overrides: list[str] | None = None) -> tuple[Any, Any, Any, dict]:
    """Load a model or run directory: (model in eval mode, root Config, tokenizer or None, meta dict).

    `overrides` (`a.b=v` strings) apply to the stored recipe, e.g. a router's eval_mode. meta gets
    "model_dir", the directory actually loaded.
    """
    from moep_ds.models.causal_lm import build_model

    model_dir, cfg = load_recipe(path, overrides)
    model = build_model(cfg.model)
    load_weights(model, model_dir, cfg)
    model.eval()
    return model, cfg, *tokenizer_and_meta(model_dir)


def tokenizer_and_meta(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer of a model directory (None without tokenizer.json) and its meta.json plus "model_dir"."""
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file():
        from moep_ds.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    return tokenizer, {**read_meta(model_dir), "model_dir": str(model_dir)}


def load_weights(model: torch.nn.Module, model_dir: Path, cfg: Any, partitions: bool = False,
                 ep: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """The weights, buffers and extra state of a model directory or sharded checkpoint into `model`. With
    `partitions` the model is built partitioned (ZeRO-3, no optimizer), with `ep` it holds expert-parallel rank
    ep.rank's experts: each rank reads what it holds only."""
    if sharded.is_sharded(model_dir):
        sharded.check_files(model_dir)
        load_module(model, model_dir, ep, partitions=partitions)
    elif partitions or ep.size > 1:
        load_consolidated_pieces(model, model_dir, ep)
    else:
        load_consolidated(model, model_dir, cfg)


def load_consolidated(model: torch.nn.Module, model_dir: Path, cfg: Any) -> None:
    from safetensors.torch import load_file

    try:
        state: dict[str, Any] = load_file(str(model_dir / WEIGHTS_FILE))
    except Exception as err:  # noqa: BLE001 - a truncated or unreadable file (safetensors' own errors)
        raise damaged_weights(model_dir, err) from None
    state.update(stored_extra_state(model_dir))
    if key_prefix := weights_key_prefix(model_dir):
        state = {k.removeprefix(key_prefix): v for k, v in state.items()}
    load_state_dict_into(model, state, cfg.model.tie_embeddings, model_dir / WEIGHTS_FILE)


def load_consolidated_pieces(model: torch.nn.Module, model_dir: Path,
                             ep: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """`load_consolidated` for a model that holds parts of its tensors (ZeRO-3 partitions, expert-parallel rank
    ep.rank's experts): each piece (`model_state.module_pieces`) is read alone, as the rows of the stored tensor
    that hold it."""
    from safetensors import safe_open

    file, key_prefix = model_dir / WEIGHTS_FILE, weights_key_prefix(model_dir)
    try:
        check_safetensors(file, model_state.shapes(model, ep), key_prefix)
        with safe_open(str(file), framework="pt") as f, torch.no_grad():
            for key, piece in model_state.module_pieces(model, ep, partitions=True).items():
                name = key_prefix + key.removeprefix(sharded.MODEL_PREFIX)
                piece.local.copy_(read_flat_range(f, name, piece.offset, piece.local.numel()))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing, truncated or unreadable file (safetensors' own errors)
        raise damaged_weights(model_dir, err) from None
    model.load_state_dict(stored_extra_state(model_dir), strict=False)


def damaged_weights(model_dir: Path, err: BaseException) -> sharded.DamagedCheckpoint:
    """One line for a model.safetensors that cannot be read (safetensors' own errors name no file)."""
    file = model_dir / WEIGHTS_FILE
    return sharded.DamagedCheckpoint(
        f"model directory {str(model_dir)!r} is damaged: {str(file)!r} could not be read: {sharded.first_line(err)}"
    )


def read_flat_range(f: Any, key: str, offset: int, numel: int) -> torch.Tensor:
    """Elements [offset, offset + numel) of the flattened tensor `key` of an open safetensors file, reading only
    the rows (first-dimension slices) that hold them."""
    part = f.get_slice(key)
    shape = part.get_shape()
    if len(shape) < 2:
        return f.get_tensor(key).reshape(-1)[offset:offset + numel]
    row = math.prod(shape[1:])
    first, end = offset // row, -(-(offset + numel) // row)
    start = offset - first * row
    return part[first:end].reshape(-1)[start:start + numel]


def routing_eval_modes(model: torch.nn.Module) -> dict[str, str]:
    """{module name: eval_mode} of every router that has one (expert choice: threshold | topk).

    Recorded with every evaluation result: expert-choice numbers depend on it.
    """
    modes = {}
    for name, module in model.named_modules():
        mode = getattr(getattr(module, "cfg", None), "eval_mode", None)
        if isinstance(mode, str):
            modes[name] = mode
    return modes


def summarize_routing_modes(modes: dict[str, str]) -> str:
    """One word for tables: 'threshold', 'topk', 'mixed' or 'none' (no expert-choice router)."""
    kinds = sorted(set(modes.values()))
    return kinds[0] if len(kinds) == 1 else ("none" if not kinds else "mixed")
