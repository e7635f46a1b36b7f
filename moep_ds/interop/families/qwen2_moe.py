"""Qwen2-MoE (Qwen2MoeForCausalLM): softmax top-k (renormalised if norm_topk_prob), one shared expert scaled by
sigmoid(x . w) (shared_expert_gate); biases on q, k, v only (qkv_bias); dense layers: mlp_only_layers, and all but
every decoder_sparse_step-th layer.
"""
from __future__ import annotations

from typing import Any

from moep_ds.interop.adapter import Raw
from moep_ds.interop.moe_layout import (MoEFamily, Parts, causal_attention, causal_hf, common_hf, moe_hf, num_experts,
                                        parts_of, softmax_router)


class Qwen2Moe(MoEFamily):
    model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"
    shared_prefix = "shared_expert"
    refused = {"use_sliding_window": False}
    expert_hidden_key = "moe_intermediate_size"

    def sparse(self, hf: Raw) -> list[bool]:
        """An MoE unless in mlp_only_layers, every decoder_sparse_step-th layer (Qwen2/3-MoE's decoder layer)."""
        step, only_mlp = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
        experts = num_experts(hf)
        return [i not in only_mlp and experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]

    def attention(self, hf: Raw) -> Raw:
        return {**causal_attention(hf, self.model_type), "bias": False, "qkv_bias": bool(hf.get("qkv_bias", True))}

    def router(self, hf: Raw, num_moe: int) -> Raw:
        return softmax_router(hf, num_moe, bool(hf.get("norm_topk_prob", False)), 0.001)

    def shared(self, hf: Raw) -> Raw | None:
        return {"hidden_size": hf["shared_expert_intermediate_size"], "gate": "sigmoid"}

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        gate, att = p.moe.shared_expert if p.moe is not None else None, p.attention
        return {**self.qwen_hf(p), "shared_expert_intermediate_size": gate.hidden_size if gate is not None else 0,
                "qkv_bias": att.bias if att.qkv_bias is None else att.qkv_bias}

    @staticmethod
    def qwen_hf(p: Parts) -> Raw:
        """What Qwen2-MoE and Qwen3-MoE write alike: every dense layer in mlp_only_layers."""
        return {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_experts", "moe_intermediate_size"),
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i, s in enumerate(p.sparse) if not s],
                "use_sliding_window": False}


ADAPTER = Qwen2Moe()
