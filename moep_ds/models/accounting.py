"""Parameter and FLOP accounting on the meta device (no memory is allocated, so 1B recipes count in seconds).

- total: every distinct parameter (tied weights once).
- non-embedding: total minus token/position embedding tables and an untied LM head (the Kaplan / Pythia
  convention).
- active: parameters one token passes through; a module that defines `num_active_params()` (an MoE layer:
  the router's active experts per token of E) reports its own subtree.
- flops_per_token: training (forward + backward) FLOPs, 6 x active matmul parameters (embedding lookups
  excluded, the LM head included) plus each attention module's `attention_flops_per_token(seq_len)`.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moep_ds.models.causal_lm import CausalLM, build_model
from moep_ds.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamReport:
    params_total: int
    params_non_embedding: int
    params_active: int
    flops_per_token: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def active_params(module: nn.Module, seen: set[int], root: bool = True) -> int:
    if not root and hasattr(module, "num_active_params"):
        for p in module.parameters():
            seen.add(id(p))
        return int(module.num_active_params())
    count = 0
    for p in module.parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            count += p.numel()
    return count + sum(active_params(child, seen, root=False) for child in module.children())


def attention_flop_terms(module: nn.Module, seq_len: int) -> list[float]:
    """Each attention's FLOPs per token, in module order. A module with `attention_flop_terms` (stacked experts:
    one module computes E experts) reports its subtree; one with `attention_flops_per_token` is one term."""
    if hasattr(module, "attention_flop_terms"):
        return module.attention_flop_terms(seq_len)
    if hasattr(module, "attention_flops_per_token"):
        return [module.attention_flops_per_token(seq_len)]
    return [term for child in module.children() for term in attention_flop_terms(child, seq_len)]


def embedding_params(model: CausalLM) -> int:
    tables = [model.embed.weight]
    if model.pos_embed is not None:
        tables.append(model.pos_embed.weight)
    if model.head.weight is not model.embed.weight:
        tables.append(model.head.weight)
    return sum(t.numel() for t in tables)


def count_params(model: CausalLM, seq_len: int | None = None) -> ParamReport:
    total = sum(p.numel() for p in model.parameters())
    active = active_params(model, set())
    seq_len = seq_len or model.cfg.max_seq_len
    lookups = model.embed.weight.numel() + (model.pos_embed.weight.numel() if model.pos_embed is not None else 0)
    # A tied head is a matmul even though its weight is the embedding table.
    matmul_active = active - lookups + (model.head.weight.numel() if model.cfg.tie_embeddings else 0)
    attention = sum(attention_flop_terms(model, seq_len))
    return ParamReport(
        params_total=total,
        params_non_embedding=total - embedding_params(model),
        params_active=active,
        flops_per_token=6.0 * matmul_active + attention,
    )


def meta_param_report(cfg: ModelConfig, seq_len: int | None = None) -> ParamReport:
    """Count a model built on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg)
    return count_params(model, seq_len)
