"""The four Hugging Face architectures our dense flavours are, in one table each way: config.json <-> recipe, and
their tensor names and layouts <-> ours. Import (hf_weights.py), the native export (`moep-export --hf --native`)
and the transformers reference test (tests/models/test_transformers_reference.py) all read this one map.

# H query heads, G key/value heads, Dh head dim, D model dim, F FFN hidden dim

    gpt2      GPT2LMHeadModel      learned positions, LayerNorm, Conv1D weights stored [in, out], c_attn = [q | k | v]
    llama     LlamaForCausalLM     RMSNorm, SwiGLU (gate = our w1, up = w3, down = w2), RoPE, GQA, q/k/v separate
    gemma     GemmaForCausalLM     (1 + w) RMSNorm, GeGLU, RoPE, embeddings x sqrt(D), tied head
    gpt_neox  GPTNeoXForCausalLM   partial rotary, parallel residual, query_key_value rows [H, 3, Dh] (ours [3, H, Dh])

Llama and Gemma rotate dim i with i + Dh/2 (rotate_half), as ours does, so q and k rows copy unpermuted.
Older checkpoints carry buffers that are no weights (GPT-2's causal mask `attn.bias`, GPT-NeoX's `masked_bias`
and `rotary_emb.inv_freq`): they are recognised and skipped; any other tensor the map does not know is an error.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Callable

import torch

from moep_ds.errors import UserError
from moep_ds.interop.rules import Rule, concatenated, same, transposed, with_bias

log = logging.getLogger(__name__)

# what the recipe must hold, by field: (accepted values, the first the canonical one; where config.json says so)
Expected = dict[str, tuple[tuple[Any, ...], str]]

FIELD_PATHS = {
    "block_type": "model.layers[*].type", "vocab_size": "model.vocab_size", "d_model": "model.d_model",
    "num_layers": "model.layers (number of blocks)", "num_heads": "model.layers[*].attention.num_heads",
    "num_kv_heads": "model.layers[*].attention.num_kv_heads", "head_dim": "model.layers[*].attention.head_dim",
    "attention_bias": "model.layers[*].attention.bias", "window": "model.layers[*].attention.window",
    "rotary": "model.layers[*].attention.rope (set or null)", "rope_base": "model.layers[*].attention.rope.base",
    "rope_fraction": "model.layers[*].attention.rope.fraction", "ffn_type": "model.layers[*].ffn.type",
    "ffn_hidden": "model.layers[*].ffn.hidden_size", "ffn_bias": "model.layers[*].ffn.bias",
    "norm_type": "model.layers[*].norm.type", "norm_eps": "model.layers[*].norm.eps",
    "norm_bias": "model.layers[*].norm.bias", "final_norm_type": "model.final_norm.type",
    "final_norm_eps": "model.final_norm.eps", "final_norm_bias": "model.final_norm.bias",
    "parallel_residual": "model.layers[*].parallel_residual", "tie_embeddings": "model.tie_embeddings",
    "position_embedding": "model.position_embedding", "embedding_scale": "model.embedding_scale",
    "max_seq_len": "model.max_seq_len",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A homogeneous dense model as the recipe builds it, in the terms the architectures are compared in."""

    values: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def spec_of(model_cfg: Any) -> Spec:
    """The recipe's dense model as a Spec; one line when it is not one block repeated (what the HF classes are)."""
    from moep_ds.layers.ffn import ffn_hidden_size
    from moep_ds.schema import to_dict

    layers = model_cfg.expanded_layers()
    first = layers[0]
    for i, layer in enumerate(layers):
        if getattr(layer, "type", None) != "dense":
            raise UserError(f"model.layers (block {i}) is {getattr(layer, 'type', layer)!r}: the Hugging Face "
                            "architectures (GPT-2, Llama, Gemma, GPT-NeoX) are of dense blocks only (a dense one "
                            "becomes an MoE by model.upcycle)")
        if {**to_dict(layer), "repeat": 1} != {**to_dict(first), "repeat": 1}:
            raise UserError(f"model.layers: block {i} differs from block 0; the Hugging Face architectures repeat "
                            "one block")
    check_dense_attention(first.attention)
    if first.ffn.type not in ("gelu", "gelu_tanh", "swiglu", "geglu"):
        raise UserError(f"model.layers[*].ffn.type ({first.ffn.type!r}): the dense Hugging Face architectures have no "
                        "such FFN")
    d, att, rope = model_cfg.d_model, first.attention, first.attention.rope
    return Spec({
        "block_type": "dense", "vocab_size": model_cfg.vocab_size, "d_model": d, "num_layers": len(layers),
        "num_heads": att.num_heads, "num_kv_heads": att.kv_heads, "head_dim": att.resolved_head_dim(d),
        "attention_bias": att.bias, "window": att.window, "rotary": rope is not None,
        "rope_base": rope.base if rope else None, "rope_fraction": rope.fraction if rope else None,
        "ffn_type": first.ffn.type, "ffn_hidden": ffn_hidden_size(first.ffn, d), "ffn_bias": first.ffn.bias,
        "norm_type": first.norm.type, "norm_eps": first.norm.eps, "norm_bias": first.norm.bias,
        "final_norm_type": model_cfg.final_norm.type, "final_norm_eps": model_cfg.final_norm.eps,
        "final_norm_bias": model_cfg.final_norm.bias, "parallel_residual": first.parallel_residual,
        "tie_embeddings": model_cfg.tie_embeddings, "position_embedding": model_cfg.position_embedding,
        "embedding_scale": model_cfg.embedding_scale, "max_seq_len": model_cfg.max_seq_len,
    })


