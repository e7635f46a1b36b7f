"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU MLP, biases everywhere; Conv1D weights stored
[in, out] (ours [out, in]), c_attn rows = [q | k | v] as our w_qkv.

# D model dim, F FFN hidden dim
"""
from __future__ import annotations

import re

from moep_ds.interop.adapter import Inexpressible, Raw
from moep_ds.interop.hf_layout import (MLP_ACTIVATIONS, DenseFamily, Expected, Spec, activation, common, get,
                                       norm_rules, unsupported)
from moep_ds.interop.rules import Rule, same, transposed, with_bias


class GPT2(DenseFamily):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    base_prefix = "transformer."
    buffers = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")  # the causal mask of older files

    def expected(self, hf: Raw) -> Expected:
        unsupported("gpt2", hf, {"scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
                                 "add_cross_attention": False})
        d, heads = hf["n_embd"], hf["n_head"]
        inner, inner_key = get(hf, "n_inner")
        act, act_key = get(hf, "activation_function", default="gelu_new")
        eps, eps_key = get(hf, "layer_norm_epsilon", default=1e-5)
        positions, pos_key = get(hf, "n_positions", "n_ctx", default=1024)
        tie, tie_key = get(hf, "tie_word_embeddings", default=True)
        layernorm = (("layernorm",), "GPT-2's LayerNorm")
        return {**common(hf, d, heads, hf["n_layer"]), "num_kv_heads": ((heads,), "n_head"),
                "head_dim": ((d // heads,), "n_embd / n_head"), "attention_bias": ((True,), "GPT-2's biases"),
                "rotary": ((False,), "learned positions"),
                "ffn_type": ((activation(MLP_ACTIVATIONS, act, act_key),), act_key),
                "ffn_hidden": ((inner or 4 * d,), inner_key if inner else "n_inner null: 4 x n_embd"),
                "ffn_bias": ((True,), "GPT-2's biases"), "norm_type": layernorm, "norm_eps": ((eps,), eps_key),
                "norm_bias": ((True,), "GPT-2's LayerNorm"), "final_norm_type": layernorm,
                "final_norm_eps": ((eps,), eps_key), "final_norm_bias": ((True,), "GPT-2's LayerNorm"),
                "parallel_residual": ((False,), "sequential residual"), "tie_embeddings": ((tie,), tie_key),
                "position_embedding": (("learned",), "learned positions"), "max_seq_len": ((positions,), pos_key)}

    def refuse(self, spec: Spec) -> None:
        if spec["position_embedding"] != "learned":
            raise Inexpressible(f"model.position_embedding: {spec['position_embedding']!r} in the model (GPT-2's "
                                "positions are learned)")

    def config(self, s: Spec) -> Raw:
        return {"n_embd": s["d_model"], "n_layer": s["num_layers"], "n_head": s["num_heads"],
                "n_inner": s["ffn_hidden"], "n_positions": s["max_seq_len"],
                "activation_function": {"gelu_tanh": "gelu_new"}.get(s["ffn_type"], s["ffn_type"]),
                "layer_norm_epsilon": s["norm_eps"], "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

    def outer_rules(self, s: Spec) -> list[Rule]:
        return [same("embed.weight", "transformer.wte.weight"), same("pos_embed.weight", "transformer.wpe.weight"),
                *norm_rules("norm", "transformer.ln_f", True)]

    def layer_rules(self, s: Spec, i: int) -> list[Rule]:
        h, ours = f"transformer.h.{i}", f"blocks.{i}"
        return [*norm_rules(f"{ours}.attention.norm", f"{h}.ln_1", True),
                *with_bias(transposed, f"{ours}.attention.attn.w_qkv", f"{h}.attn.c_attn", True),
                *with_bias(transposed, f"{ours}.attention.attn.w_o", f"{h}.attn.c_proj", True),
                *norm_rules(f"{ours}.ffn_norm", f"{h}.ln_2", True),
                *with_bias(transposed, f"{ours}.ffn.w_in", f"{h}.mlp.c_fc", True),
                *with_bias(transposed, f"{ours}.ffn.w_out", f"{h}.mlp.c_proj", True)]


ADAPTER = GPT2()
