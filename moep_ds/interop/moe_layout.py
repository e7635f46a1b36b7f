"""The six Hugging Face MoE architectures, both ways: config.json -> the recipe's model section (what moep-import
writes without --config, and checks a recipe against), a model -> config.json (the native export), and their
tensors <-> ours. transformers' modeling files are the reference for every choice (transformers 5).

# E experts, D model dim, F expert hidden dim, H heads, N / R / V MLA's nope / rope / value head dims, K top-k

    mixtral      MixtralForCausalLM     every FFN an MoE (block_sparse_moe, experts w1/w3/w2); softmax top-k
                                        renormalised; optional sliding window
    qwen2_moe    Qwen2MoeForCausalLM    softmax top-k (renormalised if norm_topk_prob), one shared expert scaled by
                                        sigmoid(x . w) (shared_expert_gate); biases on q, k, v only (qkv_bias);
                                        dense layers: mlp_only_layers, and all but every decoder_sparse_step-th
    qwen3_moe    Qwen3MoeForCausalLM    Qwen2-MoE's routing and dense layers, no shared expert, RMSNorm per head on q
                                        and k (before RoPE)
    olmoe        OlmoeForCausalLM       every FFN an MoE, softmax top-k (norm_topk_prob), RMSNorm over the whole q and
                                        k projections
    deepseek_v3  DeepseekV3ForCausalLM  multi-head latent attention (layers/mla.py, YaRN); sigmoid scores,
                                        e_score_correction_bias = our loss-free balancing bias (routing/balancing.py),
                                        group-limited choice (n_group, topk_group), norm_topk_prob,
                                        routed_scaling_factor; n_shared_experts as one ungated shared FFN; the first
                                        first_k_dense_replace layers dense
    deepseek_v2  DeepseekV2ForCausalLM  DeepSeek-V3's attention, dense layers and shared experts; softmax scores,
                                        no selection bias, topk_method greedy or group_limited_greedy (a group
                                        scored by its largest score: router.group_score max), no renormalisation,
                                        routed_scaling_factor; its rotary rows always interleaved (complex pairs)

Router logits: Mixtral's, Qwen's and OLMoE's routers multiply in the activations' dtype (our logits_dtype input),
DeepSeek's in fp32. Load balancing (training only, not in the logits): transformers adds coef x K x E sum f P
over all layers' tokens pooled (when output_router_logits); ours is alpha x E sum f P per layer, summed over the L
MoE layers, so alpha = coef x K / L puts the same pressure on each router.

Experts: transformers 5 saves each expert's gate / up [F, D] and down [D, F] as tensors of their own (and reads
them so); ours are stacked w1_EDF (gate), w3_EDF (up), w2_EFD (down): every expert of a stack is read from its own
tensors, so a process reads only the experts it holds (`Rule.stacked`). DeepSeek's rotary rows are interleaved
(V3's rope_interleave, V2's complex pairs: pair 2i, 2i + 1); ours rotate i with i + R/2: the rope rows of q_proj / q_b_proj (each head's
last R) and of kv_a_proj_with_mqa (its last R) are permuted on the way in and back on the way out, exactly.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from moep_ds.errors import UserError
from moep_ds.interop.hf_layout import GATED_ACTIVATIONS, activation, unsupported
from moep_ds.interop.rules import Rule, concatenated, expert_stack, permuted, same

Raw = dict[str, Any]
LOSS_FREE_RATE = 0.001  # DeepSeek-V3's bias update speed (section 2.1.2), for training to continue the bias
NEVER = re.compile(r"(?!)")


class Inexpressible(Exception):
    """A setting of the model that the architecture has no field for (the native export's search)."""


# ---- config.json -> recipe ------------------------------------------------------------------------------------


def rope_of(hf: Raw, arch: str, yarn: bool = False) -> Raw:
    """Our rope section from transformers 5's rope_parameters or the older rope_theta / rope_scaling keys."""
    params = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e4)}
    kind = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"config.json: partial_rotary_factor = {params['partial_rotary_factor']!r} ({arch}) has no "
                        "moep_ds counterpart (supported: 1.0)")
    if kind not in (("default", "yarn") if yarn else ("default",)):
        raise UserError(f"config.json: rope type {kind!r} ({arch}) has no moep_ds counterpart (supported: "
                        f"{'default, yarn' if yarn else 'default'})")
    out: Raw = {"base": float(params.get("rope_theta", hf.get("rope_theta", 1e4)))}
    if kind == "yarn":
        original = params["original_max_position_embeddings"]
        out["yarn"] = {"factor": float(params.get("factor") or hf["max_position_embeddings"] / original),
                       "original_max_seq_len": original, "beta_fast": float(params.get("beta_fast") or 32),
                       "beta_slow": float(params.get("beta_slow") or 1), "mscale": params.get("mscale"),
                       "mscale_all_dim": params.get("mscale_all_dim"),
                       "attention_factor": params.get("attention_factor"), "truncate": params.get("truncate", True)}
    return out


