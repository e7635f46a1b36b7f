"""The contract every block type implements.

# B batch, T sequence length, D model dim

A block maps hidden states x_BTD to new hidden states, returning auxiliary losses (already weighted; the
model sums them into `loss` and reports each) and routing statistics (detached) beside them, never on
`self`. `positions_BT` are the tokens' positions in their original sequence (RoPE, sliding windows, KV
cache offsets); the sequence id of a token is its batch row.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass
class BlockOutput:
    x: torch.Tensor  # [B, T, D]
    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # name -> scalar
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # name -> detached tensor


class Block(nn.Module):
    """Base class: subclasses take `(cfg, *, d_model, layer_idx)` and implement `forward`."""

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        raise NotImplementedError

    def new_cache(self) -> Any:
        """A fresh per-layer decoding cache (KV cache, SSM state); filled in place by `forward`."""
        return None
