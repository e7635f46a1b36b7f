"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (layers/mla.py, YaRN); sigmoid scores,
e_score_correction_bias = our loss-free balancing bias (routing/balancing.py), group-limited choice (n_group,
topk_group), norm_topk_prob, routed_scaling_factor; n_shared_experts as one ungated shared FFN; the first
first_k_dense_replace layers dense; the multi-token-prediction layers (num_nextn_predict_layers after the last
layer) are no weights of the model (transformers leaves them unread too).

# H heads, R rotary head dim, N / V MLA's nope / value head dims

DeepSeek's rotary rows are interleaved (V3's rope_interleave, V2's complex pairs: pair 2i, 2i + 1); ours rotate i
with i + R/2: the rope rows of q_proj / q_b_proj (each head's last R) and of kv_a_proj_with_mqa (its last R) are
permuted on the way in and back on the way out, exactly. DeepSeek-V2 (deepseek_v2.py) builds on this module.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from moep_ds.interop.adapter import Raw
from moep_ds.interop.moe_layout import MoEFamily, Parts, common_hf, moe_hf, parts_of, rope_of
from moep_ds.interop.rules import Rule, permuted, same

LOSS_FREE_RATE = 0.001  # DeepSeek-V3's bias update speed (section 2.1.2), for training to continue the bias


def rope_rows(total: int, block: int, rope: int, interleaved: bool) -> torch.Tensor | None:
    """Our row j <- their row perm[j]: in each block of `block` rows the last `rope` ones de-interleaved
    ([0, 2, 4, ..., 1, 3, 5, ...]); None without interleaving."""
    if not interleaved:
        return None
    inner = torch.arange(block)
    inner[block - rope:] = block - rope + torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    return (torch.arange(0, total, block)[:, None] + inner).reshape(-1)


def mla_rules(att: Any, ours: str, theirs: str, interleaved: bool) -> list[Rule]:
    H, d, R = att.num_heads, att.qk_head_dim, att.qk_rope_head_dim
    q_perm = rope_rows(H * d, d, R, interleaved)
    kv_perm = rope_rows(att.kv_lora_rank + R, att.kv_lora_rank + R, R, interleaved)
    if att.q_lora_rank is None:
        query = [permuted(f"{ours}.w_q.weight", f"{theirs}.q_proj.weight", q_perm)]
    else:
        query = [same(f"{ours}.w_q_a.weight", f"{theirs}.q_a_proj.weight"),
                 same(f"{ours}.q_norm.weight", f"{theirs}.q_a_layernorm.weight"),
                 permuted(f"{ours}.w_q_b.weight", f"{theirs}.q_b_proj.weight", q_perm)]
    return [*query, permuted(f"{ours}.w_kv_a.weight", f"{theirs}.kv_a_proj_with_mqa.weight", kv_perm),
            same(f"{ours}.kv_norm.weight", f"{theirs}.kv_a_layernorm.weight"),
            same(f"{ours}.w_kv_b.weight", f"{theirs}.kv_b_proj.weight"),
            same(f"{ours}.w_o.weight", f"{theirs}.o_proj.weight")]


class DeepseekV3(MoEFamily):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    shared_prefix = "shared_experts"
    refused = {"attention_bias": False, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    expert_hidden_key = "moe_intermediate_size"

    def sparse(self, hf: Raw) -> list[bool]:
        return [i >= (hf.get("first_k_dense_replace") or 0) for i in range(hf["num_hidden_layers"])]

    def attention(self, hf: Raw) -> Raw:
        """DeepseekV3Attention; its q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps 1e-6."""
        return {"type": "mla", "num_heads": hf["num_attention_heads"], "q_lora_rank": hf.get("q_lora_rank"),
                "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
                "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"], "norm_eps": 1e-6,
                "rope": rope_of(hf, self.model_type, yarn=True)}

    def router(self, hf: Raw, num_moe: int) -> Raw:
        groups = hf.get("n_group") or 1
        return {"type": "topk", "k": hf["num_experts_per_tok"], "score": "sigmoid",
                "renormalize": bool(hf.get("norm_topk_prob", True)),
                "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), "bias_update_rate": LOSS_FREE_RATE,
                "num_groups": groups, "group_topk": hf.get("topk_group") or groups, **self.balancing(hf)}

    @staticmethod
    def balancing(hf: Raw) -> Raw:
        """The original configs' aux_loss_alpha / seq_aux (transformers reads neither; a training setting)."""
        return {"load_balancing_weight": float(hf.get("aux_loss_alpha") or 0.0),
                "load_balancing_scope": "sequence" if hf.get("seq_aux") else "micro_batch", "capacity_factor": None}

    def shared(self, hf: Raw) -> Raw | None:
        return ({"hidden_size": hf["moe_intermediate_size"] * hf["n_shared_experts"], "gate": "none"}
                if hf.get("n_shared_experts") else None)

    def rope_interleaved(self, hf: Raw) -> bool:
        """Whether a checkpoint of config.json `hf` stores its rotary rows in pairs 2i, 2i + 1."""
        return bool(hf.get("rope_interleave", True))

    def attention_rules(self, att: Any, ours: str, theirs: str, hf: Raw, d_model: int) -> list[Rule]:
        return mla_rules(att, ours, theirs, self.rope_interleaved(hf))

    def ignored(self, hf: Raw) -> re.Pattern:
        """Older checkpoints' rotary buffers and the multi-token-prediction layers."""
        layers, extra = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
        mtp = "|".join(str(i) for i in range(layers, layers + extra))
        return re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq" +
                          (rf"|model\.layers\.({mtp})\..*" if mtp else ""))

    def to_hf(self, model_cfg: Any) -> Raw:
        return {**self.mla_hf(parts_of(model_cfg)), "rope_interleave": True, "num_nextn_predict_layers": 0}

    @classmethod
    def mla_hf(cls, p: Parts) -> Raw:
        """What DeepSeek-V3 and V2 write alike: MLA, the dense layers first, groups, shared experts."""
        att = p.attention
        return {**common_hf(p, "mla"), **cls.moe_keys_hf(p), "num_key_value_heads": att.num_heads,
                "q_lora_rank": att.q_lora_rank, "kv_lora_rank": att.kv_lora_rank,
                "qk_nope_head_dim": att.qk_nope_head_dim, "qk_rope_head_dim": att.qk_rope_head_dim,
                "v_head_dim": att.v_head_dim, "attention_bias": False}

    @staticmethod
    def moe_keys_hf(p: Parts) -> Raw:
        """DeepSeek's MoE in config.json (GLM-4.5's too): routed and shared experts, groups, scaling, the dense
        layers first."""
        out = moe_hf(p, "n_routed_experts", "moe_intermediate_size")
        out.pop("router_aux_loss_coef")
        router, shared = p.moe.router, p.moe.shared_expert
        out.update(first_k_dense_replace=next((i for i, s in enumerate(p.sparse) if s), len(p.layers)),
                   n_group=router.num_groups, topk_group=router.kept_groups(),
                   routed_scaling_factor=router.scaling_factor,
                   n_shared_experts=shared.hidden_size // p.moe.expert.hidden_size if shared is not None else 0)
        if p.dense_ffn is None:  # every layer an MoE: the (unused) dense size of the config's default
            out["intermediate_size"] = p.moe.expert.hidden_size
        return out


ADAPTER = DeepseekV3()
