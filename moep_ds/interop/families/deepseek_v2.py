"""DeepSeek-V2 (DeepseekV2ForCausalLM): DeepSeek-V3's attention, dense layers and shared experts (deepseek_v3.py);
softmax scores, no selection bias, topk_method greedy or group_limited_greedy (a group scored by its largest score:
router.group_score max), no renormalisation, routed_scaling_factor; its rotary rows always interleaved (complex
pairs).
"""
from __future__ import annotations

from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Raw
from moep_ds.interop.families.deepseek_v3 import DeepseekV3
from moep_ds.interop.moe_layout import parts_of

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2(DeepseekV3):
    model_type = "deepseek_v2"
    hf_class = "DeepseekV2ForCausalLM"
    refused = {"attention_bias": False, "mlp_bias": False, "moe_layer_freq": 1, "scoring_func": "softmax",
               "norm_topk_prob": False}

    def router(self, hf: Raw, num_moe: int) -> Raw:
        """DeepseekV2TopkRouter: softmax in fp32 over all experts, the top-k (greedy) or the top-k within the
        topk_group groups of largest maximum score (group_limited_greedy), times routed_scaling_factor, never
        renormalised (transformers 5 reads no norm_topk_prob for V2: a config with it true is refused)."""
        method = hf.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise UserError(f"config.json: topk_method = {method!r} (deepseek_v2) has no moep_ds counterpart "
                            f"(supported: {', '.join(TOPK_METHODS)})")
        groups = (hf.get("n_group") or 1) if method == "group_limited_greedy" else 1
        grouping = {"num_groups": groups, "group_topk": hf.get("topk_group") or groups, "group_score": "max"}
        return {"type": "topk", "k": hf["num_experts_per_tok"], "score": "softmax", "renormalize": False,
                "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), **(grouping if groups > 1 else {}),
                **self.balancing(hf)}

    def rope_interleaved(self, hf: Raw) -> bool:
        return True  # V2 rotates complex pairs

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        # no group limit is "greedy"; V2 has no norm_topk_prob of its own (the round trip compares renormalize)
        return {**self.mla_hf(p), "topk_method": "group_limited_greedy" if p.moe.router.num_groups > 1 else "greedy",
                "scoring_func": "softmax", "norm_topk_prob": False}


ADAPTER = DeepseekV2()
