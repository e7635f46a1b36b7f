"""The recipe's `eval:` section."""
from __future__ import annotations

import dataclasses

from moep_ds.schema import PositiveInt


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    tasks: list[str] = dataclasses.field(default_factory=list)
    batch_size: PositiveInt = 16
    data_dir: str | None = None  # null: $MOEP_DATA_DIR or ../shared/data beside the checkout
