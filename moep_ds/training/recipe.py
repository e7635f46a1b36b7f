"""What training reads of a whole recipe, where a function needs several of its sections (assemble, build_trainer,
fit, the Trainer's parts): the sections by type. The root recipe (moep_ds/config.py `Config`) is one; training does
not import it, since the root sits above training in the import graph (it assembles the train section,
moep_ds/train_config.py, with the others). A function that reads one section takes that section."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from moep_ds.data.config import DataConfig
    from moep_ds.evaluation.config import EvalConfig
    from moep_ds.models.config import ModelConfig
    from moep_ds.train_config import TrainConfig


class Recipe(Protocol):
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
