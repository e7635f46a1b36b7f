"""A Hugging Face checkpoint folder as our weights: config.json checked against the recipe, tensors streamed.
The folder's family (interop/families/, found by config.json's model_type) checks the recipe and names the tensors.

    config.json                                  architecture (model_type) and sizes, read as JSON (no code runs)
    model.safetensors | model-0000x-of-0000n.safetensors + model.safetensors.index.json
    pytorch_model.bin | pytorch_model-0000x-of-0000n.bin + pytorch_model.bin.index.json

safetensors files are read through `safe_open` (memory-mapped, one tensor at a time); .bin files through
`torch.load(weights_only=True, mmap=True)`, which maps the file and runs no code from it. Either way only the
tensors of the one weight being read are in memory, of an expert stack only the experts asked for (a process
under expert parallelism reads its own experts' tensors, from whichever shards hold them), and of a tensor stored
as we hold it (an embedding, a head) only the rows being copied (weights.py copies in chunks of rows).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import torch

from moep_ds.errors import UserError, json_error_reason
from moep_ds.interop.adapter import model_of
from moep_ds.interop.families import families, family_of
from moep_ds.interop.rules import Rule
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
    return json_object(folder / "config.json")


def json_object(file: Path) -> dict[str, Any]:
    """A JSON file holding an object (config.json, generation_config.json); anything else is one line naming it."""
    try:
        out = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{str(file)!r} is not readable JSON: {json_error_reason(err)}") from None
    if not isinstance(out, dict):
        raise UserError(f"{str(file)!r} holds a {type(out).__name__}, not a JSON object")
    return out


class TensorFiles:
    """The tensors of a checkpoint folder by key, each read alone (whichever of the four layouts it has)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = self.key_files(folder)
        self.shapes: dict[Path, dict[str, tuple[int, ...]]] = {}  # per file, read from its header once

    @staticmethod
    def key_files(folder: Path) -> dict[str, Path]:
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if (folder / index).is_file():
                try:
                    weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
                    files = {k: folder / inside(v, k, folder / index) for k, v in weight_map.items()}
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                    raise UserError(f"{str(folder / index)!r} is not a weights index: {err}") from None
                missing = sorted({(f.name, k) for k, f in files.items() if not f.is_file()})
                if missing:
                    raise UserError(f"{str(folder / index)!r} names shard {missing[0][0]!r} (holding "
                                    f"{missing[0][1]!r}), which is missing from {str(folder)!r}")
                return files
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
        if file not in self.shapes:
            if file.suffix == ".safetensors":
                with safetensors_file(file) as f:
                    self.shapes[file] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            else:
                self.shapes[file] = {k: tuple(t.shape) for k, t in load_bin(file).items()}
        if key not in self.shapes[file]:
            raise UserError(f"{str(file)!r} lacks {key!r}, which the weights index places there")
        return self.shapes[file][key]

    def read(self, key: str) -> torch.Tensor:
        """The tensor in fp32 (what the checkpoint stores: fp32, fp16 or bf16); integer tensors (MXFP4's packed
        blocks and exponents) as stored."""
        file = self.files[key]
        if file.suffix == ".safetensors":
            with safetensors_file(file) as f:
                return as_read(f.get_tensor(key))
        return as_read(load_bin(file)[key])

    def read_rows(self, key: str, first: int, end: int) -> torch.Tensor:
        """Rows [first, end) of the tensor (as `read` gives it), only their bytes read from the file."""
        file = self.files[key]
        if file.suffix == ".safetensors":
            with safetensors_file(file) as f:
                return as_read(f.get_slice(key)[first:end])
        return as_read(load_bin(file)[key][first:end])


