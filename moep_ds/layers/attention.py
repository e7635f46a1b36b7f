"""Causal self-attention through `scaled_dot_product_attention`: MHA/GQA, optional sliding window, KV cache,
optional RMSNorm on queries and keys (QK-norm), biases on q/k/v alone (Qwen2) and a gated output (Qwen3-Next).

# B batch, T query tokens, S key tokens, H query heads, G key/value heads, Dh head dim, D model dim

A key at position s is visible from a query at position t iff s <= t and, with a window w, t - w < s.

QK-norm (before RoPE): `scope: head` normalises each head's Dh dims with one [Dh] scale shared by the heads
(Qwen3's q_norm / k_norm), `scope: projection` the whole H Dh (G Dh) projection with an [H Dh] ([G Dh]) scale
(OLMoE's). `type: gemma_rmsnorm` scales by (1 + w), w starting at zero (Qwen3-Next's Qwen3NextRMSNorm).

Output gate (Qwen3-Next; Qiu et al. 2025, "Gated Attention for Large Language Models"): the query rows of w_qkv
hold, per head, Dh query rows then Dh gate rows ([q_0 | g_0 | q_1 | g_1 | ...], Qwen3NextAttention's q_proj as
stored), and the heads' output is multiplied by sigmoid(g) before w_o.

Attention sinks (`sinks: true`, gpt-oss): each head h has a learned logit s_h that joins every query's softmax as
one more column and is dropped after it, so a query may put probability mass on "nothing" (`sink_attention`).
SDPA takes no such column: with sinks the scores are computed in full ([B, H, T, S], O(T S) memory).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.deferred_init import init_at_construction
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_tables, rotary_dims, table_dtype
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.registry import ATTENTIONS
from moep_ds.schema import PositiveFloat, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class QKNormConfig:
    scope: Literal["head", "projection"] = "head"  # see the module docstring
    type: Literal["rmsnorm", "gemma_rmsnorm"] = "rmsnorm"  # gemma_rmsnorm: (1 + w) scale, w from zero
    eps: PositiveFloat = 1e-6


@dataclasses.dataclass(kw_only=True)
class AttentionConfig:
    type: str = "causal"
    num_heads: PositiveInt
    num_kv_heads: PositiveInt | None = None  # null: = num_heads (MHA); fewer: grouped-query attention
    head_dim: PositiveInt | None = None  # null: d_model / num_heads
    window: PositiveInt | None = None  # sliding window in tokens, the query included; null: unbounded
    rope: RopeConfig | None = None  # null: no rotary embedding (e.g. GPT-2's learned positions)
    bias: bool = False
    qkv_bias: bool | None = None  # biases on q, k, v; null: = bias (Qwen2: true, with bias false on the output)
    qk_norm: QKNormConfig | None = None  # null: none
    sinks: bool = False  # a learned per-head sink logit in the softmax (module docstring; gpt-oss)
    output_gate: bool = False  # per head [query | gate] rows; output x sigmoid(gate) before w_o (module docstring)

    def validate(self, path: str) -> None:
        kv = self.kv_heads
        if self.num_heads % kv:
            fail(f"{path}.num_kv_heads", kv, f"must divide num_heads ({self.num_heads})")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def check_dims(self, path: str, d_model: int) -> None:
        if self.head_dim is None and d_model % self.num_heads:
            fail(f"{path}.num_heads", self.num_heads, f"must divide d_model ({d_model})")

    def resolved_head_dim(self, d_model: int) -> int:
        return self.head_dim or d_model // self.num_heads


@dataclasses.dataclass
class KVCache:
    """Keys/values of the tokens decoded so far, with their positions (for causal and window masks)."""

    k_BGSd: torch.Tensor | None = None
    v_BGSd: torch.Tensor | None = None
    pos_BS: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, pos_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.k_BGSd is None:
            self.k_BGSd, self.v_BGSd, self.pos_BS = k, v, pos_BT
        else:
            self.k_BGSd = torch.cat([self.k_BGSd, k], dim=2)
            self.v_BGSd = torch.cat([self.v_BGSd, v], dim=2)
            self.pos_BS = torch.cat([self.pos_BS, pos_BT], dim=1)
        return self.k_BGSd, self.v_BGSd, self.pos_BS


def attention_mask(q_pos_BT: torch.Tensor, k_pos_BS: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, T, S]: True where the query may attend to the key."""
    delta = q_pos_BT[:, :, None] - k_pos_BS[:, None, :]
    mask = delta >= 0
    if window is not None:
        mask &= delta < window
    return mask[:, None]


