"""Weight rules: how one of our tensors is made from a Hugging Face checkpoint's tensors, and back. Every family
adapter (interop/families/) states its weights as a list of these; import (hf_weights.py) reads by them, the native
export (export_native.py) writes by them.

    Rule("blocks.0.ffn.w1.weight", ("model.layers.0.mlp.gate_proj.weight",), to_ours, to_theirs, rowwise=True)

How rows of ours may be read alone (a process reads only what it holds: its experts, a chunk of an embedding):
    stacked   row e of ours comes from theirs[e] alone (an expert stack stored one tensor per expert)
    rowwise   rows [a, b) of ours are to_ours of rows [a, b) of each of theirs (theirs share the leading dim):
              a tensor as stored, or an expert stack stored as one [E, ...] tensor (gpt-oss's gate_up_proj, its
              MXFP4 blocks and scales), transformed per row
    neither   ours is computed from whole tensors

Several of ours may share one tensor of theirs (gpt-oss's gate_up_proj holds our gate and up, interleaved): each is
read by a rule of its own, and the tensor is written by the rule that `joins` the others (its to_theirs takes ours,
then the joined tensors of ours); their rules write nothing (to_theirs gives []).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Rule:
    """Our tensor `ours` from the HF tensors `theirs` (`to_ours`), and back (`to_theirs`, in the order of `theirs`);
    `stacked` / `rowwise` / `joins`: see the module docstring."""

    ours: str
    theirs: tuple[str, ...]
    to_ours: Callable[[list[torch.Tensor]], torch.Tensor]
    to_theirs: Callable[..., list[torch.Tensor]]  # (ours, *joins) -> theirs
    stacked: bool = False
    rowwise: bool = False
    joins: tuple[str, ...] = ()  # more of ours that theirs are written from


def same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t], rowwise=True)


def transposed(ours: str, theirs: str) -> Rule:
    """GPT-2's Conv1D stores a Linear's weight as [in, out]."""
    return Rule(ours, (theirs,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


def concatenated(ours: str, theirs: tuple[str, ...], rows: list[int]) -> Rule:
    """Our fused w_qkv rows [q | k | v] from separate q_proj, k_proj, v_proj."""
    return Rule(ours, theirs, lambda ts: torch.cat(ts, 0), lambda t: [p.contiguous() for p in t.split(rows, 0)])


def with_bias(make: Callable[[str, str], Rule], ours: str, theirs: str, bias: bool) -> list[Rule]:
    return [make(f"{ours}.weight", f"{theirs}.weight")] + ([make(f"{ours}.bias", f"{theirs}.bias")] if bias else [])


def expert_stack(ours: str, theirs: list[str]) -> Rule:
    """Our [E, a, b] stack from E tensors [b, a] (a Linear's weight per expert), row e from tensor e."""
    return Rule(ours, tuple(theirs), lambda ts: torch.stack([t.t() for t in ts]).contiguous(),
                lambda t: [t[e].t().contiguous() for e in range(t.shape[0])], stacked=True)


def permuted(ours: str, theirs: str, perm: torch.Tensor | None) -> Rule:
    """Ours = theirs with rows reordered: our row j is their row perm[j] (None: the same order)."""
    if perm is None:
        return same(ours, theirs)
    inverse = torch.argsort(perm)
    return Rule(ours, (theirs,), lambda ts: ts[0][perm].contiguous(), lambda t: [t[inverse].contiguous()])


__all__ = ["Rule", "concatenated", "expert_stack", "permuted", "same", "transposed", "with_bias"]
