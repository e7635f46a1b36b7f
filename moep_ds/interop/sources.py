"""`model.init_from` / `moep-import SRC`: the one place that turns a source into the recipe's weights.

    weights, keep, source = source_weights("hf:EleutherAI/pythia-1b@step13000", cfg.model, cfg.data.tokenizer)

SRC is resolved (hub.py), recognised as a Hugging Face folder (hf_weights.py) or a moep_ds checkpoint, run or
model directory, checked against the recipe's model (or, with `model.upcycle`, against the dense model of the
same backbone, upcycle.py), its tokenizer against the recipe's, and offered as {canonical name: Weight} covering
the model exactly; `keep` names what the recipe's own initialisation provides (an upcycled model's routers).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from moep_ds.errors import UserError
from moep_ds.interop.hub import Source, resolve
from moep_ds.interop.weights import Weight, check_shapes, checkpoint_weights

log = logging.getLogger(__name__)

def model_shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Global shapes by canonical name of the model `model_cfg` builds (on the meta device: nothing allocated)."""
    from moep_ds.checkpointing import model_state
    from moep_ds.models.causal_lm import build_model

    with torch.device("meta"):
        return model_state.shapes(build_model(model_cfg, initialise=False))


def source_weights(spec: str, model_cfg: Any, tokenizer_cfg: Any = None, what: str = "model.init_from"
                   ) -> tuple[dict[str, Weight], set[str], Source]:
    """The recipe's weights from `spec` (see the module docstring); every check fails in one line naming SRC."""
    from moep_ds.interop.hf_weights import hf_weights, is_hf_folder
    from moep_ds.interop.upcycle import dense_model_config, router_names, upcycled_weights

    source = resolve(spec, what)
    upcycle = getattr(model_cfg, "upcycle", None)
    target = dense_model_config(model_cfg) if upcycle is not None else model_cfg
    label = f"{what} ({spec!r})"
    check_config_present(source.folder, label)
    try:
        if is_hf_folder(source.folder):
            weights = hf_weights(source.folder, target, label)
            tokenizer_dir = source.folder
        else:
            weights, tokenizer_dir = moep_weights(source.folder, target, label)
    except UserError as err:
        if upcycle is None:
            raise
        raise UserError(expert_field_names(str(err), model_cfg)) from None  # the recipe's fields, not the dense's
    if tokenizer_cfg is not None:
        check_tokenizer(tokenizer_dir, tokenizer_cfg, label)
    shapes = model_shapes(model_cfg)
    keep: set[str] = set()
    if upcycle is not None:
        check_shapes(weights, model_shapes(target), set(), label)  # the dense model first: clearer names
        weights = upcycled_weights(weights, model_cfg, upcycle)
        keep = router_names(shapes, model_cfg)
    check_shapes(weights, shapes, keep, label)
    return weights, keep, source


def check_config_present(folder: Path, label: str) -> None:
    """A folder with a Hugging Face model's weights but neither its config.json nor a moep_ds recipe is named as
    such (it would otherwise look like a consolidated moep_ds checkpoint, which moep-convert cannot read either)."""
    from moep_ds.interop.hf_weights import BIN, BIN_INDEX, SAFETENSORS, SAFETENSORS_INDEX

    weights = [name for name in (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX) if (folder / name).is_file()]
    if weights and not (folder / "config.json").is_file() and not (folder / "config.yaml").is_file():
        raise UserError(f"{label}: {str(folder)!r} holds {weights[0]} but no config.json: a Hugging Face model folder "
                        "needs the config.json published beside its weights (copy or download it there)")


def expert_field_names(text: str, model_cfg: Any) -> str:
    """`text` (an error about the dense model an upcycled recipe is read as) with the FFN fields of its ffn_moe
    blocks named as the recipe names them: model.layers[i].moe.expert, not the dense block's ffn."""
    text = text.replace("model.layers[*].ffn.", "model.layers[*].moe.expert.")
    for i, layer in enumerate(model_cfg.expanded_layers()):
        if layer.type == "ffn_moe":
            text = text.replace(f"model.layers[{i}].ffn.", f"model.layers[{i}].moe.expert.")
    return text


