"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, section 2.1; DeepSeek-V3).

# B batch, T query tokens, S key tokens, H heads, D model dim, Q q_lora_rank, C kv_lora_rank,
# N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim

    query:  q = W_q x                                  (q_lora_rank null)
            q = W_qb RMSNorm(W_qa x)                   (low-rank query, V2 eq. 12-13)        [B, H, T, N + R]
    latent: [c | k_rot] = W_kva x,  c = RMSNorm(c)    (the compressed key-value c [C] and one rotary key [R]
                                                       shared by all heads, eq. 9 and 14)
    keys and values from the latent: [k_nope | v] = W_kvb c  per head                       [B, H, S, N], [B, H, S, V]
    k = [k_nope | RoPE(k_rot)],  q = [q_nope | RoPE(q_rot)]   (decoupled RoPE, eq. 14-17)
    o = W_o softmax(q k^T scale + causal mask) v,  scale = (N + R)^-1/2 x softmax_mscale(rope)

With YaRN (`rope.yarn`), the rotary tables carry YaRN's attention factor and the softmax scale its
mscale(factor, mscale_all_dim)^2 (layers/rope.py), as transformers' DeepseekV3Attention computes them.

Decoding keeps the latent, not per-head keys and values: the cache holds c and RoPE(k_rot) per token, C + R
numbers where MHA keeps 2 H (N + R) (or V): the point of MLA. The keys and values of the cached tokens are
expanded from it at every step (the plain formulation; the absorbed one folds W_kvb into q and W_o).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moep_ds.layers.attention import KVCache, causal_attention
from moep_ds.layers.norm import NormConfig, RMSNorm
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_tables, softmax_mscale, table_dtype
from moep_ds.registry import ATTENTIONS
from moep_ds.schema import PositiveFloat, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class MLAConfig:
    type: str = "mla"
    num_heads: PositiveInt
    q_lora_rank: PositiveInt | None = None  # Q; null: a full-rank query projection (DeepSeek-V2-Lite)
    kv_lora_rank: PositiveInt  # C
    qk_nope_head_dim: PositiveInt  # N
    qk_rope_head_dim: PositiveInt  # R: the decoupled rotary key's dims, shared by all heads
    v_head_dim: PositiveInt  # V
    norm_eps: PositiveFloat = 1e-6  # of the RMSNorms on the compressed query and key-value
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)

    def validate(self, path: str) -> None:
        if self.qk_rope_head_dim % 2:
            fail(f"{path}.qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
        if self.rope.fraction != 1.0:
            fail(f"{path}.rope.fraction", self.rope.fraction, "must be 1.0 for MLA (qk_rope_head_dim is the rotated part)")

    def check_dims(self, path: str, d_model: int) -> None:
        self.validate(path)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentCache(KVCache):
    """The decoding cache of MLA: `k_BGSd` holds the normalised latent c [B, 1, S, C], `v_BGSd` the rotated shared
    key [B, 1, S, R] (one 'head' each, so KVCache's append serves)."""


@ATTENTIONS.register("mla", config=MLAConfig)
class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        H, norm = cfg.num_heads, NormConfig(type="rmsnorm", eps=cfg.norm_eps)
        if cfg.q_lora_rank is None:
            self.w_q = nn.Linear(d_model, H * cfg.qk_head_dim, bias=False)
        else:
            self.w_q_a = nn.Linear(d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(norm, cfg.q_lora_rank)
            self.w_q_b = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.w_kv_a = nn.Linear(d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(norm, cfg.kv_lora_rank)
        self.w_kv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.w_o = nn.Linear(H * cfg.v_head_dim, d_model, bias=False)
        self.scale = cfg.qk_head_dim ** -0.5 * softmax_mscale(cfg.rope)

    def query(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """[B, H, T, N + R] before RoPE."""
        B, T, _ = x_BTD.shape
        q = self.w_q(x_BTD) if self.cfg.q_lora_rank is None else self.w_q_b(self.q_norm(self.w_q_a(x_BTD)))
        return q.view(B, T, self.cfg.num_heads, self.cfg.qk_head_dim).transpose(1, 2)

    def keys_values(self, c_B1SC: torch.Tensor, k_rot_B1SR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, H, S, N + R] and values [B, H, S, V] from the (cached) latent and rotary key."""
        cfg = self.cfg
        B, _, S, _ = c_B1SC.shape
        kv = self.w_kv_b(c_B1SC[:, 0]).view(B, S, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope_BHSN, v_BHSV = kv.transpose(1, 2).split([cfg.qk_nope_head_dim, cfg.v_head_dim], -1)
        k_BHSd = torch.cat([k_nope_BHSN, k_rot_B1SR.expand(B, cfg.num_heads, S, cfg.qk_rope_head_dim)], -1)
        return k_BHSd, v_BHSV

    def forward(self, x_BTD: torch.Tensor, positions_BT: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        q_nope_BHTN, q_rot_BHTR = self.query(x_BTD).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        c_BTC, k_rot_BTR = self.w_kv_a(x_BTD).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        c_B1TC = self.kv_norm(c_BTC)[:, None]
        cos, sin = rope_tables(positions_BT, cfg.qk_rope_head_dim, cfg.rope, table_dtype(x_BTD))
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        q_BHTd = torch.cat([q_nope_BHTN, apply_rope(q_rot_BHTR, cos, sin)], -1)
        k_rot_B1TR = apply_rope(k_rot_BTR[:, None], cos, sin)
        k_pos = positions_BT
        if cache is not None:
            c_B1TC, k_rot_B1TR, k_pos = cache.append(c_B1TC, k_rot_B1TR, positions_BT)
        k_BHSd, v_BHSV = self.keys_values(c_B1TC, k_rot_B1TR)
        out = causal_attention(q_BHTd, k_BHSd, v_BHSV, positions_BT, k_pos, scale=self.scale)
        return self.w_o(out.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.v_head_dim))

    def new_cache(self) -> LatentCache:
        return LatentCache()

    def cache_numbers_per_token(self) -> int:
        """What the cache keeps per token and layer: C + R (MHA: 2 H Dh)."""
        return self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs of the score (N + R dims) and value (V dims) matmuls per token: 6 H (N + R + V) T,
        PaLM's 12 H Dh T when both are Dh."""
        return 6.0 * self.cfg.num_heads * (self.cfg.qk_head_dim + self.cfg.v_head_dim) * seq_len


__all__ = ["LatentCache", "MLAConfig", "MultiHeadLatentAttention"]
