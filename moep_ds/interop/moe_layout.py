"""What the Hugging Face MoE families (interop/families/mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py,
deepseek_v3.py, deepseek_v2.py) share: `MoEFamily`, the adapter base that builds the recipe from a family's
attention, router, shared expert and dense layers and the tensor rules from its module names, and plain helpers
both ways (config.json -> the recipe's sections, a model -> config.json keys). transformers' modeling files are the
reference for every choice (transformers 5).

# E experts, D model dim, F expert hidden dim, H heads, K top-k, L MoE layers

    config.json -> recipe   rope_of, causal_attention, num_experts, softmax_router, repeated
    tensors                 mlp_rules (gate / up / down), causal_rules (q / k / v / o, QK-norm), the experts
    model -> config.json    parts_of (refuses blocks and routers no MoE family has), common_hf, causal_hf, moe_hf

Router logits: Mixtral's, Qwen's and OLMoE's routers multiply in the activations' dtype (our logits_dtype input),
DeepSeek's in fp32. Load balancing (training only, not in the logits): transformers adds coef x K x E sum f P
over all layers' tokens pooled (when output_router_logits); ours is alpha x E sum f P per layer, summed over the L
MoE layers, so alpha = coef x K / L puts the same pressure on each router.

Experts: transformers 5 saves each expert's gate / up [F, D] and down [D, F] as tensors of their own (and reads
them so); ours are stacked w1_EDF (gate), w3_EDF (up), w2_EFD (down): every expert of a stack is read from its own
tensors, so a process reads only the experts it holds (`Rule.stacked`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Family, Inexpressible, Raw
from moep_ds.interop.hf_layout import GATED_ACTIVATIONS, activation, unsupported
from moep_ds.interop.rules import Rule, concatenated, expert_stack, same


# ---- config.json -> recipe ------------------------------------------------------------------------------------


def rope_of(hf: Raw, arch: str, yarn: bool = False, partial: float | None = None) -> Raw:
    """Our rope section from transformers 5's rope_parameters or the older rope_theta / rope_scaling keys.
    `partial`: the family rotates a leading share of each head's dims (partial_rotary_factor, in rope_parameters or,
    in older configs, beside it; `partial` where neither says), as we do (layers/rope.py: rotate_half over the first
    R dims); None: the family rotates whole heads and a config saying otherwise is refused."""
    params = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e4)}
    kind = params.get("rope_type") or params.get("type") or "default"
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is None and factor not in (None, 1.0):
        raise UserError(f"config.json: partial_rotary_factor = {factor!r} ({arch}) has no moep_ds counterpart "
                        "(supported: 1.0)")
    if kind not in (("default", "yarn") if yarn else ("default",)):
        raise UserError(f"config.json: rope type {kind!r} ({arch}) has no moep_ds counterpart (supported: "
                        f"{'default, yarn' if yarn else 'default'})")
    out: Raw = {"base": float(params.get("rope_theta", hf.get("rope_theta", 1e4)))}
    if partial is not None:
        out["fraction"] = float(partial if factor is None else factor)
    if kind == "yarn":
        original = params["original_max_position_embeddings"]
        out["yarn"] = {"factor": float(params.get("factor") or hf["max_position_embeddings"] / original),
                       "original_max_seq_len": original, "beta_fast": float(params.get("beta_fast") or 32),
                       "beta_slow": float(params.get("beta_slow") or 1), "mscale": params.get("mscale"),
                       "mscale_all_dim": params.get("mscale_all_dim"),
                       "attention_factor": params.get("attention_factor"), "truncate": params.get("truncate", True)}
    return out


def causal_attention(hf: Raw, arch: str, partial: float | None = None, **extra: Any) -> Raw:
    """GQA attention with RoPE (`partial`: see rope_of)."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    return {"type": "causal", "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or d // heads, "rope": rope_of(hf, arch, partial=partial),
            "bias": bool(hf.get("attention_bias", False)), **extra}


def num_experts(hf: Raw) -> int:
    """Routed experts, under any of the names transformers' configs give them (attribute_map aliases)."""
    return next((hf[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k) is not None), 0)


def softmax_router(hf: Raw, num_moe: int, renormalize: bool, coef_default: float) -> Raw:
    k = hf["num_experts_per_tok"]
    return {"type": "topk", "k": k, "score": "softmax", "renormalize": renormalize, "logits_dtype": "input",
            "load_balancing_weight": hf.get("router_aux_loss_coef", coef_default) * k / max(num_moe, 1),
            "capacity_factor": None}


def repeated(blocks: list[Raw]) -> list[Raw]:
    """Consecutive equal blocks as one entry with `repeat`."""
    out: list[Raw] = []
    for block in blocks:
        if out and {k: v for k, v in out[-1].items() if k != "repeat"} == block:
            out[-1]["repeat"] += 1
        else:
            out.append({**block, "repeat": 1})
    return out