def check_dense_attention(att: Any) -> None:
    """What the dense architectures' attention has: causal, no QK-norm, biases on all projections or none."""
    where = "the dense Hugging Face architectures (GPT-2, Llama, Gemma, GPT-NeoX)"
    if att.type != "causal":
        raise UserError(f"model.layers[*].attention.type ({att.type!r}): {where} have causal attention")
    if att.qk_norm is not None:
        raise UserError(f"model.layers[*].attention.qk_norm is set: {where} have no QK-norm")
    if att.sinks:
        raise UserError(f"model.layers[*].attention.sinks is set: {where} have no attention sinks")
    if att.qkv_bias is not None and att.qkv_bias != att.bias:
        raise UserError(f"model.layers[*].attention.qkv_bias ({att.qkv_bias}) differs from attention.bias "
                        f"({att.bias}): {where} have biases on every projection or on none")
    if att.rope is not None and att.rope.yarn is not None:
        raise UserError(f"model.layers[*].attention.rope.yarn is set: {where} are read with plain RoPE here")


# ---- tensors ------------------------------------------------------------------------------------------------


def neox_qkv(ours: str, theirs: str, heads: int, head_dim: int) -> Rule:
    """GPT-NeoX's query_key_value rows are [H, 3, Dh] (q, k, v interleaved per head); ours are [3, H, Dh]."""

    def to_ours(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].unflatten(0, (heads, 3, head_dim)).transpose(0, 1).flatten(0, 2).contiguous()

    def to_theirs(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.unflatten(0, (3, heads, head_dim)).transpose(0, 1).flatten(0, 2).contiguous()]

    return Rule(ours, (theirs,), to_ours, to_theirs)


def norm_rules(ours: str, theirs: str, has_bias: bool) -> list[Rule]:
    return with_bias(same, ours, theirs, has_bias)


# ---- the architectures ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str  # config.json's model_type
    hf_class: str  # the transformers class, config.json's architectures[0]
    base_prefix: str  # what a checkpoint of the base model (no LM head) leaves out of every key
    head_keys: tuple[str, ...]  # the untied LM head's key, then older spellings
    ignored: re.Pattern  # buffers of older checkpoints: known, no weights
    expected: Callable[[dict[str, Any]], Expected]  # what the recipe must hold for this config.json
    hf_config: Callable[[Spec], dict[str, Any]]  # config.json of a model (the native export)
    layer_rules: Callable[[Spec, int], list[Rule]]  # the tensors of block i
    outer_rules: Callable[[Spec], list[Rule]]  # embeddings, final norm (the head is added from head_keys)

    def rules(self, spec: Spec) -> list[Rule]:
        out = self.outer_rules(spec)
        if not spec["tie_embeddings"]:
            out.append(same("head.weight", self.head_keys[0]))
        for i in range(spec["num_layers"]):
            out.extend(self.layer_rules(spec, i))
        return out