def causal_attention(hf: Raw, arch: str, **extra: Any) -> Raw:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    return {"type": "causal", "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or d // heads, "rope": rope_of(hf, arch),
            "bias": bool(hf.get("attention_bias", False)), **extra}


def mla_attention(hf: Raw, arch: str) -> Raw:
    """DeepseekV3Attention; its q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps 1e-6."""
    return {"type": "mla", "num_heads": hf["num_attention_heads"], "q_lora_rank": hf.get("q_lora_rank"),
            "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
            "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"], "norm_eps": 1e-6,
            "rope": rope_of(hf, arch, yarn=True)}


def num_experts(hf: Raw) -> int:
    """Routed experts, under any of the names transformers' configs give them (attribute_map aliases)."""
    return next((hf[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k) is not None), 0)


def qwen_sparse(hf: Raw) -> list[bool]:
    """Qwen2/3-MoE's decoder layer: an MoE unless in mlp_only_layers, every decoder_sparse_step-th layer."""
    step, only_mlp = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    experts = num_experts(hf)
    return [i not in only_mlp and experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def softmax_router(hf: Raw, num_moe: int, renormalize: bool, coef_default: float) -> Raw:
    k = hf["num_experts_per_tok"]
    return {"type": "topk", "k": k, "score": "softmax", "renormalize": renormalize, "logits_dtype": "input",
            "load_balancing_weight": hf.get("router_aux_loss_coef", coef_default) * k / max(num_moe, 1),
            "capacity_factor": None}


def deepseek_balancing(hf: Raw) -> Raw:
    """The original configs' aux_loss_alpha / seq_aux (transformers reads neither; a training setting)."""
    return {"load_balancing_weight": float(hf.get("aux_loss_alpha") or 0.0),
            "load_balancing_scope": "sequence" if hf.get("seq_aux") else "micro_batch", "capacity_factor": None}


def deepseek_router(hf: Raw, num_moe: int) -> Raw:
    groups = hf.get("n_group") or 1
    return {"type": "topk", "k": hf["num_experts_per_tok"], "score": "sigmoid",
            "renormalize": bool(hf.get("norm_topk_prob", True)),
            "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), "bias_update_rate": LOSS_FREE_RATE,
            "num_groups": groups, "group_topk": hf.get("topk_group") or groups, **deepseek_balancing(hf)}


V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2_router(hf: Raw, num_moe: int) -> Raw:
    """DeepseekV2TopkRouter: softmax in fp32 over all experts, the top-k (greedy) or the top-k within the
    topk_group groups of largest maximum score (group_limited_greedy), times routed_scaling_factor, never
    renormalised (transformers 5 reads no norm_topk_prob for V2: a config with it true is refused)."""
    method = hf.get("topk_method") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise UserError(f"config.json: topk_method = {method!r} (deepseek_v2) has no moep_ds counterpart "
                        f"(supported: {', '.join(V2_TOPK_METHODS)})")
    groups = (hf.get("n_group") or 1) if method == "group_limited_greedy" else 1
    grouping = {"num_groups": groups, "group_topk": hf.get("topk_group") or groups, "group_score": "max"}
    return {"type": "topk", "k": hf["num_experts_per_tok"], "score": "softmax", "renormalize": False,
            "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), **(grouping if groups > 1 else {}),
            **deepseek_balancing(hf)}


def deepseek_shared(hf: Raw) -> Raw | None:
    return ({"hidden_size": hf["moe_intermediate_size"] * hf["n_shared_experts"], "gate": "none"}
            if hf.get("n_shared_experts") else None)


def first_k_dense(hf: Raw) -> list[bool]:
    return [i >= (hf.get("first_k_dense_replace") or 0) for i in range(hf["num_hidden_layers"])]


@dataclasses.dataclass(frozen=True)
class MoEArchitecture:
    model_type: str
    hf_class: str
    moe_prefix: str  # the MoE module of a decoder layer
    expert_names: tuple[str, str, str]  # their gate, up, down (our w1, w3, w2)
    shared_prefix: str | None  # the shared expert under the MoE module
    flags: dict[str, Any]  # config.json settings no recipe expresses: the one value that is fine
    sparse: Callable[[Raw], list[bool]]  # which layers are MoE layers
    attention: Callable[[Raw], Raw]
    router: Callable[[Raw, int], Raw]
    shared: Callable[[Raw], Raw | None]
    expert_hidden_key: str  # the routed experts' hidden size in config.json
    to_hf: Callable[[Any], Raw]  # a model -> this architecture's own config.json keys
    base_prefix: str = "model."
    head_keys: tuple[str, ...] = ("lm_head.weight",)
    rope_interleaved: Callable[[Raw], bool] = lambda hf: False  # rotary rows stored in pairs 2i, 2i + 1 (DeepSeek)

    def recipe(self, hf: Raw) -> Raw:
        """The model section of the recipe that builds the model config.json describes."""
        unsupported(self.model_type, hf, {"quantization_config": None, "pretraining_tp": 1, **self.flags})
        act, act_key = hf.get("hidden_act", "silu"), "hidden_act"
        ffn_type = activation(GATED_ACTIVATIONS, act, act_key)
        eps = hf.get("rms_norm_eps", 1e-6)
        norm = {"type": "rmsnorm", "eps": eps}
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

    # ---- tensors

    def ignored(self, hf: Raw) -> re.Pattern:
        """Tensors of a checkpoint that are no weights of this model: older checkpoints' rotary buffers and
        DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers after the last layer), which
        transformers leaves unread too."""
        layers, extra = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
        mtp = "|".join(str(i) for i in range(layers, layers + extra))
        return re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq" +
                          (rf"|model\.layers\.({mtp})\..*" if mtp else ""))

    def rules(self, model: Any, hf: Raw) -> list[Rule]:
        """Our tensors from those of a checkpoint of config.json `hf` (its rotary row order), and back."""
        interleaved = self.rope_interleaved(hf)
        out = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
        if not model.tie_embeddings:
            out.append(same("head.weight", self.head_keys[0]))
        for i, layer in enumerate(model.expanded_layers()):
            out.extend(self.layer_rules(layer, i, interleaved, model.d_model))
        return out

    def layer_rules(self, layer: Any, i: int, interleaved: bool, d_model: int) -> list[Rule]:
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        out = [same(f"{ours}.attention.norm.weight", f"{theirs}.input_layernorm.weight"),
               same(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight")]
        attn, their_attn = f"{ours}.attention.attn", f"{theirs}.self_attn"
        if layer.attention.type == "mla":
            out += mla_rules(layer.attention, attn, their_attn, interleaved)
        else:
            out += causal_rules(layer.attention, attn, their_attn, d_model)
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


def mixtral_hf(model: Any) -> Raw:
    p = parts_of(model)
    out = {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_local_experts", "intermediate_size"),
           "sliding_window": p.attention.window, "router_jitter_noise": p.moe.router.jitter}
    out.pop("norm_topk_prob")
    return out


def qwen_hf(model: Any, shared: bool) -> Raw:
    p = parts_of(model)
    out = {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_experts", "moe_intermediate_size"),
           "decoder_sparse_step": 1, "mlp_only_layers": [i for i, s in enumerate(p.sparse) if not s],
           "use_sliding_window": False}
    if shared:
        gate = p.moe.shared_expert
        out["shared_expert_intermediate_size"] = gate.hidden_size if gate is not None else 0
        att = p.attention
        out["qkv_bias"] = att.bias if att.qkv_bias is None else att.qkv_bias
    else:
        out["attention_bias"] = p.attention.bias
    return out


def olmoe_hf(model: Any) -> Raw:
    p = parts_of(model)
    return {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_experts", "intermediate_size"),
            "attention_bias": p.attention.bias, "clip_qkv": None}


def deepseek_hf(model: Any, version: int = 3) -> Raw:
    p = parts_of(model)
    att, router = p.attention, p.moe.router if p.moe is not None else None
    out = {**common_hf(p, "mla"), **moe_hf(p, "n_routed_experts", "moe_intermediate_size")}
    out.pop("router_aux_loss_coef")
    dense = next((i for i, s in enumerate(p.sparse) if s), len(p.layers))
    shared = p.moe.shared_expert
    out.update(num_key_value_heads=att.num_heads, q_lora_rank=att.q_lora_rank, kv_lora_rank=att.kv_lora_rank,
               qk_nope_head_dim=att.qk_nope_head_dim, qk_rope_head_dim=att.qk_rope_head_dim,
               v_head_dim=att.v_head_dim, first_k_dense_replace=dense,
               n_group=router.num_groups, topk_group=router.kept_groups(),
               routed_scaling_factor=router.scaling_factor,
               n_shared_experts=shared.hidden_size // p.moe.expert.hidden_size if shared is not None else 0,
               attention_bias=False)
    if version == 3:
        out.update(rope_interleave=True, num_nextn_predict_layers=0)
    else:  # no group limit is "greedy"; V2 has no norm_topk_prob of its own (the round trip compares renormalize)
        out.update(topk_method="group_limited_greedy" if router.num_groups > 1 else "greedy",
                   scoring_func="softmax", norm_topk_prob=False)
    if "intermediate_size" not in out:  # every layer an MoE: the (unused) dense size of the config's default
        out["intermediate_size"] = p.moe.expert.hidden_size
    return out


MOE_ARCHITECTURES = {
    "mixtral": MoEArchitecture(
        "mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), None, {},
        lambda hf: [True] * hf["num_hidden_layers"],
        lambda hf: causal_attention(hf, "mixtral", window=hf.get("sliding_window")),
        lambda hf, n: {**softmax_router(hf, n, True, 0.001), "jitter": float(hf.get("router_jitter_noise") or 0.0)},
        lambda hf: None, "intermediate_size", mixtral_hf),
    "qwen2_moe": MoEArchitecture(
        "qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_expert",
        {"use_sliding_window": False}, qwen_sparse,
        lambda hf: {**causal_attention(hf, "qwen2_moe"), "bias": False, "qkv_bias": bool(hf.get("qkv_bias", True))},
        lambda hf, n: softmax_router(hf, n, bool(hf.get("norm_topk_prob", False)), 0.001),
        lambda hf: {"hidden_size": hf["shared_expert_intermediate_size"], "gate": "sigmoid"},
        "moe_intermediate_size", lambda m: qwen_hf(m, shared=True)),
    "qwen3_moe": MoEArchitecture(
        "qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), None,
        {"use_sliding_window": False}, qwen_sparse,
        lambda hf: causal_attention(hf, "qwen3_moe", qk_norm={"scope": "head", "eps": hf.get("rms_norm_eps", 1e-6)}),
        lambda hf, n: softmax_router(hf, n, bool(hf.get("norm_topk_prob", False)), 0.001),
        lambda hf: None, "moe_intermediate_size", lambda m: qwen_hf(m, shared=False)),
    "olmoe": MoEArchitecture(
        "olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), None, {"clip_qkv": None},
        lambda hf: [True] * hf["num_hidden_layers"],
        lambda hf: causal_attention(hf, "olmoe", qk_norm={"scope": "projection",
                                                          "eps": hf.get("rms_norm_eps", 1e-5)}),
        lambda hf, n: softmax_router(hf, n, bool(hf.get("norm_topk_prob", False)), 0.01),
        lambda hf: None, "intermediate_size", olmoe_hf),
    "deepseek_v3": MoEArchitecture(
        "deepseek_v3", "DeepseekV3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts",
        {"attention_bias": False, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
        first_k_dense, lambda hf: mla_attention(hf, "deepseek_v3"), deepseek_router, deepseek_shared,
        "moe_intermediate_size", deepseek_hf, rope_interleaved=lambda hf: bool(hf.get("rope_interleave", True))),
    "deepseek_v2": MoEArchitecture(
        "deepseek_v2", "DeepseekV2ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts",
        {"attention_bias": False, "mlp_bias": False, "moe_layer_freq": 1, "scoring_func": "softmax",
         "norm_topk_prob": False}, first_k_dense, lambda hf: mla_attention(hf, "deepseek_v2"), deepseek_v2_router,
        deepseek_shared, "moe_intermediate_size", lambda m: deepseek_hf(m, version=2),
        rope_interleaved=lambda hf: True),  # V2 rotates complex pairs
}


__all__ = ["Inexpressible", "MOE_ARCHITECTURES", "MoEArchitecture", "parts_of", "repeated"]
