"""`moep-export RUN --out DIR --hf --native`: a model in its family's own Hugging Face format.

    DIR/config.json         the family's config (`Family.hf_config`, interop/families/<model_type>.py):
                            GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM, ...
    DIR/model.safetensors   the family's tensor names and layouts (`Family.rules`), written one at a time; above
                            --max_shard_size as save_pretrained shards: model-0000i-of-0000n.safetensors and
                            model.safetensors.index.json ({"metadata": {"total_size", "total_parameters"},
                            "weight_map": {key: file}})
    DIR/generation_config.json  the special tokens generation stops at and pads with (below)
    DIR/meta.json, tokenizer files

Special tokens (config.json's bos / eos / pad ids, generation_config.json): an imported model's are its source's, as
published (moep-import keeps them in meta.json; a source without generation_config.json gets the one transformers
derives from config.json's ids); a model trained here has its tokenizer's: the end-of-text token as bos and eos,
pad the tokenizer's own pad token (tokenizer_config.json), null without a tokenizer.

transformers loads it without trust_remote_code (`AutoModelForCausalLM.from_pretrained(DIR)`), and moep-import
reads it back bit for bit. The model is the first family, in the registry's order (interop/families/__init__.py),
whose config.json describes it exactly (`Family.differences`: the model written as that family's config.json, read
back as a recipe and compared with itself; a family refuses a model that is another's, Inexpressible). None that
passes: refused, naming the nearest family (fewest differing settings) and the first setting where it differs.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from moep_ds.checkpointing.streaming import TensorEntry, write_safetensors
from moep_ds.errors import UserError
from moep_ds.interop.adapter import Inexpressible
from moep_ds.interop.families import families
from moep_ds.interop.hf_weights import SAFETENSORS, SAFETENSORS_INDEX, native_entries
from moep_ds.interop.rules import Rule

DEFAULT_MAX_SHARD = "5GB"  # the hub's advice (save_pretrained itself defaults to 50GB)
SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?B?)", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
         "TB": 10**12}
INEXPRESSIBLE = 1000  # a difference no field of the family can take: far from every near miss
OTHER_KIND = 2000  # a model of another kind than the family's (MoE or dense): farther still


@dataclasses.dataclass(frozen=True)
class NativeFormat:
    hf_class: str
    config: dict[str, Any]  # config.json, without the tokenizer's special ids
    rules: list[Rule]  # its tensors from ours


def native_format(model_cfg: Any) -> NativeFormat:
    """The family and config.json the model is exported as: the first family (in the registry's order) that
    expresses it exactly; one line naming the nearest when none does."""
    misses = []
    for family in families().values():
        try:
            lines = family.differences(model_cfg)
        except (Inexpressible, UserError) as err:
            misses.append((OTHER_KIND if getattr(err, "other_kind", False) else INEXPRESSIBLE, family.hf_class,
                           [str(err)]))
            continue
        if not lines:
            config = family.hf_config(model_cfg)
            return NativeFormat(family.hf_class, config, family.rules(model_cfg, config))
        misses.append((len(lines), family.hf_class, lines))
    count, name, lines = min(misses, key=lambda m: m[0])
    alike = [n for c, n, ls in misses if c == count and ls[0] == lines[0]]
    if count >= INEXPRESSIBLE and len(alike) > 1:  # one reason shared by several families (the dense ones' spec)
        raise UserError(f"no Hugging Face architecture expresses this model: {lines[0]} ({', '.join(alike)})")
    extra = f" ({count} setting(s) differ)" if count < INEXPRESSIBLE else ""
    raise UserError(f"no Hugging Face architecture expresses this model: the nearest, {name}, differs first at "
                    f"{lines[0]}{extra}")


def max_shard_bytes(text: str) -> int:
    """'5GB', '100KB', '2000000' -> bytes (decimal units, as save_pretrained reads them)."""
    match = SIZE.fullmatch(text.strip())
    if match is None or match.group(2).upper() not in UNITS:
        raise UserError(f"--max_shard_size ({text!r}) is not a size such as 5GB, 500MB or 100KB")
    return max(1, int(float(match.group(1)) * UNITS[match.group(2).upper()]))


def shards(entries: list[TensorEntry], limit: int) -> list[list[TensorEntry]]:
    """Consecutive tensors grouped so that no group exceeds `limit` bytes (a tensor larger than that alone), as
    huggingface_hub's split_torch_state_dict_into_shards groups them."""
    out: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if out[-1] and size + e.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.nbytes
    return out


def write_native_weights(tmp: Path, entries: list[TensorEntry], limit: int) -> None:
    groups = shards(entries, limit)
    if len(groups) == 1:
        write_safetensors(tmp / SAFETENSORS, entries, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(tmp / name, group, metadata={"format": "pt"})
        weight_map.update({e.name: name for e in group})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries),
                          "total_parameters": sum(e.nbytes // e.dtype.itemsize for e in entries)},
             "weight_map": dict(sorted(weight_map.items()))}
    (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def write_native_dir(entries: list[TensorEntry], cfg: Any, tmp: Path, tokenizer_dir: Path | None,
                     eot_id: int | None, meta: dict[str, Any], max_shard_size: str = DEFAULT_MAX_SHARD) -> None:
    """Into the (temporary) folder `tmp`: `entries` (our weights, canonical names) in the architecture's format."""
    fmt = native_format(cfg.model)
    by_name = {e.name: e for e in entries}
    write_native_weights(tmp, native_entries(by_name, fmt.rules), max_shard_bytes(max_shard_size))
    specials, generation = special_tokens(meta, tokenizer_dir, eot_id)
    (tmp / "config.json").write_text(json.dumps({**fmt.config, **specials}, indent=2) + "\n", encoding="utf-8")
    if generation:  # as GenerationConfig.save_pretrained writes it
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n",
                                                    encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer_dir is not None:
        from moep_ds.data.tokenizer import copy_tokenizer

        copy_tokenizer(tokenizer_dir, tmp)


def special_tokens(meta: dict[str, Any], tokenizer_dir: Path | None, eot_id: int | None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's special token ids, generation_config.json): the source's, or the tokenizer's (module
    docstring)."""
    from moep_ds.checkpointing.model_dir import GENERATION_CONFIG, SPECIAL_TOKENS

    if SPECIAL_TOKENS in meta:
        ids = dict(meta[SPECIAL_TOKENS])
    else:
        pad = tokenizer_pad_id(tokenizer_dir) if tokenizer_dir is not None else None
        ids = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": pad}
    generation = meta.get(GENERATION_CONFIG) or {k: v for k, v in ids.items() if v is not None}
    return ids, generation


def tokenizer_pad_id(tokenizer_dir: Path) -> int | None:
    """The id of the pad token tokenizer_config.json names (a string, or an added token's {"content": ...}); None
    when it names none."""
    from moep_ds.data.tokenizer import load_tokenizer

    try:
        pad = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("pad_token")
    except (OSError, ValueError, AttributeError):  # none, or no JSON object: the tokenizer names no pad token
        pad = None
    if isinstance(pad, dict):
        pad = pad.get("content")
    return load_tokenizer(tokenizer_dir).tok.token_to_id(pad) if isinstance(pad, str) else None


__all__ = ["DEFAULT_MAX_SHARD", "NativeFormat", "max_shard_bytes", "native_format", "write_native_dir"]