def get(hf: dict[str, Any], *keys: str, default: Any = None) -> tuple[Any, str]:
    """The first of `keys` that config.json holds (older and newer spellings), and which; else the default."""
    for key in keys:
        if key in hf:
            return hf[key], key
    return default, f"{keys[0]}, default"


def rope_parameters(hf: dict[str, Any], default_fraction: float = 1.0) -> tuple[Expected, dict[str, Any]]:
    """Rotary base and share from transformers 5's rope_parameters or the older rope_theta / rotary_pct keys; a
    scaled rotary (rope_scaling, Llama 3.1's) has no counterpart here."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta, theta_key = (params["rope_theta"], "rope_parameters.rope_theta") if "rope_theta" in params else get(
        hf, "rope_theta", "rotary_emb_base", default=10000.0)
    fraction, fraction_key = ((params["partial_rotary_factor"], "rope_parameters.partial_rotary_factor")
                              if "partial_rotary_factor" in params else
                              get(hf, "partial_rotary_factor", "rotary_pct", default=default_fraction))
    out = {"rotary": ((True,), "rotary embedding"), "rope_base": ((float(theta),), theta_key),
           "rope_fraction": ((float(fraction),), fraction_key)}
    return out, {"rope_type": kind}


def unsupported(arch: str, hf: dict[str, Any], flags: dict[str, Any]) -> None:
    """One line for a config.json setting that changes the computation in a way no recipe can express."""
    for key, fine in flags.items():
        if key in hf and hf[key] != fine and hf[key] is not None:
            raise UserError(f"config.json: {key} = {hf[key]!r} ({arch}) has no moep_ds counterpart (supported: "
                            f"{fine!r})")


MLP_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}


@dataclasses.dataclass(frozen=True)
class AtMost:
    """A rotary model runs at any length up to the one it was trained for."""

    limit: int


def at_most_positions(hf: dict[str, Any]) -> Expected:
    positions = hf.get("max_position_embeddings")
    return {"max_seq_len": ((AtMost(positions),), "max_position_embeddings")} if positions else {}


def activation(table: dict[str, str], value: Any, key: str) -> str:
    if value not in table:
        raise UserError(f"config.json: {key} = {value!r} has no moep_ds FFN (supported: {', '.join(table)})")
    return table[value]


def common(hf: dict[str, Any], d: int, heads: int, layers: int) -> Expected:
    return {"block_type": (("dense",), "a dense architecture"), "vocab_size": ((hf.get("vocab_size"),), "vocab_size"),
            "d_model": ((d,), "hidden size"), "num_layers": ((layers,), "number of layers"),
            "num_heads": ((heads,), "attention heads"), "window": ((None,), "no sliding window"),
            "embedding_scale": ((False,), "unscaled embeddings")}


# -- GPT-2


def gpt2_expected(hf: dict[str, Any]) -> Expected:
    unsupported("gpt2", hf, {"scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
                             "add_cross_attention": False})
    d, heads = hf["n_embd"], hf["n_head"]
    inner, inner_key = get(hf, "n_inner")
    act, act_key = get(hf, "activation_function", default="gelu_new")
    eps, eps_key = get(hf, "layer_norm_epsilon", default=1e-5)
    positions, pos_key = get(hf, "n_positions", "n_ctx", default=1024)
    tie, tie_key = get(hf, "tie_word_embeddings", default=True)
    return {**common(hf, d, heads, hf["n_layer"]), "num_kv_heads": ((heads,), "n_head"),
            "head_dim": ((d // heads,), "n_embd / n_head"), "attention_bias": ((True,), "GPT-2's biases"),
            "rotary": ((False,), "learned positions"),
            "ffn_type": ((activation(MLP_ACTIVATIONS, act, act_key),), act_key),
            "ffn_hidden": ((inner or 4 * d,), inner_key if inner else "n_inner null: 4 x n_embd"),
            "ffn_bias": ((True,), "GPT-2's biases"), "norm_type": (("layernorm",), "GPT-2's LayerNorm"),
            "norm_eps": ((eps,), eps_key), "norm_bias": ((True,), "GPT-2's LayerNorm"),
            "final_norm_type": (("layernorm",), "GPT-2's LayerNorm"), "final_norm_eps": ((eps,), eps_key),
            "final_norm_bias": ((True,), "GPT-2's LayerNorm"), "parallel_residual": ((False,), "sequential residual"),
            "tie_embeddings": ((tie,), tie_key), "position_embedding": (("learned",), "learned positions"),
            "max_seq_len": ((positions,), pos_key)}


def gpt2_config(s: Spec) -> dict[str, Any]:
    return {"n_embd": s["d_model"], "n_layer": s["num_layers"], "n_head": s["num_heads"], "n_inner": s["ffn_hidden"],
            "n_positions": s["max_seq_len"], "activation_function": {"gelu_tanh": "gelu_new"}.get(s["ffn_type"],
                                                                                                 s["ffn_type"]),
            "layer_norm_epsilon": s["norm_eps"], "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def gpt2_layer(s: Spec, i: int) -> list[Rule]:
    h = f"transformer.h.{i}"
    ours = f"blocks.{i}"
    return [*norm_rules(f"{ours}.attention.norm", f"{h}.ln_1", True),
            *with_bias(transposed, f"{ours}.attention.attn.w_qkv", f"{h}.attn.c_attn", True),
            *with_bias(transposed, f"{ours}.attention.attn.w_o", f"{h}.attn.c_proj", True),
            *norm_rules(f"{ours}.ffn_norm", f"{h}.ln_2", True),
            *with_bias(transposed, f"{ours}.ffn.w_in", f"{h}.mlp.c_fc", True),
            *with_bias(transposed, f"{ours}.ffn.w_out", f"{h}.mlp.c_proj", True)]


def gpt2_outer(s: Spec) -> list[Rule]:
    return [same("embed.weight", "transformer.wte.weight"), same("pos_embed.weight", "transformer.wpe.weight"),
            *norm_rules("norm", "transformer.ln_f", True)]


# -- Llama and Gemma


def llama_like_expected(hf: dict[str, Any], gemma: bool) -> Expected:
    arch = "gemma" if gemma else "llama"
    unsupported(arch, hf, {"pretraining_tp": 1, "sliding_window": None})
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv, kv_key = get(hf, "num_key_value_heads", default=heads)
    head_dim, head_key = get(hf, "head_dim", default=256 if gemma else d // heads)
    rope, extra = rope_parameters(hf)
    if extra["rope_type"] != "default":
        raise UserError(f"config.json: rope type {extra['rope_type']!r} ({arch}) has no moep_ds counterpart "
                        "(supported: 'default')")
    if gemma:  # older Gemma configs leave hidden_activation null: transformers then uses the tanh GELU
        act, act_key = hf.get("hidden_activation") or "gelu_pytorch_tanh", "hidden_activation"
    else:
        act, act_key = get(hf, "hidden_act", default="silu")
    eps, eps_key = get(hf, "rms_norm_eps", default=1e-6)
    tie, tie_key = get(hf, "tie_word_embeddings", default=gemma)
    norm = "gemma_rmsnorm" if gemma else "rmsnorm"
    return {**common(hf, d, heads, hf["num_hidden_layers"]), **rope, "num_kv_heads": ((kv or heads,), kv_key),
            "head_dim": ((head_dim or d // heads,), head_key),
            "attention_bias": ((bool(hf.get("attention_bias", False)),), "attention_bias"),
            "ffn_type": ((activation(GATED_ACTIVATIONS, act, act_key),), act_key),
            "ffn_hidden": ((hf["intermediate_size"],), "intermediate_size"),
            "ffn_bias": ((bool(hf.get("mlp_bias", False)),), "mlp_bias"), "norm_type": ((norm,), arch),
            "norm_eps": ((eps,), eps_key), "final_norm_type": ((norm,), arch), "final_norm_eps": ((eps,), eps_key),
            "parallel_residual": ((False,), "sequential residual"), "tie_embeddings": ((tie,), tie_key),
            "position_embedding": (("none",), "rotary positions"),
            "embedding_scale": ((gemma,), "Gemma scales embeddings by sqrt(hidden_size)" if gemma else "unscaled"),
            **at_most_positions(hf)}


def llama_like_config(s: Spec, gemma: bool) -> dict[str, Any]:
    act = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}[s["ffn_type"]]
    return {"hidden_size": s["d_model"], "intermediate_size": s["ffn_hidden"], "num_hidden_layers": s["num_layers"],
            "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"],
            "max_position_embeddings": s["max_seq_len"], "rms_norm_eps": s["norm_eps"],
            "attention_bias": s["attention_bias"], "rope_theta": s["rope_base"],
            "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_base"]},
            ("hidden_activation" if gemma else "hidden_act"): act, **({} if gemma else {"mlp_bias": s["ffn_bias"]})}


def llama_layer(s: Spec, i: int) -> list[Rule]:
    layer, ours = f"model.layers.{i}", f"blocks.{i}"
    rows = [s["num_heads"] * s["head_dim"]] + [s["num_kv_heads"] * s["head_dim"]] * 2
    qkv = [concatenated(f"{ours}.attention.attn.w_qkv.{kind}",
                        tuple(f"{layer}.self_attn.{p}_proj.{kind}" for p in "qkv"), rows)
           for kind in ("weight", "bias")[:2 if s["attention_bias"] else 1]]
    mlp = [r for ours_name, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
           for r in with_bias(same, f"{ours}.ffn.{ours_name}", f"{layer}.mlp.{theirs}", s["ffn_bias"])]
    return [*norm_rules(f"{ours}.attention.norm", f"{layer}.input_layernorm", False), *qkv,
            *with_bias(same, f"{ours}.attention.attn.w_o", f"{layer}.self_attn.o_proj", s["attention_bias"]),
            *norm_rules(f"{ours}.ffn_norm", f"{layer}.post_attention_layernorm", False), *mlp]


def llama_outer(s: Spec) -> list[Rule]:
    return [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]


# -- GPT-NeoX (Pythia)


def gpt_neox_expected(hf: dict[str, Any]) -> Expected:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope, extra = rope_parameters(hf, default_fraction=0.25)
    if extra["rope_type"] != "default":
        raise UserError(f"config.json: rope type {extra['rope_type']!r} (gpt_neox) has no moep_ds counterpart")
    act, act_key = get(hf, "hidden_act", default="gelu")
    mlp = activation(MLP_ACTIVATIONS, act, act_key)
    # Pythia trained with GPT-NeoX's fused bias-GELU (the tanh formula) and released configs that say "gelu"
    # (exact, for inference): the same weights under either formula, so both are accepted (docs/FIDELITY.md)
    ffn_types = ("gelu", "gelu_tanh") if mlp == "gelu" else (mlp,)
    eps, eps_key = get(hf, "layer_norm_eps", default=1e-5)
    parallel, parallel_key = get(hf, "use_parallel_residual", default=True)
    tie, tie_key = get(hf, "tie_word_embeddings", default=False)
    bias, bias_key = get(hf, "attention_bias", default=True)
    return {**common(hf, d, heads, hf["num_hidden_layers"]), **rope, "num_kv_heads": ((heads,), "MHA"),
            "head_dim": ((d // heads,), "hidden_size / num_attention_heads"), "attention_bias": ((bias,), bias_key),
            "ffn_type": (ffn_types, act_key), "ffn_hidden": ((hf["intermediate_size"],), "intermediate_size"),
            "ffn_bias": ((True,), "GPT-NeoX's biases"), "norm_type": (("layernorm",), "GPT-NeoX's LayerNorm"),
            "norm_eps": ((eps,), eps_key), "norm_bias": ((True,), "GPT-NeoX's LayerNorm"),
            "final_norm_type": (("layernorm",), "GPT-NeoX's LayerNorm"), "final_norm_eps": ((eps,), eps_key),
            "final_norm_bias": ((True,), "GPT-NeoX's LayerNorm"), "parallel_residual": ((parallel,), parallel_key),
            "tie_embeddings": ((tie,), tie_key), "position_embedding": (("none",), "rotary positions"),
            **at_most_positions(hf)}


def gpt_neox_config(s: Spec) -> dict[str, Any]:
    return {"hidden_size": s["d_model"], "intermediate_size": s["ffn_hidden"], "num_hidden_layers": s["num_layers"],
            "num_attention_heads": s["num_heads"], "max_position_embeddings": s["max_seq_len"],
            "hidden_act": {"gelu_tanh": "gelu_new"}.get(s["ffn_type"], s["ffn_type"]),
            "layer_norm_eps": s["norm_eps"], "use_parallel_residual": s["parallel_residual"],
            "attention_bias": s["attention_bias"], "rotary_pct": s["rope_fraction"], "rotary_emb_base": s["rope_base"],
            "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_base"],
                                "partial_rotary_factor": s["rope_fraction"]},
            "hidden_dropout": 0.0, "attention_dropout": 0.0}


def gpt_neox_layer(s: Spec, i: int) -> list[Rule]:
    layer, ours = f"gpt_neox.layers.{i}", f"blocks.{i}"
    qkv = [neox_qkv(f"{ours}.attention.attn.w_qkv.{kind}", f"{layer}.attention.query_key_value.{kind}",
                    s["num_heads"], s["head_dim"]) for kind in ("weight", "bias")[:2 if s["attention_bias"] else 1]]
    return [*norm_rules(f"{ours}.attention.norm", f"{layer}.input_layernorm", True), *qkv,
            *with_bias(same, f"{ours}.attention.attn.w_o", f"{layer}.attention.dense", s["attention_bias"]),
            *norm_rules(f"{ours}.ffn_norm", f"{layer}.post_attention_layernorm", True),
            *with_bias(same, f"{ours}.ffn.w_in", f"{layer}.mlp.dense_h_to_4h", True),
            *with_bias(same, f"{ours}.ffn.w_out", f"{layer}.mlp.dense_4h_to_h", True)]


def gpt_neox_outer(s: Spec) -> list[Rule]:
    return [same("embed.weight", "gpt_neox.embed_in.weight"), *norm_rules("norm", "gpt_neox.final_layer_norm", True)]


ARCHITECTURES = {
    "gpt2": Architecture("gpt2", "gpt2", "GPT2LMHeadModel", "transformer.", ("lm_head.weight",),
                         re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)"), gpt2_expected, gpt2_config,
                         gpt2_layer, gpt2_outer),
    "llama": Architecture("llama", "llama", "LlamaForCausalLM", "model.", ("lm_head.weight",),
                          re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
                          lambda hf: llama_like_expected(hf, gemma=False),
                          lambda s: llama_like_config(s, gemma=False), llama_layer, llama_outer),
    "gemma": Architecture("gemma", "gemma", "GemmaForCausalLM", "model.", ("lm_head.weight",),
                          re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),
                          lambda hf: llama_like_expected(hf, gemma=True),
                          lambda s: llama_like_config(s, gemma=True), llama_layer, llama_outer),
    "gpt_neox": Architecture("gpt_neox", "gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.",
                             ("embed_out.weight", "lm_head.weight"),
                             re.compile(r"(gpt_neox\.)?layers\.\d+\.attention\."
                                        r"(bias|masked_bias|rotary_emb\.inv_freq)"),
                             gpt_neox_expected, gpt_neox_config, gpt_neox_layer, gpt_neox_outer),
}


def architecture_of_spec(spec: Spec) -> Architecture:
    """The architecture a recipe's dense model is (for the native export)."""
    if spec["position_embedding"] == "learned":
        return ARCHITECTURES["gpt2"]
    if spec["parallel_residual"]:
        return ARCHITECTURES["gpt_neox"]
    if spec["norm_type"] == "gemma_rmsnorm":
        return ARCHITECTURES["gemma"]
    return ARCHITECTURES["llama"]


