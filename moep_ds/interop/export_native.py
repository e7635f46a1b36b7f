"""`moep-export RUN --out DIR --hf --native`: a dense model in its architecture's own Hugging Face format.

    DIR/config.json         GPT2LMHeadModel / LlamaForCausalLM / GemmaForCausalLM / GPTNeoXForCausalLM config
    DIR/model.safetensors   the architecture's tensor names and layouts (hf_layout.py), written one at a time
    DIR/meta.json, tokenizer files

transformers loads it without trust_remote_code (`AutoModelForCausalLM.from_pretrained(DIR)`), and moep-import
reads it back bit for bit. Only a model of one dense block repeated has such a format; an MoE is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moep_ds.checkpointing.streaming import TensorEntry, write_safetensors
from moep_ds.interop.hf_layout import architecture_of_spec, hf_config, spec_of
from moep_ds.interop.hf_weights import native_entries


def write_native_dir(entries: list[TensorEntry], cfg: Any, tmp: Path, tokenizer_dir: Path | None,
                     eot_id: int | None, meta: dict[str, Any]) -> None:
    """Into the (temporary) folder `tmp`: `entries` (our weights, canonical names) in the architecture's format."""
    spec = spec_of(cfg.model)
    arch = architecture_of_spec(spec)
    by_name = {e.name: e for e in entries}
    write_safetensors(tmp / "model.safetensors", native_entries(by_name, spec, arch), metadata={"format": "pt"})
    specials = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None}
    config = hf_config(spec, arch, specials)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer_dir is not None:
        from moep_ds.data.tokenizer import copy_tokenizer

        copy_tokenizer(tokenizer_dir, tmp)


__all__ = ["write_native_dir"]
