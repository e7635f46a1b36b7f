"""OLMoE (OlmoeForCausalLM): every FFN an MoE, softmax top-k (renormalised if norm_topk_prob), RMSNorm over the
whole q and k projections; clip_qkv refused.
"""
from __future__ import annotations

from typing import Any

from moep_ds.interop.adapter import Raw
from moep_ds.interop.moe_layout import (MoEFamily, causal_attention, causal_hf, common_hf, moe_hf, parts_of,
                                        softmax_router)


class Olmoe(MoEFamily):
    model_type = "olmoe"
    hf_class = "OlmoeForCausalLM"
    refused = {"clip_qkv": None}

    def attention(self, hf: Raw) -> Raw:
        return causal_attention(hf, self.model_type,
                                qk_norm={"scope": "projection", "eps": hf.get("rms_norm_eps", 1e-5)})

    def router(self, hf: Raw, num_moe: int) -> Raw:
        return softmax_router(hf, num_moe, bool(hf.get("norm_topk_prob", False)), 0.01)

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        return {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_experts", "intermediate_size"),
                "attention_bias": p.attention.bias, "clip_qkv": None}


ADAPTER = Olmoe()