def causal_attention(
    q_BHTd: torch.Tensor,
    k_BGSd: torch.Tensor,
    v_BGSd: torch.Tensor,
    q_pos_BT: torch.Tensor,
    k_pos_BS: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale + mask) v with G key/value heads shared by H/G query heads each; scale null:
    1 / sqrt(Dh). v may have a head dim of its own (MLA)."""
    plain_causal = window is None and q_BHTd.shape[2] == k_BGSd.shape[2]
    mask = None if plain_causal else attention_mask(q_pos_BT, k_pos_BS, window)
    # Every query sees at least itself, so no row of the mask is empty.
    return F.scaled_dot_product_attention(
        q_BHTd, k_BGSd, v_BGSd, attn_mask=mask, is_causal=plain_causal, scale=scale,
        enable_gqa=q_BHTd.shape[1] != k_BGSd.shape[1],
    )


def sink_attention(
    q_BHTd: torch.Tensor,
    k_BGSd: torch.Tensor,
    v_BGSd: torch.Tensor,
    q_pos_BT: torch.Tensor,
    k_pos_BS: torch.Tensor,
    window: int | None,
    sinks_H: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """causal_attention with a sink column: p = softmax([q k^T scale + mask, s_h]) over S + 1 entries, out =
    p[..., :S] v (gpt-oss's eager_attention_forward). The softmax runs in fp32 (or wider)."""
    B, H, T, Dh = q_BHTd.shape
    groups = H // k_BGSd.shape[1]
    k_BHSd, v_BHSd = k_BGSd.repeat_interleave(groups, 1), v_BGSd.repeat_interleave(groups, 1)
    scores_BHTS = (q_BHTd @ k_BHSd.transpose(-1, -2)) * (Dh ** -0.5 if scale is None else scale)
    scores_BHTS = scores_BHTS.masked_fill(~attention_mask(q_pos_BT, k_pos_BS, window), float("-inf"))
    sink_BHT1 = sinks_H.to(scores_BHTS.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    logits = torch.cat([scores_BHTS, sink_BHT1], dim=-1)
    probs_BHTS = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)[..., :-1]
    return probs_BHTS.to(v_BHSd.dtype) @ v_BHSd


@ATTENTIONS.register("causal", config=AttentionConfig)
class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.kv_heads
        self.head_dim = cfg.resolved_head_dim(d_model)
        self.rot_dim = rotary_dims(self.head_dim, cfg.rope.fraction) if cfg.rope else 0
        q_rows = self.num_heads * self.head_dim * (2 if cfg.output_gate else 1)
        qkv_out = q_rows + 2 * self.num_kv_heads * self.head_dim
        self.w_qkv = nn.Linear(d_model, qkv_out, bias=cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias)
        self.w_o = nn.Linear(self.num_heads * self.head_dim, d_model, bias=cfg.bias)
        if cfg.qk_norm is not None:
            whole = cfg.qk_norm.scope == "projection"
            norm = NormConfig(type=cfg.qk_norm.type, eps=cfg.qk_norm.eps)
            self.q_norm = build_norm(norm, self.head_dim * (self.num_heads if whole else 1))
            self.k_norm = build_norm(norm, self.head_dim * (self.num_kv_heads if whole else 1))
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.sinks else None
        if self.sinks is not None and not self.sinks.is_meta and init_at_construction():
            self.init_weights(std=0.02)

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """The sinks normal(0, std) as transformers initialises gpt-oss's; the linear layers are the model's, the
        norms their own (CausalLM.init_weights skips the children of a module that has this method)."""
        if self.sinks is not None:
            nn.init.normal_(self.sinks, std=std)
        for child in self.children():
            if callable(getattr(child, "init_weights", None)):
                child.init_weights(std, out_scale)

    def forward(self, x_BTD: torch.Tensor, positions_BT: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q, gate, k, v = self.projections(x_BTD)
        q, k = self.normed_qk(q, k)
        q_BHTd = q.reshape(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGTd = k.reshape(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BGTd = v.reshape(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rot_dim:
            cos, sin = rope_tables(positions_BT, self.rot_dim, self.cfg.rope, table_dtype(x_BTD))
            cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
            q_BHTd, k_BGTd = apply_rope(q_BHTd, cos, sin), apply_rope(k_BGTd, cos, sin)
        k_pos = positions_BT
        if cache is not None:
            k_BGTd, v_BGTd, k_pos = cache.append(k_BGTd, v_BGTd, positions_BT)
        if self.sinks is None:
            out = causal_attention(q_BHTd, k_BGTd, v_BGTd, positions_BT, k_pos, self.cfg.window)
        else:
            out = sink_attention(q_BHTd, k_BGTd, v_BGTd, positions_BT, k_pos, self.cfg.window, self.sinks)
        return self.w_o(gated(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim), gate))

    def projections(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """q [B, T, H Dh], the output gate [B, T, H Dh] (None without one), k and v [B, T, G Dh]."""
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        if not self.cfg.output_gate:
            q, k, v = self.w_qkv(x_BTD).split([H * Dh, G * Dh, G * Dh], -1)
            return q, None, k, v
        qg, k, v = self.w_qkv(x_BTD).split([2 * H * Dh, G * Dh, G * Dh], -1)
        q, gate = qg.unflatten(-1, (H, 2 * Dh)).chunk(2, dim=-1)  # each head's rows: [query | gate]
        return q.flatten(-2), gate.flatten(-2), k, v

    def normed_qk(self, q_BTX: torch.Tensor, k_BTY: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm of the projections (module docstring); unchanged without it."""
        if self.cfg.qk_norm is None:
            return q_BTX, k_BTY
        if self.cfg.qk_norm.scope == "projection":
            return self.q_norm(q_BTX), self.k_norm(k_BTY)
        return (self.q_norm(q_BTX.unflatten(-1, (-1, self.head_dim))),
                self.k_norm(k_BTY.unflatten(-1, (-1, self.head_dim))))

    def new_cache(self) -> KVCache:
        return KVCache()

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs of the score and value matmuls per token (PaLM's 12·H·Dh·T convention)."""
        return attention_flops(self.num_heads, self.head_dim, seq_len, self.cfg.window)


def gated(out_BTX: torch.Tensor, gate_BTX: torch.Tensor | None) -> torch.Tensor:
    """The heads' output times sigmoid(gate) (the output gate), unchanged without one."""
    return out_BTX if gate_BTX is None else out_BTX * torch.sigmoid(gate_BTX)


def attention_flops(num_heads: int, head_dim: int, seq_len: int, window: int | None) -> float:
    """Forward+backward FLOPs per token of the score and value matmuls: 12 H Dh x context (PaLM)."""
    ctx = min(seq_len, window) if window else seq_len
    return 12.0 * num_heads * head_dim * ctx


def build_attention(cfg: AttentionConfig, d_model: int) -> nn.Module:
    return ATTENTIONS.build(cfg, d_model)

