"""DeepSpeed's own validation of a reconciled DeepSpeed config (training/ds_config.py reconciles it with the recipe),
as one line naming the field and the value."""
from __future__ import annotations

import copy
import difflib
import json
from typing import Any

from moep_ds.distributed.ds_fields import DeepSpeedConfigError


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """DeepSpeed's own validation of a reconciled config (its pydantic model of each section), as one line naming
    the field and the value, before the run creates anything; deepspeed.initialize would raise the same error as
    a 40-line traceback once the run directory and the data exist. Needs torch.distributed for the world size."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config import DeepSpeedConfigError as DeepSpeedsError

    read = ReadKeys(copy.deepcopy(ds))
    try:
        DeepSpeedConfig(read)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        field = located(ds, loc) or ".".join([err.title, *loc])
        value = "" if first["type"] == "missing" else f" ({json.dumps(first['input'], default=str)})"
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise DeepSpeedConfigError(f"ds_config {field}{value}: {first['msg']}{more}") from None
    except (DeepSpeedsError, ValueError, AssertionError) as err:  # its checks across fields and of removed keys
        lines = str(err).strip().splitlines()
        raise DeepSpeedConfigError(f"ds_config refused by DeepSpeed: {lines[0] if lines else type(err).__name__}") \
            from None
    check_misspelled(ds, read.read)


class ReadKeys(dict):
    """A dict that records which keys are looked up: the top-level keys DeepSpeed's config parser asks for."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def check_misspelled(ds: dict[str, Any], read: set[str]) -> None:
    """DeepSpeed ignores a top-level key it does not know, so `gradient_acumulation_steps` would silently train
    without accumulation: a key its parser never asked for that is close to one it did is refused. Other unread
    keys pass (sections read by the engine itself, or by newer DeepSpeed versions)."""
    for key in sorted(set(ds) - read):
        close = difflib.get_close_matches(key, sorted(k for k in read if isinstance(k, str)), n=1, cutoff=0.8)
        if close:
            raise DeepSpeedConfigError(f"ds_config {key}: unknown key (DeepSpeed would ignore it); did you mean "
                                       f"{close[0]!r}?")


def located(ds: dict[str, Any], loc: list[str]) -> str | None:
    """The dotted path in `ds` of a pydantic error location, which DeepSpeed gives relative to what its model
    reads: the zero_optimization section (`stage`) or the whole config (`tensorboard.enabled`)."""
    for prefix in ([], *([key] for key, value in ds.items() if isinstance(value, dict))):
        node: Any = ds
        for part in prefix + loc:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return ".".join(prefix + loc)
    return None
