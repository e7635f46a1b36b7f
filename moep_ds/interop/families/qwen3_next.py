"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet and gated full attention, each layer's FFN an MoE
with a sigmoid-gated shared expert, all norms zero-centred ((1 + w) RMSNorm). transformers' modeling_qwen3_next.py
and configuration_qwen3_next.py are the reference (transformers 5).

# E experts, D model dim, H query heads, G key/value heads, Dh head dim, F expert hidden dim

    layer_types[i]        linear_attention -> attention `gated_deltanet` (layers/gated_deltanet.py):
                          linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
                          linear_conv_kernel_dim; its conv activation is hidden_act (silu only), its gated RMSNorm
                          eps rms_norm_eps
                          full_attention -> `causal` GQA with the output gate, QK-norm per head of type gemma_rmsnorm,
                          rotary on partial_rotary_factor of each head's dims (rotate_half over the first R, as ours)
                          no layer_types: every full_attention_interval-th layer (default 4) full, as transformers
                          reads it
    mlp                   an MoE unless in mlp_only_layers, every decoder_sparse_step-th layer (Qwen2/3-MoE's rule):
                          softmax top-k (renormalised if norm_topk_prob), one shared expert of
                          shared_expert_intermediate_size scaled by sigmoid(x . w) (shared_expert_gate)
    norms                 input_layernorm, post_attention_layernorm, norm: gemma_rmsnorm (the stored w is the offset)

Load balancing as the other Qwen families convert it: transformers adds coef x K x E sum f P over all MoE layers'
tokens pooled; ours is alpha x E sum f P per layer, summed, so alpha = router_aux_loss_coef x K / (MoE layers).

Tensors: every Gated DeltaNet parameter 1:1 (our layer keeps transformers' row layout: in_proj_qkvz grouped per key
head, conv1d [C, 1, W]); our w_qkv rows are [q_proj | k_proj | v_proj] with q_proj as stored (per head [query |
gate]); the experts as transformers 5 saves them, one gate / up / down tensor per expert, read per expert
(`expert_stack`) so that an expert-parallel rank reads its experts only. The multi-token-prediction weights (mtp.*)
of the released checkpoints are no weights of the model (transformers skips them too).
"""
from __future__ import annotations

import re
from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Family, Inexpressible, Raw
from moep_ds.interop.hf_layout import unsupported
from moep_ds.interop.moe_layout import mlp_rules, num_experts, repeated, softmax_router
from moep_ds.interop.rules import Rule, concatenated, expert_stack, same

OUR_LAYER_TYPES = {"causal": "full_attention", "gated_deltanet": "linear_attention"}
GDN_PARAMETERS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                  "out_proj.weight")


# ---- config.json -> recipe ------------------------------------------------------------------------------------


def layer_types(hf: Raw) -> list[str]:
    """config.json's layer_types, or transformers' default pattern from full_attention_interval; one line for an
    entry we cannot build."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval") or 4
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(kinds) != n:
        raise UserError(f"config.json: layer_types has {len(kinds)} entries, num_hidden_layers = {n} (qwen3_next)")
    for i, kind in enumerate(kinds):
        if kind not in ATTENTION_OF:
            raise UserError(f"config.json: layer_types[{i}] = {kind!r} (qwen3_next) has no moep_ds counterpart "
                            f"(supported: {', '.join(sorted(ATTENTION_OF))})")
    return list(kinds)


def rope(hf: Raw, head_dim: int) -> Raw:
    """Our rope section from rope_parameters (transformers 5) or the older rope_theta / partial_rotary_factor keys
    (the released config.json); plain RoPE only."""
    params = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e4)}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise UserError(f"config.json: rope type {kind!r} (qwen3_next) has no moep_ds counterpart (supported: "
                        "default)")
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))  # Qwen3NextConfig's default
    if int(head_dim * fraction) % 2:  # transformers would rotate an odd number of dims; ours an even one
        raise UserError(f"config.json: partial_rotary_factor = {fraction!r} (qwen3_next) rotates "
                        f"{int(head_dim * fraction)} of head_dim {head_dim} dims, an odd number")
    return {"base": float(params.get("rope_theta", hf.get("rope_theta", 1e4))), "fraction": float(fraction)}


def full_attention(hf: Raw, eps: float) -> Raw:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    return {"type": "causal", "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": head_dim, "rope": rope(hf, head_dim), "bias": bool(hf.get("attention_bias", False)),
            "qk_norm": {"scope": "head", "type": "gemma_rmsnorm", "eps": eps}, "output_gate": True}


