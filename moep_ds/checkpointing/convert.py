"""`moep-convert`: a consolidated checkpoint, turned once into the sharded format that moep_ds loads.

The consolidated formats (model.safetensors holding every tensor whole; no longer loaded, each loader names this
command instead):

    model directory         model.safetensors (keys = state_dict() keys, a tied head left out), config.yaml,
                            extra_state.pt (non-tensor module state), meta.json, tokenizer files
    training checkpoint     the same + optimizer.pt ({"moments": {name: {exp_avg, exp_avg_sq}}, "step": Adam's
                            step}), trainer_state.json, rng_rank{r}.pt, COMPLETE (written before 2026-12-03)
    Hugging Face export     `moep-export --hf`: model.safetensors with keys model.<key>, the recipe's model section
                            in config.json (`moep_model`), no config.yaml

The sharded checkpoint written (checkpointing/sharded.py) holds every tensor whole, in its true shape, under its
canonical name, the Adam moments under optim/<name>/<key>, the tied head as an alias; trainer_state.json gets
Adam's step as `optimizer_step`. A converted training checkpoint therefore resumes (`--resume DST`) on any number
of processes, expert-parallel size or ZeRO stage, as any sharded one does. The tensors are checked against the
model the recipe builds (on the meta device) before anything is written, and DST appears whole or not at all.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from moep_ds.checkpointing import layout, manifest, model_state, sharded
from moep_ds.checkpointing.model_dir import (
    CONFIG_FILE, EXTRA_FILE, WEIGHTS_FILE, read_meta, write_recipe_files,
)
from moep_ds.checkpointing.sharded import MODEL_PREFIX, OPTIM_PREFIX, CheckpointError
from moep_ds.checkpointing.streaming import check_safetensors
from moep_ds.errors import UserError

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"
HF_KEY_PREFIX = "model."  # what names a tensor in a Hugging Face export before its moep_ds key
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# files a converted directory takes over as they are (the tokenizer's; rng_rank{r}.pt are matched apart)
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_model_section(path: Path) -> dict[str, Any] | None:
    """The recipe's model section kept in a `moep-export --hf` directory's config.json, else None."""
    f = path / "config.json"
    if (path / CONFIG_FILE).is_file() or not f.is_file():
        return None
    try:
        hf = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{str(f)!r} is not valid JSON: {err}") from None
    return hf["moep_model"] if isinstance(hf, dict) and "moep_model" in hf else None


def source_recipe(src: Path) -> tuple[Any, str]:
    """(the recipe of consolidated `src`, the key prefix of its weights)."""
    from moep_ds.checkpointing.model_dir import StoredRecipe
    from moep_ds.recipe_yaml import read_yaml

    model_section = hf_model_section(src)
    if model_section is not None:
        return StoredRecipe.parse({"model": model_section}), HF_KEY_PREFIX
    if not (src / CONFIG_FILE).is_file():
        raise UserError(f"{str(src)!r} has {WEIGHTS_FILE} but no {CONFIG_FILE} (nor a moep_ds export's config.json)")
    return StoredRecipe.parse(read_yaml(src / CONFIG_FILE)), ""


def check_source(src: Path) -> None:
    if not src.is_dir():
        raise UserError(f"SRC {str(src)!r} is not a directory" if src.exists() else f"SRC {str(src)!r} does not exist")
    if sharded.is_sharded(src):
        raise UserError(f"SRC {str(src)!r} is a sharded checkpoint already: nothing to convert")
    if not (src / WEIGHTS_FILE).is_file():
        raise UserError(f"SRC {str(src)!r} holds no {WEIGHTS_FILE}: not a consolidated checkpoint (a run directory? "
                        "convert each checkpoints/step_<N>/ that needs it)")


def read_weights(file: Path, shapes: dict[str, tuple[int, ...]], key_prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model (`shapes`) from model.safetensors, checked first: one line naming the first
    tensor that is missing, of another shape, or that the model lacks."""
    from safetensors import safe_open

    try:
        saved = check_safetensors(file, shapes, key_prefix)
        unknown = sorted(k for k in saved if k.removeprefix(key_prefix) not in shapes)
        if unknown:
            raise UserError(f"{file} does not match the model built from its recipe: the model lacks {unknown[:5]} "
                            f"({len(unknown)})")
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(key_prefix + name) for name in shapes}
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or unreadable file (safetensors' own errors name none)
        raise CheckpointError(f"{str(file)!r} could not be read: {sharded.first_line(err)}") from None


def read_moments(file: Path, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], int]:
    """({optim/<name>/<key>: moment}, Adam's step) from optimizer.pt (tensors only: weights_only, memory-mapped)."""
    try:
        optim = torch.load(file, weights_only=True, mmap=True)
        moments, step = optim["moments"], int(optim["step"])
    except Exception as err:  # noqa: BLE001 - not a tensor-only file, or another layout
        raise CheckpointError(f"{str(file)!r} could not be read as a consolidated optimizer state: "
                              f"{sharded.first_line(err)}") from None
    out = {}
    for name, per_key in moments.items():
        name = model_state.canonical_name(name)
        for key in ADAM_KEYS:
            t = per_key.get(key)
            if name not in shapes or not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shapes[name]):
                raise CheckpointError(f"{str(file)!r}: the {key} of {name!r} does not fit the model built from the "
                                      f"recipe ({list(shapes.get(name, ()))})")
            out[f"{OPTIM_PREFIX}{name}/{key}"] = t.contiguous()
    return out, step


