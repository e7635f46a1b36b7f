"""CausalLM: token embedding -> blocks from config -> final norm -> LM head.

# B batch, T tokens, D model dim, V vocabulary
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.deferred_init import deferred_init
from moep_ds.layers.norm import build_norm
from moep_ds.moe.shard import normal_
from moep_ds.models.config import ModelConfig
from moep_ds.models.plan import check_plan
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.registry import BLOCKS

IGNORE_INDEX = -100


@dataclasses.dataclass
class CausalLMOutput:
    loss: torch.Tensor | None  # CE + sum of aux losses; None without labels
    logits: torch.Tensor  # [B, T, V]
    ce_loss: torch.Tensor | None = None
    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # "layers.{i}.{name}" -> scalar
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # "layers.{i}.{name}" -> tensor


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, initialise: bool = True, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        check_plan(cfg, plan)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position_embedding == "learned" else None
        with contextlib.nullcontext() if initialise else deferred_init():  # routers and experts draw nothing
            self.blocks = nn.ModuleList(
                BLOCKS.build(layer, d_model=cfg.d_model, layer_idx=i, plan=plan)
                for i, layer in enumerate(cfg.expanded_layers())
            )
        self.norm = build_norm(cfg.final_norm, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        if initialise and not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, materialize: Callable[[nn.Module], ContextManager] | None = None) -> None:
        """Normal(0, std) for linear and embedding weights, output projections of residual branches scaled by
        out_scale so the residual stream's variance does not grow with depth (`ModelConfig.init` picks both:
        GPT-2's or GPT-NeoX's). A submodule with an `init_weights(std, out_scale)` method initialises its own
        parameters after that. `materialize(module)`, if given, holds a module's parameters while it is
        initialised (partitioned parameters: distributed/zero3.py)."""
        hold = materialize or (lambda module: contextlib.nullcontext())
        std, out_scale = self.cfg.init_scales(len(self.blocks))
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scale = out_scale if name.endswith(("w_o", "w_out", "w2")) else 1.0
                with hold(module):
                    normal_(module.weight, std=std * scale)  # a stacked expert shard: its rows of all experts
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
        # Modules with parameters of their own kind (stacked experts, routers, SSM) initialise those themselves.
        done: list[str] = []
        for name, module in self.named_modules():
            if name and callable(getattr(module, "init_weights", None)) and not any(
                name.startswith(prefix + ".") for prefix in done
            ):
                with hold(module):
                    module.init_weights(std, out_scale)
                done.append(name)

    def embed_tokens(self, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids_BT)
        if self.cfg.embedding_scale:
            # sqrt(d) in the embeddings' dtype, as Gemma's releases round it (bf16: sqrt(3072) = 55.43 -> 55.5)
            x = x * torch.tensor(math.sqrt(self.cfg.d_model), dtype=x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions_BT)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        cache: list[Any] | None = None,
        positions: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T] -> logits [B, T, V]; labels [B, T] are next tokens (IGNORE_INDEX to skip).

        With `cache` (from `new_cache()`) the tokens continue the cached ones; positions default to following on.
        """
        B, T = input_ids.shape
        if positions is None:
            start = cache_length(cache)
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids, positions)
        aux_losses: dict[str, torch.Tensor] = {}
        stats: dict[str, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            out = block(x, positions_BT=positions, cache=None if cache is None else cache[i])
            x = out.x
            aux_losses.update({f"layers.{i}.{k}": v for k, v in out.aux_losses.items()})
            stats.update({f"layers.{i}.{k}": v for k, v in out.stats.items()})
        if cache is not None:
            cache.length += T
        logits = self.head(self.norm(x))
        if labels is None:
            return CausalLMOutput(loss=None, logits=logits, aux_losses=aux_losses, stats=stats)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        loss = ce + sum(aux_losses.values()) if aux_losses else ce
        return CausalLMOutput(loss=loss, logits=logits, ce_loss=ce, aux_losses=aux_losses, stats=stats)

    def new_cache(self) -> list[Any]:
        """Per-layer decoding caches (KV caches, SSM states), plus the number of tokens seen."""
        return DecodeCache(block.new_cache() for block in self.blocks)


class DecodeCache(list):
    """A list of per-layer caches; `length` counts the tokens already decoded."""

    length: int = 0


def cache_length(cache: list[Any] | None) -> int:
    return getattr(cache, "length", 0) if cache is not None else 0


def build_model(cfg: ModelConfig, *, plan: ExpertParallelPlan = SINGLE_PROCESS, initialise: bool = True) -> CausalLM:
    """The model, with the experts `plan` holds of every routed stage (models/plan.py `plan_for`; all of them on
    one process). `initialise=False` leaves the weights to a later `init_weights` call (the trainer's, after
    reseeding)."""
    return CausalLM(cfg, initialise=initialise, plan=plan)