# what an accepted difference changes in the numbers, and how to get transformers' (docs/FIDELITY.md)
ACCEPTED_NOTES = {
    ("ffn_type", "gelu_tanh", "gelu"):
        "computed with GELU's tanh approximation, the formula Pythia trained with (GPT-NeoX's fused bias-GELU), "
        "where transformers computes the exact GELU config.json names: each activation differs by up to 4.7e-4, the "
        "logits by about 1e-3 (1.7e-3 for Pythia-1B); for transformers' logits set the recipe's FFN type to gelu "
        "(--set model.layers[0].ffn.type=gelu in the Pythia recipes)",
}


def check_against_recipe(arch: Architecture, hf: dict[str, Any], spec: Spec, source: str) -> None:
    """Every field where config.json and the recipe's model differ, one line each naming both values."""
    lines = []
    for field, (accepted, where) in arch.expected(hf).items():
        ours = spec[field]
        if field in ("rope_base", "rope_fraction") and not spec["rotary"]:
            continue  # reported once, as `rotary`
        if isinstance(accepted[0], AtMost):
            if ours > accepted[0].limit:
                lines.append(f"{FIELD_PATHS[field]}: {ours!r} in the recipe, longer than {accepted[0].limit} in "
                             f"config.json ({where})")
            continue
        if ours not in accepted:
            theirs = accepted[0] if len(accepted) == 1 else " or ".join(map(repr, accepted))
            lines.append(f"{FIELD_PATHS[field]}: {ours!r} in the recipe, {theirs!r} in config.json ({where})")
        elif ours != accepted[0]:
            log.warning("%s: %r in the recipe, %r in %s's config.json (%s): accepted, the same weights; %s",
                        FIELD_PATHS[field], ours, accepted[0], source, where,
                        ACCEPTED_NOTES.get((field, ours, accepted[0]), "computed as the recipe says"))
    if lines:
        raise UserError(f"{source} ({arch.hf_class}) does not match the recipe's model:\n  " + "\n  ".join(lines))


