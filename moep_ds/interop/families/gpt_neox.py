"""GPT-NeoX / Pythia (GPTNeoXForCausalLM): partial rotary, parallel residual, LayerNorm, GELU MLP with biases;
query_key_value rows [H, 3, Dh] (q, k, v interleaved per head), ours [3, H, Dh]; the head is `embed_out` in Pythia's
files and `lm_head` in newer ones.

# H heads, Dh head dim
"""
from __future__ import annotations

import re

import torch

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Inexpressible, Raw
from moep_ds.interop.hf_layout import (MLP_ACTIVATIONS, DenseFamily, Expected, Spec, activation, at_most_positions,
                                       common, get, norm_rules, rope_parameters)
from moep_ds.interop.rules import Rule, same, with_bias


def neox_qkv(ours: str, theirs: str, heads: int, head_dim: int) -> Rule:
    """GPT-NeoX's query_key_value rows are [H, 3, Dh] (q, k, v interleaved per head); ours are [3, H, Dh]."""

    def to_ours(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].unflatten(0, (heads, 3, head_dim)).transpose(0, 1).flatten(0, 2).contiguous()

    def to_theirs(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.unflatten(0, (3, heads, head_dim)).transpose(0, 1).flatten(0, 2).contiguous()]

    return Rule(ours, (theirs,), to_ours, to_theirs)


class GPTNeoX(DenseFamily):
    model_type = "gpt_neox"
    hf_class = "GPTNeoXForCausalLM"
    base_prefix = "gpt_neox."
    head_keys = ("embed_out.weight", "lm_head.weight")
    buffers = re.compile(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")

    def expected(self, hf: Raw) -> Expected:
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
        layernorm = (("layernorm",), "GPT-NeoX's LayerNorm")
        return {**common(hf, d, heads, hf["num_hidden_layers"]), **rope, "num_kv_heads": ((heads,), "MHA"),
                "head_dim": ((d // heads,), "hidden_size / num_attention_heads"),
                "attention_bias": ((bias,), bias_key), "ffn_type": (ffn_types, act_key),
                "ffn_hidden": ((hf["intermediate_size"],), "intermediate_size"),
                "ffn_bias": ((True,), "GPT-NeoX's biases"), "norm_type": layernorm, "norm_eps": ((eps,), eps_key),
                "norm_bias": ((True,), "GPT-NeoX's LayerNorm"), "final_norm_type": layernorm,
                "final_norm_eps": ((eps,), eps_key), "final_norm_bias": ((True,), "GPT-NeoX's LayerNorm"),
                "parallel_residual": ((parallel,), parallel_key), "tie_embeddings": ((tie,), tie_key),
                "position_embedding": (("none",), "rotary positions"), **at_most_positions(hf)}

    def refuse(self, spec: Spec) -> None:
        if spec["position_embedding"] == "learned":
            raise Inexpressible("model.position_embedding: 'learned' in the model (GPT-NeoX's positions are rotary)")
        if not spec["parallel_residual"]:  # a sequential residual is Llama's or Gemma's
            raise Inexpressible("model.layers[*].parallel_residual: False in the model (exported as GPT-NeoX when "
                                "parallel)")

    def config(self, s: Spec) -> Raw:
        return {"hidden_size": s["d_model"], "intermediate_size": s["ffn_hidden"],
                "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_heads"],
                "max_position_embeddings": s["max_seq_len"],
                "hidden_act": {"gelu_tanh": "gelu_new"}.get(s["ffn_type"], s["ffn_type"]),
                "layer_norm_eps": s["norm_eps"], "use_parallel_residual": s["parallel_residual"],
                "attention_bias": s["attention_bias"], "rotary_pct": s["rope_fraction"],
                "rotary_emb_base": s["rope_base"],
                "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_base"],
                                    "partial_rotary_factor": s["rope_fraction"]},
                "hidden_dropout": 0.0, "attention_dropout": 0.0}

    def outer_rules(self, s: Spec) -> list[Rule]:
        return [same("embed.weight", "gpt_neox.embed_in.weight"),
                *norm_rules("norm", "gpt_neox.final_layer_norm", True)]

    def layer_rules(self, s: Spec, i: int) -> list[Rule]:
        layer, ours = f"gpt_neox.layers.{i}", f"blocks.{i}"
        qkv = [neox_qkv(f"{ours}.attention.attn.w_qkv.{kind}", f"{layer}.attention.query_key_value.{kind}",
                        s["num_heads"], s["head_dim"]) for kind in ("weight", "bias")[:2 if s["attention_bias"] else 1]]
        return [*norm_rules(f"{ours}.attention.norm", f"{layer}.input_layernorm", True), *qkv,
                *with_bias(same, f"{ours}.attention.attn.w_o", f"{layer}.attention.dense", s["attention_bias"]),
                *norm_rules(f"{ours}.ffn_norm", f"{layer}.post_attention_layernorm", True),
                *with_bias(same, f"{ours}.ffn.w_in", f"{layer}.mlp.dense_h_to_4h", True),
                *with_bias(same, f"{ours}.ffn.w_out", f"{layer}.mlp.dense_4h_to_h", True)]


ADAPTER = GPTNeoX()
