"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2-MoE's routing and dense layers (qwen2_moe.py), no shared expert, RMSNorm
per head on q and k (before RoPE), attention_bias for all projections.
"""
from __future__ import annotations

from typing import Any

from moep_ds.interop.adapter import Raw
from moep_ds.interop.families.qwen2_moe import Qwen2Moe
from moep_ds.interop.moe_layout import causal_attention, parts_of


class Qwen3Moe(Qwen2Moe):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    shared_prefix = None

    def attention(self, hf: Raw) -> Raw:
        return causal_attention(hf, self.model_type, qk_norm={"scope": "head", "eps": hf.get("rms_norm_eps", 1e-6)})

    def shared(self, hf: Raw) -> Raw | None:
        return None

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        return {**self.qwen_hf(p), "attention_bias": p.attention.bias}


ADAPTER = Qwen3Moe()