def linear_attention(hf: Raw, eps: float) -> Raw:
    return {"type": "gated_deltanet", "num_k_heads": hf.get("linear_num_key_heads", 16),
            "num_v_heads": hf.get("linear_num_value_heads", 32), "head_k_dim": hf.get("linear_key_head_dim", 128),
            "head_v_dim": hf.get("linear_value_head_dim", 128), "conv_kernel": hf.get("linear_conv_kernel_dim", 4),
            "norm_eps": eps}


ATTENTION_OF = {"full_attention": full_attention, "linear_attention": linear_attention}  # layer_types -> our section


def sparse_layers(hf: Raw) -> list[bool]:
    """Qwen3NextDecoderLayer: an MoE unless in mlp_only_layers, every decoder_sparse_step-th layer."""
    step, only_mlp = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    experts = num_experts(hf)
    return [i not in only_mlp and experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def moe(hf: Raw, num_moe: int) -> Raw:
    """Qwen3NextSparseMoeBlock: Qwen2-MoE's router (Qwen3NextConfig's norm_topk_prob defaults to true) and its
    sigmoid-gated shared expert."""
    return {"num_experts": num_experts(hf), "expert": {"type": "swiglu", "hidden_size": hf["moe_intermediate_size"]},
            "router": softmax_router(hf, num_moe, bool(hf.get("norm_topk_prob", True)), 0.001),
            "shared_expert": {"hidden_size": hf["shared_expert_intermediate_size"], "gate": "sigmoid"}}


# ---- model -> config.json (the native export) -------------------------------------------------------------------


def attention_hf(layers: list[Any], d_model: int) -> Raw:
    """The full and linear attention keys, from the first layer of each kind; layer_types from every layer."""
    kinds = []
    for i, layer in enumerate(layers):
        if layer.type not in ("dense", "ffn_moe"):
            raise Inexpressible(f"model.layers (block {i}) is a {layer.type!r} block: Qwen3NextForCausalLM's are "
                                "dense and ffn_moe blocks")
        if layer.attention.type not in OUR_LAYER_TYPES:
            raise Inexpressible(f"model.layers[{i}].attention.type: {layer.attention.type!r} in the model (Qwen3-Next: "
                                f"{', '.join(OUR_LAYER_TYPES)})")
        kinds.append(OUR_LAYER_TYPES[layer.attention.type])
    out: Raw = {"layer_types": kinds}
    full = next((layer.attention for layer in layers if layer.attention.type == "causal"), None)
    if full is not None:
        if full.rope is None or full.rope.yarn is not None:
            raise Inexpressible("model.layers[*].attention.rope: Qwen3-Next's full attention is plain rotary")
        out.update(num_attention_heads=full.num_heads, num_key_value_heads=full.kv_heads,
                   head_dim=full.resolved_head_dim(d_model), attention_bias=full.bias,
                   rope_parameters={"rope_type": "default", "rope_theta": full.rope.base,
                                    "partial_rotary_factor": full.rope.fraction})
    linear = next((layer.attention for layer in layers if layer.attention.type == "gated_deltanet"), None)
    if linear is not None:
        out.update(linear_num_key_heads=linear.num_k_heads, linear_num_value_heads=linear.num_v_heads,
                   linear_key_head_dim=linear.head_k_dim, linear_value_head_dim=linear.head_v_dim,
                   linear_conv_kernel_dim=linear.conv_kernel)
    return out


def ffn_hf(layers: list[Any]) -> Raw:
    """The MoE keys from the first MoE layer, the dense layers as mlp_only_layers."""
    sparse = [layer.type == "ffn_moe" for layer in layers]
    dense = next((layer.ffn for layer in layers if layer.type == "dense"), None)
    out: Raw = {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, s in enumerate(sparse) if not s]}
    if dense is not None:
        out["intermediate_size"] = dense.hidden_size
    first = next((layer.moe for layer in layers if layer.type == "ffn_moe"), None)
    if first is None:
        return {**out, "num_experts": 0}
    router, shared = first.router, first.shared_expert
    if getattr(router, "type", None) != "topk":
        raise Inexpressible(f"model.layers[*].moe.router: a {router.type!r} router (Qwen3-Next routes top-k)")
    if shared is None:
        raise Inexpressible("model.layers[*].moe.shared_expert: null in the model (Qwen3-Next's MoE layers have a "
                            "sigmoid-gated shared expert)")
    return {**out, "num_experts": first.num_experts, "moe_intermediate_size": first.expert.hidden_size,
            "num_experts_per_tok": router.k, "norm_topk_prob": router.renormalize,
            "router_aux_loss_coef": router.load_balancing_weight * sum(sparse) / router.k,
            "shared_expert_intermediate_size": shared.hidden_size}


