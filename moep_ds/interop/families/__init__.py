"""The registry of Hugging Face families: one module per family, named as config.json's model_type, holding one
`Family` instance `ADAPTER` (interop/adapter.py) with everything the family knows: config.json -> recipe, model ->
config.json (or Inexpressible naming the setting), its weight rules both ways, the tensors it skips, the settings it
refuses. Adding a family is one module here and one line in FAMILY_MODULES; the order is the native export's
preference where two families would express a model. No code outside this folder names a family
(tests/interop/test_family_registry.py).

    gpt2.py, llama.py, gpt_neox.py      DenseFamily (hf_layout.py): an Expected table, config keys, tensor rules
    gemma.py                            Llama's class with Gemma's choices
    mixtral.py, qwen2_moe.py, olmoe.py, deepseek_v3.py
                                        MoEFamily (moe_layout.py): attention, router, shared expert, MoE layers
    qwen3_moe.py, deepseek_v2.py        built on qwen2_moe.py and deepseek_v3.py
    qwen3_next.py                       Family itself (an attention kind per layer, layer_types), moe_layout's helpers
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Family

FAMILY_MODULES = (
    "gpt2", "llama", "gemma", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2",
    "qwen3_next", "glm4_moe", "gpt_oss",
)


@functools.cache
def families() -> dict[str, Family]:
    """{model_type: adapter}, in FAMILY_MODULES order."""
    out = {}
    for name in FAMILY_MODULES:
        adapter = importlib.import_module(f"{__name__}.{name}").ADAPTER
        out[adapter.model_type] = adapter
    return out


def family_of(hf: dict[str, Any], what: str) -> Family:
    """The family of config.json `hf`; one line naming the families moep-import reads."""
    kind = hf.get("model_type")
    found = families().get(kind) if isinstance(kind, str) else None
    if found is None:
        raise UserError(f"{what}: config.json has model_type {kind!r}; moep-import reads "
                        f"{', '.join(sorted(families()))}")
    return found


__all__ = ["FAMILY_MODULES", "families", "family_of"]