def as_read(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def inside(name: Any, key: str, index: Path) -> str:
    """A shard name of a weights index, refused where it leads out of the index's folder: an absolute path or a `..`
    component (a downloaded index must not make the import read other files of the machine). Checked on the name as
    written, not where links lead: huggingface_hub's cache links every file of a snapshot to ../../blobs/."""
    if not isinstance(name, str):
        raise TypeError(f"shard of {key!r} is {name!r}, not a file name")
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise UserError(f"{str(index)!r} names shard {name!r} (holding {key!r}), a path outside {str(index.parent)!r}: "
                        "an index names files of its own folder")
    return name


@contextlib.contextmanager
def safetensors_file(file: Path) -> Iterator[Any]:
    """safe_open(file), memory-mapped; a missing file, and safetensors' errors (SafetensorError "incomplete metadata"
    for a truncated file, a bad header, an unreadable file), are one line naming the file."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise UserError(f"{str(file)!r} is missing")
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"{str(file)!r} cannot be read as safetensors ({first_line(err)}): the file is truncated or "
                        "damaged; download it again") from None
    with handle as f:
        yield f


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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


def normalise_keys(files: TensorFiles, base_prefix: str, head_keys: tuple[str, ...], ignored: Any) -> dict[str, str]:
    """{key as the map names it: key in the files}: a base model's checkpoint lacks the prefix (GPT-2's own
    release: `h.0.attn...`), GPT-NeoX's head is `embed_out` in Pythia's files and `lm_head` in newer ones."""
    out = {}
    for key in files.files:
        if ignored.fullmatch(key):
            continue
        name = key
        if not key.startswith(base_prefix) and key not in head_keys:
            name = base_prefix + key
        if key in head_keys:
            name = head_keys[0]
        out[name] = key
    return out


def architecture_names() -> list[str]:
    return sorted(families())


def hf_weights(folder: Path, model_cfg: Any, source: str) -> dict[str, Weight]:
    """The weights of a Hugging Face folder under our names, after checking config.json against the recipe's
    model (every mismatch one line) and the tensors against the family's rules (none missing, none unknown)."""
    hf = read_config(folder)
    family = family_of(hf, source)
    family.check(hf, model_cfg, source)
    rules = family.rules(model_cfg, hf)
    files = TensorFiles(folder)
    keys = normalise_keys(files, family.base_prefix, family.head_keys, family.ignored(hf))
    needed = {k for rule in rules for k in rule.theirs}
    if model_cfg.tie_embeddings:  # a tied checkpoint may store the head anyway (as the embedding's copy)
        keys.pop(family.head_keys[0], None)
    missing, unknown = sorted(needed - set(keys)), sorted(set(keys) - needed)
    if missing:
        raise UserError(f"{source} lacks {len(missing)} tensor(s) of {family.hf_class}: {missing[:5]}")
    if unknown:
        raise UserError(f"{source} has {len(unknown)} tensor(s) that {family.hf_class} of this recipe has no place "
                        f"for: {unknown[:5]}")
    return {rule.ours: weight_of(rule, files, keys) for rule in rules}


def weight_of(rule: Rule, files: TensorFiles, keys: dict[str, str]) -> Weight:
    shapes = [files.shape(keys[k]) for k in rule.theirs]
    shape = tuple(rule.to_ours([torch.empty(s, device="meta") for s in shapes]).shape)
    read_rows = None
    if rule.stacked:  # an expert stack: experts [first, end) from their own tensors only
        read_rows = lambda first, end: rule.to_ours([files.read(keys[k]) for k in rule.theirs[first:end]])  # noqa: E731
    elif rule.rowwise and len(shape) >= 2:  # rows of ours from the same rows of theirs alone
        read_rows = lambda first, end: rule.to_ours([files.read_rows(keys[k], first, end)  # noqa: E731
                                                     for k in rule.theirs])
    return Weight(shape, lambda: rule.to_ours([files.read(keys[k]) for k in rule.theirs]), read_rows)


def native_entries(entries: dict[str, Any], rules: list[Rule]) -> list[Any]:
    """Our weights (TensorEntry by canonical name) as the family's tensors (`rules`), each computed when
    written; the tensors of one rule (an expert stack's experts) from one read of ours (and of those it joins)."""
    from moep_ds.checkpointing.streaming import TensorEntry

    last: dict[str, list[torch.Tensor]] = {}  # the one rule's tensors being written

    def part(rule: Rule, j: int) -> torch.Tensor:
        if rule.ours not in last:
            last.clear()
            last[rule.ours] = rule.to_theirs(*[entries[name].read().float() for name in (rule.ours, *rule.joins)])
        return last[rule.ours][j]

    out = []
    for rule in rules:
        parts = rule.to_theirs(*[torch.empty(entries[name].shape, device="meta") for name in (rule.ours, *rule.joins)])
        for j, (key, meta) in enumerate(zip(rule.theirs, parts)):
            out.append(TensorEntry(key, torch.float32, tuple(meta.shape), lambda rule=rule, j=j: part(rule, j)))
    return out


__all__ = ["TensorFiles", "architecture_names", "hf_weights", "is_hf_folder", "model_of", "native_entries",
           "read_config"]
