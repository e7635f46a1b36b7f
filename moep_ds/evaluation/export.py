"""`moep-export`: a checkpoint (or run) as a consolidated fp32 model directory, or as a Hugging Face directory.

    moep-export runs/x --out exports/x            model.safetensors + config.yaml + tokenizer + meta.json
    moep-export runs/x --out exports/x_hf --hf    loads with AutoModelForCausalLM.from_pretrained(
                                                  DIR, trust_remote_code=True); lm-eval --model hf reads it

The weights go from the (sharded) checkpoint to the export one tensor at a time
(checkpointing/streaming.py); the model is never built. The Hugging Face directory holds config.json (with
`auto_map` and the recipe's `model` section), model.safetensors (keys `model.<moep_ds key>`), modeling_moep.py /
configuration_moep.py, flat copies of the moep_ds model code they import (moep_ds/evaluation/vendor.py), the
tokenizer files and meta.json.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from moep_ds.errors import UserError
from moep_ds.checkpointing import layout
from moep_ds.checkpointing.model_dir import EXTRA_FILE, WEIGHTS_FILE, write_recipe_files
from moep_ds.checkpointing.streaming import TensorEntry, write_safetensors

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).resolve().parent / "hf_template"
HF_FILES = ("configuration_moep.py", "modeling_moep.py")


def write_model_files(entries: list[TensorEntry], extra: dict[str, Any], cfg, out: Path, tokenizer_dir,
                      meta) -> None:
    """A consolidated export (`moep-export` without --hf) into the new folder `out`: model.safetensors of
    `entries` (written one tensor at a time), the non-tensor state `extra`, the recipe files."""
    write_safetensors(out / WEIGHTS_FILE, entries, metadata={"format": "pt"})
    if extra:  # e.g. the expert lifecycle's event log
        torch.save(extra, out / EXTRA_FILE)
    write_recipe_files(cfg, out, tokenizer_dir, meta)


def hf_config(cfg: Any, eot_id: int | None) -> dict[str, Any]:
    from moep_ds.schema import to_dict

    model = cfg.model
    out = {
        "architectures": ["MoepForCausalLM"],
        "model_type": "moep",
        "auto_map": {
            "AutoConfig": "configuration_moep.MoepConfig",
            "AutoModelForCausalLM": "modeling_moep.MoepForCausalLM",
        },
        "moep_model": to_dict(model),
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": len(model.expanded_layers()),
        "max_position_embeddings": model.max_seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "dtype": "float32",
    }
    if eot_id is not None:
        out.update(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id)
    return out


def write_hf_dir(entries: list[TensorEntry], cfg: Any, tmp: Path, tokenizer_dir: Path | None, eot_id: int | None,
                 meta: dict[str, Any]) -> None:
    from moep_ds.evaluation.vendor import vendor_model_code

    write_safetensors(tmp / "model.safetensors", entries, metadata={"format": "pt"})  # keys model.<moep_ds key>
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, eot_id), indent=2) + "\n", encoding="utf-8")
    if eot_id is not None:
        generation = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in HF_FILES:
        shutil.copyfile(TEMPLATE_DIR / name, tmp / name)
    vendor_model_code(tmp)
    if tokenizer_dir is not None:
        from moep_ds.data.tokenizer import copy_tokenizer

        copy_tokenizer(tokenizer_dir, tmp)


def check_export_dir(out: Path, overwrite: bool) -> None:
    """Refuse an --out that cannot become the export, before any weights are read and before anything is written."""
    if out.is_symlink():  # replacing it would replace the link, not the folder it names
        raise UserError(f"--out ({str(out)!r}) is a symbolic link (to {os.readlink(out)!r}); give the folder itself")
    layout.check_dir_target("--out", out)
    holds_files = out.exists() and any(out.iterdir())
    if holds_files and not overwrite:
        raise UserError(f"export directory {str(out)!r} exists and is not empty (pass --force to replace it)")
    if holds_files and not is_model_dir(out):  # --force deletes what it replaces
        raise UserError(f"--out ({str(out)!r}) holds files but no earlier export (model.safetensors, meta.json and "
                        "a config): --force replaces only an export; give an empty or new folder")
    check_creatable(out)


def is_model_dir(path: Path) -> bool:
    """What an export (either layout) or a saved model directory holds."""
    return all((path / f).is_file() for f in ("model.safetensors", "meta.json")) and any(
        (path / f).is_file() for f in ("config.yaml", "config.json"))


def check_creatable(out: Path) -> None:
    """The export is built in a temporary sibling of `out` (layout.output_dir), or in `out` itself when that is an
    existing empty folder: probe that a folder can be made there, and remove the probe again."""
    parent = out if layout.is_empty_dir(out) else next(p for p in out.absolute().parents if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moep-export-probe-", dir=parent))
    except OSError as err:
        raise UserError(f"--out ({str(out)!r}) cannot be written in {parent}: {err.strerror or err}") from None


def check_outside_runs(out: Path, source: Path) -> None:
    """An export replaces --out as a whole (--force): it must not be or hold the checkpoint it reads, nor lie in
    a run directory, which the trainer owns."""
    reason = layout.run_overlap(out.resolve(), source.resolve())
    if reason is not None:
        raise UserError(f"--out ({str(out)!r}) {reason}: an export never writes into a run directory or checkpoint")


def checked_tokenizer(source: Path) -> Path | None:
    """`source` if its tokenizer.json loads (parsed by `tokenizers`, so a damaged file is refused rather than
    copied); None, with a warning, when it has none: such an export still gives logits for token ids."""
    from moep_ds.data.tokenizer import load_tokenizer

    if not (source / "tokenizer.json").exists():
        log.warning("checkpoint %s has no tokenizer.json: exporting without a tokenizer (the model runs on token "
                    "ids; evaluating or generating text needs one)", source)
        return None
    load_tokenizer(source)
    return source


def export_hf_weights(
    entries: list[TensorEntry],
    cfg: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """A Hugging Face directory of the weights `entries` (keys model.<moep_ds key>, written one at a time)."""
    out = Path(out_dir)
    check_export_dir(out, overwrite)
    eot_id = None
    if tokenizer_dir is not None:
        from moep_ds.data.tokenizer import load_tokenizer

        eot_id = load_tokenizer(tokenizer_dir).eot_id
    with layout.output_dir(out) as tmp:
        write_hf_dir(entries, cfg, tmp, Path(tokenizer_dir) if tokenizer_dir else None, eot_id, meta or {})
    return out