def read_extra_state(src: Path) -> dict[str, Any]:
    f = src / EXTRA_FILE
    try:
        return torch.load(f, weights_only=True) if f.is_file() else {}
    except Exception as err:  # noqa: BLE001 - a pickle of objects is refused, never run
        raise CheckpointError(f"{str(f)!r} could not be read: {sharded.first_line(err)}") from None


def convert(src: str | Path, out: str | Path) -> Path:
    """Write the consolidated checkpoint `src` as a sharded checkpoint at `out` (a new directory, written beside
    it and renamed when complete: nothing half-written on failure). Returns `out`."""
    from moep_ds.models.causal_lm import build_model

    src, out = Path(src), Path(out)
    check_source(src)
    if out.exists() and not layout.is_empty_dir(out):
        raise UserError(f"--out {str(out)!r} exists and is not empty: name a new directory")
    layout.check_dir_target("--out", out)
    reason = layout.run_overlap(out.resolve(), src.resolve(), "converted")
    if reason is not None:  # as moep-export: a run directory's checkpoints are the trainer's
        raise UserError(f"--out ({str(out)!r}) {reason}: moep-convert never writes into a run directory or "
                        f"checkpoint; name a new directory outside them (then --resume DST starts a run from it)")
    cfg, key_prefix = source_recipe(src)
    with torch.device("meta"):
        meta_model = build_model(cfg.model, initialise=False)
    shapes, aliases = model_state.shapes(meta_model), model_state.tied_names(meta_model)
    state: dict[str, Any] = {MODEL_PREFIX + n: t for n, t in read_weights(src / WEIGHTS_FILE, shapes,
                                                                            key_prefix).items()}
    training = (src / OPTIMIZER_FILE).is_file()
    if training:
        moments, optimizer_step = read_moments(src / OPTIMIZER_FILE, shapes)
        state.update(moments)
        try:
            trainer_state = json.loads((src / TRAINER_STATE_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{str(src / TRAINER_STATE_FILE)!r} could not be read: "
                                  f"{sharded.first_line(err)}") from None
    extra = read_extra_state(src)
    meta = {**read_meta(src), "converted_from": str(src.resolve())}
    with layout.output_dir(out) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            sharded.dcp.save({k: sharded.whole(t) for k, t in state.items()} | extra,
                             storage_writer=sharded.writer(tmp, aliases), planner=sharded.ShardSavePlanner(),
                             no_dist=True)
        sharded.save_json(extra, tmp / model_state.EXTRA_STATE_FILE)
        write_recipe_files(cfg, tmp, None, meta)
        for f in src.iterdir():
            if f.is_file() and (f.name in COPIED or (training and f.name.startswith("rng_rank"))):
                shutil.copyfile(f, tmp / f.name)
        if training:
            sharded.save_json({**trainer_state, "optimizer_step": optimizer_step}, tmp / TRAINER_STATE_FILE)
        manifest.seal(tmp)  # checked from now on like a checkpoint training wrote
        if layout.is_complete(src):
            (tmp / layout.COMPLETE).touch()
    log.info("converted %s (%s) to the sharded checkpoint %s", src, "training checkpoint" if training else
             "model weights", out)
    return out
