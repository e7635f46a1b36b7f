"""Mixtral (MixtralForCausalLM): every FFN an MoE (block_sparse_moe, experts w1 / w3 / w2), softmax top-k
renormalised, router jitter, optional sliding window; RMSNorm, GQA, no biases.
"""
from __future__ import annotations

from typing import Any

from moep_ds.interop.adapter import Raw
from moep_ds.interop.moe_layout import (MoEFamily, causal_attention, causal_hf, common_hf, moe_hf, parts_of,
                                        softmax_router)


class Mixtral(MoEFamily):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def attention(self, hf: Raw) -> Raw:
        return causal_attention(hf, self.model_type, window=hf.get("sliding_window"))

    def router(self, hf: Raw, num_moe: int) -> Raw:
        return {**softmax_router(hf, num_moe, True, 0.001), "jitter": float(hf.get("router_jitter_noise") or 0.0)}

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        out = {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_local_experts", "intermediate_size"),
               "sliding_window": p.attention.window, "router_jitter_noise": p.moe.router.jitter}
        out.pop("norm_topk_prob")  # Mixtral always renormalises
        return out


ADAPTER = Mixtral()
