"""A Hugging Face checkpoint folder as our weights: config.json checked against the recipe, tensors streamed.

    config.json                                  architecture (model_type) and sizes, read as JSON (no code runs)
    model.safetensors | model-0000x-of-0000n.safetensors + model.safetensors.index.json
    pytorch_model.bin | pytorch_model-0000x-of-0000n.bin + pytorch_model.bin.index.json

safetensors files are read through `safe_open` (memory-mapped, one tensor at a time); .bin files through
`torch.load(weights_only=True, mmap=True)`, which maps the file and runs no code from it. Either way only the
tensors of the one weight being read are in memory.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from moep_ds.errors import UserError, json_error_reason
from moep_ds.interop.hf_layout import Architecture, Rule, Spec, architecture_of_config, check_against_recipe, spec_of
from moep_ds.interop.weights import Weight

log = logging.getLogger(__name__)

SAFETENSORS_INDEX, SAFETENSORS = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN = "pytorch_model.bin.index.json", "pytorch_model.bin"


def is_hf_folder(folder: Path) -> bool:
    """config.json with a model_type and weights beside it, and no moep_ds recipe (an export keeps its own)."""
    if not (folder / "config.json").is_file() or (folder / "config.yaml").is_file():
        return False
    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # reported by read_config
    return isinstance(hf, dict) and "moep_model" not in hf


def read_config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    try:
        hf = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{str(f)!r} is not readable JSON: {json_error_reason(err)}") from None
    if not isinstance(hf, dict):
        raise UserError(f"{str(f)!r} holds a {type(hf).__name__}, not a JSON object")
    return hf


class TensorFiles:
    """The tensors of a checkpoint folder by key, each read alone (whichever of the four layouts it has)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = self.key_files(folder)

    @staticmethod
    def key_files(folder: Path) -> dict[str, Path]:
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if (folder / index).is_file():
                try:
                    weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as err:
                    raise UserError(f"{str(folder / index)!r} is not a weights index: {err}") from None
                return {k: folder / v for k, v in weight_map.items()}
            if (folder / single).is_file():
                return {k: folder / single for k in TensorFiles.keys_of(folder / single)}
        raise UserError(f"{str(folder)!r} holds no weights ({SAFETENSORS}, {BIN} or their sharded index)")

    @staticmethod
    def keys_of(file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            with safetensors_file(file) as f:
                return list(f.keys())
        return list(load_bin(file))

    def shape(self, key: str) -> tuple[int, ...]:
        file = self.files[key]
        if file.suffix == ".safetensors":
            with safetensors_file(file) as f:
                return tuple(f.get_slice(key).get_shape())
        return tuple(load_bin(file)[key].shape)

    def read(self, key: str) -> torch.Tensor:
        """The tensor in fp32 (what the checkpoint stores: fp32, fp16 or bf16)."""
        file = self.files[key]
        if not file.is_file():
            raise UserError(f"{str(file)!r} (named by the weights index for {key!r}) is missing")
        if file.suffix == ".safetensors":
            with safetensors_file(file) as f:
                return f.get_tensor(key).float()
        return load_bin(file)[key].float()


@contextlib.contextmanager
def safetensors_file(file: Path) -> Iterator[Any]:
    """safe_open(file), whose errors (safetensors' SafetensorError "incomplete metadata" for a truncated file, a bad
    header, an unreadable file) become one line naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - SafetensorError is not exported under a stable name
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{str(file)!r} cannot be read as safetensors ({reason}): the file is truncated or damaged; "
                        "download it again") from None


@functools.lru_cache(maxsize=4)
def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin memory-mapped: its tensors are read from the file when used, not loaded here."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - torch's refusal of pickled code, or a damaged file
        raise UserError(f"{str(file)!r} cannot be read as tensors: {str(err).strip().splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise UserError(f"{str(file)!r} holds a {type(state).__name__}, not a state dict")
    return state


def normalise_keys(files: TensorFiles, arch: Architecture) -> dict[str, str]:
    """{key as the map names it: key in the files}: a base model's checkpoint lacks the prefix (GPT-2's own
    release: `h.0.attn...`), GPT-NeoX's head is `embed_out` in Pythia's files and `lm_head` in newer ones."""
    out = {}
    for key in files.files:
        if arch.ignored.fullmatch(key):
            continue
        name = key
        if not key.startswith(arch.base_prefix) and key not in arch.head_keys:
            name = arch.base_prefix + key
        if key in arch.head_keys:
            name = arch.head_keys[0]
        out[name] = key
    return out


def hf_weights(folder: Path, model_cfg: Any, source: str) -> dict[str, Weight]:
    """The weights of a Hugging Face folder under our names, after checking config.json against the recipe's
    model (every mismatch one line) and the tensors against the architecture's map (none missing, none unknown)."""
    hf = read_config(folder)
    arch = architecture_of_config(hf, source)
    spec = spec_of(model_cfg)
    check_against_recipe(arch, hf, spec, source)
    files = TensorFiles(folder)
    keys = normalise_keys(files, arch)
    rules = arch.rules(spec)
    needed = {k for rule in rules for k in rule.theirs}
    if spec["tie_embeddings"]:  # a tied checkpoint may store the head anyway (as the embedding's copy)
        keys.pop(arch.head_keys[0], None)
    missing, unknown = sorted(needed - set(keys)), sorted(set(keys) - needed)
    if missing:
        raise UserError(f"{source} lacks {len(missing)} tensor(s) of {arch.hf_class}: {missing[:5]}")
    if unknown:
        raise UserError(f"{source} has {len(unknown)} tensor(s) that {arch.hf_class} of this recipe has no place "
                        f"for: {unknown[:5]}")
    return {rule.ours: weight_of(rule, files, keys, spec) for rule in rules}


def weight_of(rule: Rule, files: TensorFiles, keys: dict[str, str], spec: Spec) -> Weight:
    shapes = [files.shape(keys[k]) for k in rule.theirs]
    shape = tuple(rule.to_ours([torch.empty(s, device="meta") for s in shapes]).shape)
    return Weight(shape, lambda: rule.to_ours([files.read(keys[k]) for k in rule.theirs]))


def native_entries(entries: dict[str, Any], spec: Spec, arch: Architecture) -> list[Any]:
    """Our weights (TensorEntry by canonical name) as the architecture's tensors, each computed when written."""
    from moep_ds.checkpointing.streaming import TensorEntry

    out = []
    for rule in arch.rules(spec):
        ours = entries[rule.ours]
        parts = rule.to_theirs(torch.empty(ours.shape, device="meta"))
        for j, (key, part) in enumerate(zip(rule.theirs, parts)):
            out.append(TensorEntry(key, torch.float32, tuple(part.shape),
                                   lambda ours=ours, rule=rule, j=j: rule.to_theirs(ours.read().float())[j]))
    return out


__all__ = ["TensorFiles", "hf_weights", "is_hf_folder", "native_entries", "read_config"]