def mlp_rules(ours: str, theirs: str) -> list[Rule]:
    return [same(f"{ours}.{a}.weight", f"{theirs}.{b}.weight")
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]


def causal_rules(att: Any, ours: str, theirs: str, d_model: int) -> list[Rule]:
    Dh = att.resolved_head_dim(d_model)
    rows = [att.num_heads * Dh, att.kv_heads * Dh, att.kv_heads * Dh]
    qkv_bias = att.bias if att.qkv_bias is None else att.qkv_bias
    out = [concatenated(f"{ours}.w_qkv.{kind}", tuple(f"{theirs}.{p}_proj.{kind}" for p in "qkv"), rows)
           for kind in ("weight", "bias")[:2 if qkv_bias else 1]]
    out += [same(f"{ours}.w_o.{kind}", f"{theirs}.o_proj.{kind}") for kind in ("weight", "bias")[:2 if att.bias else 1]]
    if att.qk_norm is not None:
        out += [same(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in ("q_norm", "k_norm")]
    return out


# ---- model -> config.json (the native export) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a model's config.json is written from: its blocks, the first MoE layer and the first dense FFN."""

    model: Any
    layers: list[Any]
    attention: Any
    moe: Any | None
    dense_ffn: Any | None

    @property
    def sparse(self) -> list[bool]:
        return [layer.type == "ffn_moe" for layer in self.layers]


def parts_of(model: Any) -> Parts:
    layers = model.expanded_layers()
    for i, layer in enumerate(layers):
        if layer.type not in ("dense", "ffn_moe"):
            raise Inexpressible(f"model.layers (block {i}) is a {layer.type!r} block: the Hugging Face MoE "
                                "architectures are of dense and ffn_moe blocks")
        if layer.type == "ffn_moe" and getattr(layer.moe.router, "type", None) != "topk":
            raise Inexpressible(f"model.layers (block {i}): a {layer.moe.router.type!r} router (the Hugging Face "
                                "MoE architectures route top-k)")
    moe = next((layer.moe for layer in layers if layer.type == "ffn_moe"), None)
    if moe is None:
        raise Inexpressible("model.layers: no ffn_moe block", other_kind=True)
    dense = next((layer.ffn for layer in layers if layer.type == "dense"), None)
    return Parts(model, layers, layers[0].attention, moe, dense)


HF_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def common_hf(p: Parts, attention_type: str) -> Raw:
    if p.attention.type != attention_type:
        raise Inexpressible(f"model.layers[*].attention.type: {attention_type!r} in this architecture, "
                            f"{p.attention.type!r} in the model")
    rope = p.attention.rope
    if rope is None:
        raise Inexpressible("model.layers[*].attention.rope: null in the model (the architecture is rotary)")
    params: Raw = {"rope_type": "default", "rope_theta": rope.base}
    if rope.yarn is not None:
        y = rope.yarn
        params = {"rope_type": "yarn", "rope_theta": rope.base, "factor": y.factor, "beta_fast": y.beta_fast,
                  "beta_slow": y.beta_slow, "original_max_position_embeddings": y.original_max_seq_len,
                  "truncate": y.truncate, **{k: getattr(y, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                                            if getattr(y, k) is not None}}
    expert = p.moe.expert if p.moe is not None else p.dense_ffn
    out = {"vocab_size": p.model.vocab_size, "hidden_size": p.model.d_model, "num_hidden_layers": len(p.layers),
           "num_attention_heads": p.attention.num_heads, "max_position_embeddings": p.model.max_seq_len,
           "rms_norm_eps": p.layers[0].norm.eps, "tie_word_embeddings": p.model.tie_embeddings,
           "hidden_act": HF_ACTIVATIONS.get(expert.type, "silu"), "rope_parameters": params}
    if p.dense_ffn is not None:
        out["intermediate_size"] = p.dense_ffn.hidden_size
    return out


def causal_hf(p: Parts) -> Raw:
    att = p.attention
    return {"num_key_value_heads": att.kv_heads, "head_dim": att.resolved_head_dim(p.model.d_model)}


def moe_hf(p: Parts, experts_key: str, hidden_key: str) -> Raw:
    if p.moe is None:
        raise Inexpressible("model.layers: no ffn_moe block")
    router = p.moe.router
    num_moe = sum(p.sparse)
    return {experts_key: p.moe.num_experts, hidden_key: p.moe.expert.hidden_size, "num_experts_per_tok": router.k,
            "norm_topk_prob": router.renormalize,
            "router_aux_loss_coef": router.load_balancing_weight * num_moe / router.k}


# ---- the adapter base -------------------------------------------------------------------------------------------


class MoEFamily(Family):
    """An MoE family: its layers' attention, router, shared expert and which layers are MoE layers (methods of
    config.json), the names of its MoE module's parts, and the config.json settings it refuses (`refused`: the one
    value that is fine) make the recipe and the tensor rules."""

    moe_prefix = "mlp"  # the MoE module of a decoder layer
    expert_names = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up, down (our w1, w3, w2)
    shared_prefix: str | None = None  # the shared expert under the MoE module
    refused: dict[str, Any] = {}  # config.json settings no recipe expresses: the one value that is fine
    expert_hidden_key = "intermediate_size"  # the routed experts' hidden size in config.json

    def sparse(self, hf: Raw) -> list[bool]:
        """Which layers are MoE layers."""
        return [True] * hf["num_hidden_layers"]

    def attention(self, hf: Raw) -> Raw:
        raise NotImplementedError

    def router(self, hf: Raw, num_moe: int) -> Raw:
        raise NotImplementedError

    def shared(self, hf: Raw) -> Raw | None:
        return None

    def recipe(self, hf: Raw) -> Raw:
        unsupported(self.model_type, hf, {"quantization_config": None, "pretraining_tp": 1, **self.refused})
        ffn_type = activation(GATED_ACTIVATIONS, hf.get("hidden_act", "silu"), "hidden_act")
        norm = {"type": "rmsnorm", "eps": hf.get("rms_norm_eps", 1e-6)}
        sparse = self.sparse(hf)
        attention = self.attention(hf)
        dense_block = {"type": "dense", "attention": attention, "norm": norm,
                       "ffn": {"type": ffn_type, "hidden_size": hf.get("intermediate_size")}}
        moe = {"num_experts": num_experts(hf),
               "expert": {"type": ffn_type, "hidden_size": hf[self.expert_hidden_key]},
               "router": self.router(hf, sum(sparse)), "shared_expert": self.shared(hf)}
        moe_block = {"type": "ffn_moe", "attention": attention, "norm": norm, "moe": moe}
        return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
                "max_seq_len": hf.get("max_position_embeddings", 4096),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "position_embedding": "none",
                "final_norm": norm, "layers": repeated([moe_block if s else dense_block for s in sparse])}

    def rules(self, model_cfg: Any, hf: Raw) -> list[Rule]:
        out = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
        if not model_cfg.tie_embeddings:
            out.append(same("head.weight", self.head_keys[0]))
        for i, layer in enumerate(model_cfg.expanded_layers()):
            out.extend(self.layer_rules(layer, i, hf, model_cfg.d_model))
        return out

    def attention_rules(self, att: Any, ours: str, theirs: str, hf: Raw, d_model: int) -> list[Rule]:
        """The attention's tensors (of a checkpoint of config.json `hf`: its rotary row order)."""
        return causal_rules(att, ours, theirs, d_model)

    def layer_rules(self, layer: Any, i: int, hf: Raw, d_model: int) -> list[Rule]:
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        out = [same(f"{ours}.attention.norm.weight", f"{theirs}.input_layernorm.weight"),
               same(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
               *self.attention_rules(layer.attention, f"{ours}.attention.attn", f"{theirs}.self_attn", hf, d_model)]
        if layer.type == "dense":
            return out + mlp_rules(f"{ours}.ffn", f"{theirs}.mlp")
        moe, their_moe = f"{ours}.moe", f"{theirs}.{self.moe_prefix}"
        out.append(same(f"{moe}.router.weight", f"{their_moe}.gate.weight"))
        if getattr(layer.moe.router, "bias_update_rate", None) is not None:
            out.append(same(f"{moe}.router.balancer.bias_E", f"{their_moe}.gate.e_score_correction_bias"))
        E = layer.moe.num_experts
        for name, theirs_name in zip(("w1_EDF", "w3_EDF", "w2_EFD"), self.expert_names):
            out.append(expert_stack(f"{moe}.experts.{name}",
                                    [f"{their_moe}.experts.{e}.{theirs_name}.weight" for e in range(E)]))
        if layer.moe.shared_expert is not None and self.shared_prefix is not None:
            out += mlp_rules(f"{moe}.shared.ffn", f"{their_moe}.{self.shared_prefix}")
            if layer.moe.shared_expert.gate == "sigmoid":
                out.append(same(f"{moe}.shared.gate.weight", f"{their_moe}.shared_expert_gate.weight"))
        return out


__all__ = ["MoEFamily", "Parts", "causal_attention", "causal_hf", "causal_rules", "common_hf", "mlp_rules", "moe_hf",
           "num_experts", "parts_of", "repeated", "rope_of", "softmax_router"]