def dense_recipe(arch: Architecture, hf: dict[str, Any]) -> dict[str, Any]:
    """The model section of the recipe that builds the model config.json describes (each field's canonical value:
    what moep-import without --config writes)."""
    e = {field: accepted[0] for field, (accepted, _) in arch.expected(hf).items()}
    positions = e.get("max_seq_len", AtMost(2048))
    rope = {"base": e["rope_base"], "fraction": e["rope_fraction"]} if e["rotary"] else None
    attention = {"num_heads": e["num_heads"], "num_kv_heads": e["num_kv_heads"], "head_dim": e["head_dim"],
                 "bias": e["attention_bias"], "window": e["window"], "rope": rope}
    # a LayerNorm's bias as config.json says; an RMSNorm has none (the field keeps its default)
    norm = {"type": e["norm_type"], "eps": e["norm_eps"], **({"bias": e["norm_bias"]} if "norm_bias" in e else {})}
    final_norm = {"type": e["final_norm_type"], "eps": e["final_norm_eps"],
                  **({"bias": e["final_norm_bias"]} if "final_norm_bias" in e else {})}
    layer = {"type": "dense", "repeat": e["num_layers"], "attention": attention, "norm": norm,
             "ffn": {"type": e["ffn_type"], "hidden_size": e["ffn_hidden"], "bias": e["ffn_bias"]},
             "parallel_residual": e["parallel_residual"]}
    return {"vocab_size": e["vocab_size"], "d_model": e["d_model"],
            "max_seq_len": positions.limit if isinstance(positions, AtMost) else positions,
            "tie_embeddings": e["tie_embeddings"], "position_embedding": e["position_embedding"],
            "embedding_scale": e["embedding_scale"], "final_norm": final_norm, "layers": [layer]}


def hf_config(spec: Spec, arch: Architecture, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the native export: the architecture's own keys, from the model's Spec."""
    return {"architectures": [arch.hf_class], "model_type": arch.model_type, "vocab_size": spec["vocab_size"],
            "tie_word_embeddings": spec["tie_embeddings"], **arch.hf_config(spec), "dtype": "float32",
            **(extra or {})}


__all__ = ["ARCHITECTURES", "Architecture", "Rule", "Spec", "architecture_of_spec",
           "check_against_recipe", "dense_recipe", "hf_config", "spec_of"]
