"""The registry of Hugging Face families: one module per family (its `ADAPTER`, interop/adapter.py), found by
config.json's model_type. Adding a family is one module here and one line in FAMILY_MODULES; the order is the
native export's preference where two families would express a model."""
from __future__ import annotations

import functools
import importlib
from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Family

FAMILY_MODULES = (
    "gpt2", "llama", "gemma", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2",
    "gpt_oss",
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