# ---- tensors ----------------------------------------------------------------------------------------------------


def attention_rules(att: Any, ours: str, theirs: str, d_model: int) -> list[Rule]:
    if att.type == "gated_deltanet":
        return [same(f"{ours}.{p}", f"{theirs}.linear_attn.{p}") for p in GDN_PARAMETERS]
    Dh, theirs = att.resolved_head_dim(d_model), f"{theirs}.self_attn"
    rows = [2 * att.num_heads * Dh, att.kv_heads * Dh, att.kv_heads * Dh]  # q_proj: per head [query | gate]
    kinds = ("weight", "bias")[:2 if att.bias else 1]
    return [*(concatenated(f"{ours}.w_qkv.{kind}", tuple(f"{theirs}.{p}_proj.{kind}" for p in "qkv"), rows)
              for kind in kinds),
            *(same(f"{ours}.w_o.{kind}", f"{theirs}.o_proj.{kind}") for kind in kinds),
            *(same(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in ("q_norm", "k_norm"))]


def ffn_rules(layer: Any, ours: str, theirs: str) -> list[Rule]:
    if layer.type == "dense":
        return mlp_rules(f"{ours}.ffn", f"{theirs}.mlp")
    moe, their_moe, E = f"{ours}.moe", f"{theirs}.mlp", layer.moe.num_experts
    experts = [expert_stack(f"{moe}.experts.{name}", [f"{their_moe}.experts.{e}.{proj}.weight" for e in range(E)])
               for name, proj in (("w1_EDF", "gate_proj"), ("w3_EDF", "up_proj"), ("w2_EFD", "down_proj"))]
    return [same(f"{moe}.router.weight", f"{their_moe}.gate.weight"), *experts,
            *mlp_rules(f"{moe}.shared.ffn", f"{their_moe}.shared_expert"),
            same(f"{moe}.shared.gate.weight", f"{their_moe}.shared_expert_gate.weight")]


class Qwen3Next(Family):
    model_type = "qwen3_next"
    hf_class = "Qwen3NextForCausalLM"

    def recipe(self, hf: Raw) -> Raw:
        unsupported(self.model_type, hf, {"quantization_config": None, "hidden_act": "silu"})
        eps = hf.get("rms_norm_eps", 1e-6)
        norm = {"type": "gemma_rmsnorm", "eps": eps}
        kinds = layer_types(hf)
        attention = {kind: ATTENTION_OF[kind](hf, eps) for kind in set(kinds)}  # the kinds present only
        sparse = sparse_layers(hf)
        ffn_moe = moe(hf, sum(sparse)) if any(sparse) else None
        dense_ffn = {"type": "swiglu", "hidden_size": hf.get("intermediate_size", 5632)}
        blocks = [{"type": "ffn_moe", "attention": attention[kind], "norm": norm, "moe": ffn_moe} if s else
                  {"type": "dense", "attention": attention[kind], "norm": norm, "ffn": dense_ffn}
                  for kind, s in zip(kinds, sparse)]
        return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
                "max_seq_len": hf.get("max_position_embeddings", 32768),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "position_embedding": "none",
                "final_norm": norm, "layers": repeated(blocks)}

    def to_hf(self, model_cfg: Any) -> Raw:
        layers = model_cfg.expanded_layers()
        return {"vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
                "num_hidden_layers": len(layers), "max_position_embeddings": model_cfg.max_seq_len,
                "rms_norm_eps": layers[0].norm.eps, "tie_word_embeddings": model_cfg.tie_embeddings,
                "hidden_act": "silu", **attention_hf(layers, model_cfg.d_model), **ffn_hf(layers)}

    def rules(self, model_cfg: Any, hf: Raw) -> list[Rule]:
        out = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
        if not model_cfg.tie_embeddings:
            out.append(same("head.weight", self.head_keys[0]))
        for i, layer in enumerate(model_cfg.expanded_layers()):
            ours, theirs = f"blocks.{i}", f"model.layers.{i}"
            out += [same(f"{ours}.attention.norm.weight", f"{theirs}.input_layernorm.weight"),
                    same(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
                    *attention_rules(layer.attention, f"{ours}.attention.attn", theirs, model_cfg.d_model),
                    *ffn_rules(layer, ours, theirs)]
        return out

    def ignored(self, hf: Raw) -> re.Pattern:
        return re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq|mtp\..*")


ADAPTER = Qwen3Next()
