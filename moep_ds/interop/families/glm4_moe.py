"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): DeepSeek-V3's MoE (deepseek_v3.py) over grouped-query attention.

    MoE          as DeepSeek-V3: sigmoid scores, e_score_correction_bias = our loss-free balancing bias, group-limited
                 choice (n_group, topk_group; a group scored by its two best), norm_topk_prob, routed_scaling_factor,
                 n_shared_experts as one ungated shared FFN, the first first_k_dense_replace layers dense; router
                 logits in fp32; the multi-token-prediction layers (num_nextn_predict_layers after the last layer)
                 are no weights of the model, as transformers leaves them unread
    attention    GQA, biases on q, k and v (attention_bias) and none on o; RMSNorm per head on q and k before RoPE
                 (use_qk_norm, eps rms_norm_eps); RoPE on the first partial_rotary_factor of each head's dims (0.5
                 where config.json says nothing, as Glm4MoeConfig defaults it), rotate_half over those dims as ours:
                 the rows are read as stored

# Dh head dim, R rotary dims
"""
from __future__ import annotations

from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Inexpressible, Raw
from moep_ds.interop.families.deepseek_v3 import DeepseekV3
from moep_ds.interop.moe_layout import causal_attention, causal_hf, causal_rules, common_hf, parts_of
from moep_ds.interop.rules import Rule

DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's partial_rotary_factor where config.json has none
DEFAULT_EPS = 1e-5  # Glm4MoeConfig's rms_norm_eps


class Glm4Moe(DeepseekV3):
    model_type = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"
    refused: dict[str, Any] = {}

    def attention(self, hf: Raw) -> Raw:
        eps = hf.get("rms_norm_eps", DEFAULT_EPS)
        att = causal_attention(hf, self.model_type, partial=DEFAULT_PARTIAL_ROTARY,
                               qk_norm={"scope": "head", "eps": eps} if hf.get("use_qk_norm") else None)
        R = att["head_dim"] * att["rope"]["fraction"]
        if int(R) % 2:  # transformers rotates int(Dh x factor) dims, we an even number of them
            raise UserError(f"config.json: partial_rotary_factor = {att['rope']['fraction']!r} of head_dim "
                            f"{att['head_dim']} rotates {int(R)} dims ({self.model_type}); moep_ds rotates an even "
                            "number")
        return {**att, "bias": False, "qkv_bias": bool(hf.get("attention_bias", False))}

    def attention_rules(self, att: Any, ours: str, theirs: str, hf: Raw, d_model: int) -> list[Rule]:
        return causal_rules(att, ours, theirs, d_model)

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        att = p.attention
        if att.type == "causal" and att.bias:
            raise Inexpressible("model.layers[*].attention.bias: true in the model (glm4_moe's attention_bias puts "
                                "biases on q, k and v only, none on o)")
        if att.rope is not None and att.rope.yarn is not None:
            raise Inexpressible("model.layers[*].attention.rope.yarn: set in the model (glm4_moe reads plain RoPE)")
        out = {**common_hf(p, "causal"), **causal_hf(p), **self.moe_keys_hf(p),
               "attention_bias": att.bias if att.qkv_bias is None else att.qkv_bias,
               "use_qk_norm": att.qk_norm is not None, "num_nextn_predict_layers": 0}
        out["rope_parameters"]["partial_rotary_factor"] = att.rope.fraction
        return out


ADAPTER = Glm4Moe()