def source_recipe(spec: str, what: str = "SRC") -> dict[str, Any]:
    """The recipe (model section and tokenizer) that reproduces the Hugging Face model `spec`, from its
    config.json alone: what moep-import writes without --config."""
    from moep_ds.data.tokenizer import TOKENIZER_FILE
    from moep_ds.interop.families import family_of
    from moep_ds.interop.hf_weights import is_hf_folder, read_config

    source = resolve(spec, what)
    if not is_hf_folder(source.folder):
        raise UserError(f"{what} ({spec!r}) is no Hugging Face model folder (config.json and weights): a moep_ds "
                        "checkpoint is imported with --config (the recipe to check it against or upcycle it into)")
    hf = read_config(source.folder)
    model = family_of(hf, f"{what} ({spec!r})").recipe(hf)
    tokenizer: dict[str, Any] = {"vocab_size": model["vocab_size"]}
    if (source.folder / TOKENIZER_FILE).is_file():  # the source's own tokenizer, for training on new text
        vocab = vocabulary(source.folder / TOKENIZER_FILE, f"{what} ({spec!r})")
        tokenizer = {"path": str(source.folder.resolve()), "vocab_size": len(vocab)}
    return {"model": model, "data": {"tokenizer": tokenizer}}


def moep_weights(folder: Path, target: Any, label: str) -> tuple[dict[str, Weight], Path]:
    """A moep_ds checkpoint (a run directory: its newest complete one) whose model equals `target`."""
    from moep_ds.checkpointing.model_dir import load_recipe

    model_dir, cfg = load_recipe(folder)
    check_same_model(cfg.model, target, label)
    return checkpoint_weights(model_dir, cfg), model_dir


def check_same_model(saved: Any, target: Any, label: str) -> None:
    """Every setting of the saved model that differs from the recipe's, one line each (interop/compare.py)."""
    from moep_ds.interop.compare import model_differences, report

    lines = model_differences(saved, target)
    if lines:
        raise UserError(f"{label} does not match the recipe's model:\n  " + report(lines))


def check_tokenizer(folder: Path, tokenizer_cfg: Any, label: str) -> None:
    """The source's tokenizer (if it has one) against the recipe's data.tokenizer: the vocabularies when the recipe
    names a tokenizer that can be read here, else the size against data.tokenizer.vocab_size."""
    from moep_ds.data.errors import DataError
    from moep_ds.data.tokenizer import TOKENIZER_FILE, tokenizer_file

    if not (folder / TOKENIZER_FILE).is_file():
        log.info("%s has no %s: the recipe's data.tokenizer is not compared with it", label, TOKENIZER_FILE)
        return
    theirs = vocabulary(folder / TOKENIZER_FILE, label)
    if tokenizer_cfg.path is not None:
        try:
            ours = vocabulary(tokenizer_file(tokenizer_cfg.path), f"data.tokenizer.path ({tokenizer_cfg.path!r})")
        except DataError as err:
            log.warning("data.tokenizer.path (%s) cannot be read here (%s): comparing the vocabulary size only",
                        tokenizer_cfg.path, err)
        else:
            if ours != theirs:
                raise UserError(f"{label}: its tokenizer ({len(theirs)} ids) differs from data.tokenizer.path "
                                f"({tokenizer_cfg.path!r}, {len(ours)} ids)")
            return
    if len(theirs) != tokenizer_cfg.vocab_size:
        raise UserError(f"{label}: its tokenizer has {len(theirs)} ids, data.tokenizer.vocab_size is "
                        f"{tokenizer_cfg.vocab_size}")


def vocabulary(file: Path, label: str) -> dict[str, int]:
    """{token: id} of a tokenizer.json, added tokens included."""
    from tokenizers import Tokenizer

    from moep_ds.data.errors import DataError

    if not file.is_file():
        raise DataError(f"{label}: no {file}")
    try:
        return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed files
        raise UserError(f"{label}: {str(file)!r} is no readable tokenizer: {str(err).splitlines()[0]}") from None


__all__ = ["check_same_model", "check_tokenizer", "model_shapes", "source_recipe", "source_weights"]
