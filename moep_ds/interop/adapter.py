"""The one protocol every Hugging Face family speaks, dense and MoE alike (torchtitan's state-dict adapters: one
class per model behind one to_hf / from_hf pair). Each family is one module of interop/families/ holding one
`Family` subclass instance named ADAPTER; families/__init__.py finds it by config.json's model_type.

    adapter = family_of(hf)                       # config.json -> its family (one line naming what we read)
    model = adapter.recipe(hf)                    # the recipe's model section (what moep-import writes)
    adapter.check(hf, model_cfg, source)          # the recipe's model against config.json, one line per difference
    rules = adapter.rules(model_cfg, hf)          # our tensors <-> theirs (interop/rules.py), for that checkpoint
    ignored = adapter.ignored(hf)                 # tensors of a checkpoint that are no weights (known, skipped)
    config = adapter.hf_config(model_cfg)         # model -> config.json, or Inexpressible naming the field
    lines = adapter.differences(model_cfg)        # [] when config.json expresses the model exactly (export)

No caller branches on a family: import, export and the recipe a source stands for go through these methods only.
"""
from __future__ import annotations

import re
from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.rules import Rule

Raw = dict[str, Any]
ROTARY_BUFFERS = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class Inexpressible(Exception):
    """A setting of the model that the family's config.json has no field for (the native export's search).
    `other_kind`: the model is not of the family's kind at all (MoE blocks for a dense family, no MoE block for an
    MoE family), the farthest of misses: the export names a family of the model's kind as the nearest."""

    def __init__(self, message: str, other_kind: bool = False):
        super().__init__(message)
        self.other_kind = other_kind


class Family:
    """A Hugging Face family: subclass it in interop/families/<model_type>.py and name the instance ADAPTER."""

    model_type: str  # config.json's model_type
    hf_class: str  # the transformers class, config.json's architectures[0]
    base_prefix: str = "model."  # what a checkpoint of the base model (no LM head) leaves out of every key
    head_keys: tuple[str, ...] = ("lm_head.weight",)  # the untied LM head's key, then older spellings

    def recipe(self, hf: Raw) -> Raw:
        """The model section of the recipe that builds the model config.json describes."""
        raise NotImplementedError

    def to_hf(self, model_cfg: Any) -> Raw:
        """The family's own config.json keys for the model (no architectures, model_type, dtype or special token
        ids); Inexpressible naming the first setting the family has no field for."""
        raise NotImplementedError

    def rules(self, model_cfg: Any, hf: Raw) -> list[Rule]:
        """Our tensors from those of a checkpoint of config.json `hf`, and back (interop/rules.py)."""
        raise NotImplementedError

    def ignored(self, hf: Raw) -> re.Pattern:
        """Tensors of a checkpoint that are no weights of the model: recognised and skipped."""
        return ROTARY_BUFFERS

    def check(self, hf: Raw, model_cfg: Any, source: str) -> None:
        """The recipe's model against the one config.json describes: every difference one line (UserError); a
        recipe may be shorter than the source's max_position_embeddings."""
        from moep_ds.interop.compare import model_differences, report

        expected = model_of(self.recipe(hf), f"{source}'s config.json")
        lines = model_differences(expected, model_cfg, ("config.json", "the recipe"), keep_length=False)
        if model_cfg.max_seq_len > expected.max_seq_len:
            lines.append(f"model.max_seq_len: {model_cfg.max_seq_len} in the recipe, longer than "
                         f"{expected.max_seq_len} in config.json (max_position_embeddings)")
        if lines:
            raise UserError(f"{source} ({self.hf_class}) does not match the recipe's model:\n  " + report(lines))

    def hf_config(self, model_cfg: Any) -> Raw:
        """config.json of the native export (special token ids are added by the export)."""
        return {"architectures": [self.hf_class], "model_type": self.model_type, **self.to_hf(model_cfg),
                "dtype": "float32"}

    def differences(self, model_cfg: Any) -> list[str]:
        """How the model read back from its config.json differs from the model: [] when the family expresses it
        exactly (Inexpressible / UserError when it cannot be written at all)."""
        from moep_ds.interop.compare import model_differences

        back = model_of(self.recipe(self.hf_config(model_cfg)), f"{self.hf_class}'s config.json")
        return model_differences(back, model_cfg, (self.hf_class, "the model"))


def model_of(model_raw: Raw, what: str) -> Any:
    """The ModelConfig of a recipe's model section (a config.json's, or an export's round trip)."""
    from moep_ds.checkpointing.model_dir import StoredRecipe
    from moep_ds.schema import ConfigError

    try:
        return StoredRecipe.parse({"model": model_raw}).model
    except ConfigError as err:
        raise UserError(f"{what} describes no model moep_ds builds: {err}") from None


__all__ = ["Family", "Inexpressible", "Raw", "model_of"]
