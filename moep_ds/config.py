"""The recipe: one YAML file, parsed strictly into a typed dataclass tree. This root assembles the sections, each
defined beside its code (models/, data/, training/, evaluation/), and sits at the top of the import graph, below the
commands only: no other floor imports it. A floor that reads a stored recipe parses the section it needs
(checkpointing.model_dir.StoredRecipe: the model), with the YAML and override machinery of recipe_yaml.py.

    cfg = load_config("configs/x.yaml", overrides=["train.optimizer.lr=1e-3", "model.layers[0].repeat=2"])

Unknown keys (with a close-match suggestion), wrong types, out-of-range values and inconsistent fields are
rejected before any tensor exists, each as one ConfigError line naming the dotted path and the value.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from moep_ds.data.config import DataConfig
from moep_ds.evaluation.config import EvalConfig
from moep_ds.models.config import ModelConfig
from moep_ds.models.plan import check_routed_layout
from moep_ds.recipe_yaml import apply_override, dump_yaml, read_yaml
from moep_ds.schema import fail, parse, to_dict
from moep_ds.train_config import TrainConfig


@dataclasses.dataclass(kw_only=True)
class Config:
    model: ModelConfig
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    @classmethod
    def preprocess(cls, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """data.seq_len defaults to model.max_seq_len."""
        model, data = raw.get("model"), raw.get("data", {})
        if isinstance(model, dict) and isinstance(data, dict) and "seq_len" not in data and "max_seq_len" in model:
            raw = {**raw, "data": {**data, "seq_len": model["max_seq_len"]}}
        return raw

    def validate(self, path: str) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            fail("data.seq_len", self.data.seq_len, f"must be <= model.max_seq_len ({self.model.max_seq_len})")
        if self.train.eval_every and self.data.val_fraction == 0 and self.data.val_source is None:
            fail("train.eval_every", self.train.eval_every,
                 "needs validation data: data.val_fraction > 0 or a data.val_source")
        check_routed_layout(self.model, self.train.expert_parallel_size)


def config_from_dict(raw: dict[str, Any], overrides: list[str] | None = None) -> Config:
    import moep_ds.components  # noqa: F401 - fills the registries

    raw = dict(raw)
    for override in overrides or []:
        apply_override(raw, override)
    return parse(Config, raw, "")


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None) -> Config:
    return config_from_dict(read_yaml(path), overrides)


def dump_config(cfg: Config) -> str:
    return dump_yaml(to_dict(cfg))
