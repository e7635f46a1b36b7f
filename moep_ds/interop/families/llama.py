"""Llama (LlamaForCausalLM): RMSNorm, SwiGLU (gate_proj = our w1, up_proj = w3, down_proj = w2), RoPE, GQA, q / k / v
projections separate (ours one w_qkv, rows [q | k | v]). Gemma (gemma.py) is this family with its own choices
(`Llama`'s class attributes and `activation_of`): both rotate dim i with i + Dh/2 (rotate_half), as ours does, so q
and k rows copy unpermuted.

# H query heads, G key/value heads, Dh head dim, D model dim
"""
from __future__ import annotations

from typing import Any

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Inexpressible, Raw
from moep_ds.interop.hf_layout import (GATED_ACTIVATIONS, DenseFamily, Expected, Spec, activation, at_most_positions,
                                       common, get, norm_rules, rope_parameters, unsupported)
from moep_ds.interop.rules import Rule, concatenated, same, with_bias


class Llama(DenseFamily):
    model_type = "llama"
    hf_class = "LlamaForCausalLM"
    norm = "rmsnorm"
    tied = False  # tie_word_embeddings when config.json does not say
    scaled = False  # embeddings x sqrt(D)
    activation_key = "hidden_act"  # the activation's key in config.json

    def activation_of(self, hf: Raw) -> tuple[Any, str]:
        return get(hf, "hidden_act", default="silu")

    def default_head_dim(self, d: int, heads: int) -> int:
        return d // heads

    def expected(self, hf: Raw) -> Expected:
        unsupported(self.model_type, hf, {"pretraining_tp": 1, "sliding_window": None})
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv, kv_key = get(hf, "num_key_value_heads", default=heads)
        head_dim, head_key = get(hf, "head_dim", default=self.default_head_dim(d, heads))
        rope, extra = rope_parameters(hf)
        if extra["rope_type"] != "default":
            raise UserError(f"config.json: rope type {extra['rope_type']!r} ({self.model_type}) has no moep_ds "
                            "counterpart (supported: 'default')")
        act, act_key = self.activation_of(hf)
        eps, eps_key = get(hf, "rms_norm_eps", default=1e-6)
        tie, tie_key = get(hf, "tie_word_embeddings", default=self.tied)
        norm = ((self.norm,), self.model_type)
        return {**common(hf, d, heads, hf["num_hidden_layers"]), **rope, "num_kv_heads": ((kv or heads,), kv_key),
                "head_dim": ((head_dim or d // heads,), head_key),
                "attention_bias": ((bool(hf.get("attention_bias", False)),), "attention_bias"),
                "ffn_type": ((activation(GATED_ACTIVATIONS, act, act_key),), act_key),
                "ffn_hidden": ((hf["intermediate_size"],), "intermediate_size"),
                "ffn_bias": ((bool(hf.get("mlp_bias", False)),), "mlp_bias"), "norm_type": norm,
                "norm_eps": ((eps,), eps_key), "final_norm_type": norm, "final_norm_eps": ((eps,), eps_key),
                "parallel_residual": ((False,), "sequential residual"), "tie_embeddings": ((tie,), tie_key),
                "position_embedding": (("none",), "rotary positions"),
                "embedding_scale": ((self.scaled,), "Gemma scales embeddings by sqrt(hidden_size)" if self.scaled
                                    else "unscaled"),
                **at_most_positions(hf)}

    def refuse(self, spec: Spec) -> None:
        if spec["position_embedding"] == "learned":
            raise Inexpressible(f"model.position_embedding: 'learned' in the model ({self.hf_class}'s positions are "
                                "rotary)")
        if spec["parallel_residual"]:
            raise Inexpressible(f"model.layers[*].parallel_residual: True in the model ({self.hf_class}'s residual "
                                "is sequential)")
        if (spec["norm_type"] == "gemma_rmsnorm") != (self.norm == "gemma_rmsnorm"):  # the (1 + w) norm is Gemma's
            raise Inexpressible(f"model.layers[*].norm.type: {spec['norm_type']!r} in the model, {self.norm!r} in "
                                f"{self.hf_class}")

    def config(self, s: Spec) -> Raw:
        act = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}.get(s["ffn_type"], s["ffn_type"])
        return {"hidden_size": s["d_model"], "intermediate_size": s["ffn_hidden"],
                "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_heads"],
                "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"],
                "max_position_embeddings": s["max_seq_len"], "rms_norm_eps": s["norm_eps"],
                "attention_bias": s["attention_bias"], "rope_theta": s["rope_base"],
                "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_base"]},
                self.activation_key: act, **self.extra_config(s)}

    def extra_config(self, s: Spec) -> Raw:
        return {"mlp_bias": s["ffn_bias"]}

    def outer_rules(self, s: Spec) -> list[Rule]:
        return [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]

    def layer_rules(self, s: Spec, i: int) -> list[Rule]:
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


ADAPTER = Llama()
