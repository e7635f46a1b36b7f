"""Which evaluation rule each expert-choice router of a model follows (`eval_mode`: threshold | topk): recorded with
every evaluation result, since expert-choice numbers depend on it."""
from __future__ import annotations

import torch


def routing_eval_modes(model: torch.nn.Module) -> dict[str, str]:
    """{module name: eval_mode} of every router that has one (expert choice: threshold | topk).

    Recorded with every evaluation result: expert-choice numbers depend on it.
    """
    modes = {}
    for name, module in model.named_modules():
        mode = getattr(getattr(module, "cfg", None), "eval_mode", None)
        if isinstance(mode, str):
            modes[name] = mode
    return modes


def summarize_routing_modes(modes: dict[str, str]) -> str:
    """One word for tables: 'threshold', 'topk', 'mixed' or 'none' (no expert-choice router)."""
    kinds = sorted(set(modes.values()))
    return kinds[0] if len(kinds) == 1 else ("none" if not kinds else "mixed")
