"""The contract every block type implements.

# B batch, T sequence length, D model dim

A block maps hidden states x_BTD to new hidden states, returning auxiliary losses (already weighted; the
model sums them into `loss` and reports each) and routing statistics (detached) beside them, never on
`self`. `positions_BT` are the tokens' positions in their original sequence (RoPE, sliding windows, KV
cache offsets); the sequence id of a token is its batch row.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn


class BlockOutput(NamedTuple):
    """A named tuple rather than a dataclass: DeepSpeed ZeRO-3 attaches its backward hooks (which re-gather a
    block's parameters for the backward pass) only to tensors inside tuples, lists and dicts."""

    x: torch.Tensor  # [B, T, D]
    aux_losses: dict[str, torch.Tensor] = {}  # name -> scalar (never mutated: the default is shared)
    stats: dict[str, torch.Tensor] = {}  # name -> detached tensor


class Block(nn.Module):
    """Base class: subclasses take `(cfg, *, d_model, layer_idx, plan)` and implement `forward`; `plan` (an
    `ExpertParallelPlan`, moe/plan.py) says which experts of its routed stages this process builds."""

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        raise NotImplementedError

    def new_cache(self) -> Any:
        """A fresh per-layer decoding cache (KV cache, SSM state); filled in place by `forward`."""
        return None
