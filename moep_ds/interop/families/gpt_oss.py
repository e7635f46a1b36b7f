"""gpt-oss (GptOssForCausalLM, model_type gpt_oss), both ways; transformers 5's modeling_gpt_oss.py is the reference.

# E experts, D model dim, F expert hidden dim, H heads, K top-k, L layers

    layers     every one an MoE (ffn_moe); layer_types says which attend in a sliding window (sliding_attention:
               sliding_window tokens, the query included) and which over the whole prefix (full_attention)
    attention  GQA with biases on q, k, v and o (attention_bias), one learned sink logit per head (`sinks`), head_dim,
               YaRN (rope_parameters, gpt-oss's with truncate false)
    router     logits = x W^T + b (in the activations' dtype); softmax over the K largest logits, which is the softmax
               over all E renormalised over the K chosen (our score softmax, renormalize, bias)
    experts    clamped SwiGLU with biases: gate = min(x W_g + b_g, limit), up = clamp(x W_u + b_u, +-limit),
               h = (up + 1) gate sigmoid(alpha gate), y = h W_d + b_d (our clamped_swiglu; limit = swiglu_limit,
               alpha = swiglu_alpha, 1.702 when config.json has none)

Load balancing as the other families convert it (moe_layout.py): alpha = router_aux_loss_coef x K / L.

Experts as transformers 5 stores them, one [E, ...] tensor per weight (GptOssExperts):
    gate_up_proj [E, D, 2F]  gate = columns 0, 2, 4, ... (our w1_EDF), up = columns 1, 3, 5, ... (our w3_EDF)
    gate_up_proj_bias [E, 2F] likewise (b1_EF, b3_EF); down_proj [E, F, D] = w2_EFD; down_proj_bias [E, D] = b2_ED
Released checkpoints (quantization_config.quant_method mxfp4) store gate_up_proj and down_proj as MXFP4
`*_blocks` [E, 2F, D/32, 16] / [E, D, F/32, 16] and `*_scales` [E, 2F, D/32] / [E, D, F/32] (interop/mxfp4.py),
dequantised on import as transformers dequantises them. Every expert weight is read by rows, so a process reads only
the experts it holds. The export writes the experts unquantised (float32) and no quantization_config.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moep_ds.errors import UserError
from moep_ds.interop.adapter import Family, Inexpressible, Raw
from moep_ds.interop.moe_layout import (causal_hf, causal_rules, common_hf, moe_hf, num_experts, parts_of, repeated,
                                        rope_of, softmax_router)
from moep_ds.interop.mxfp4 import blocks_shape, dequantize
from moep_ds.interop.rules import Rule, same
from moep_ds.layers.ffn import CLAMPED_ALPHA

LAYER_TYPES = ("full_attention", "sliding_attention")
QUANT_METHODS = ("mxfp4",)
# GptOssConfig's defaults where they are not the other families' (a config.json may leave them out)
DEFAULTS: Raw = {"attention_bias": True, "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128,
                 "swiglu_limit": 7.0, "swiglu_alpha": CLAMPED_ALPHA, "router_aux_loss_coef": 0.001,
                 "num_experts_per_tok": 4, "max_position_embeddings": 131072, "tie_word_embeddings": False}
DEFAULT_ROPE: Raw = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


def with_defaults(hf: Raw) -> Raw:
    out = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "sliding_window"}}
    if not out.get("rope_parameters") and not out.get("rope_scaling"):
        out["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": out.get("rope_theta", DEFAULT_ROPE["rope_theta"])}
    elif not out.get("rope_parameters"):  # the released config.json: rope_scaling beside rope_theta
        out["rope_theta"] = out.get("rope_theta", DEFAULT_ROPE["rope_theta"])
    return out


def alpha_of(hf: Raw) -> float | None:
    """swiglu_alpha as the recipe writes it: null for gpt-oss's 1.702 (FFNConfig's default), else the value."""
    alpha = float(hf["swiglu_alpha"])
    return None if alpha == CLAMPED_ALPHA else alpha


def layer_types(hf: Raw) -> list[str]:
    """Each layer's attention: the config's layer_types, else GptOssConfig's default (sliding first, alternating)."""
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise UserError(f"config.json: layer_types[{i}] = {kind!r} (gpt_oss) has no moep_ds counterpart "
                            f"(supported: {', '.join(LAYER_TYPES)})")
    if len(types) != L:
        raise UserError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers = {L}")
    return types


def periodic(blocks: list[Raw]) -> list[Raw]:
    """The blocks as one group repeating its shortest period (gpt-oss-20b: [sliding, full] x 12), else consecutive
    equal blocks merged (moe_layout.repeated)."""
    n = len(blocks)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and blocks == blocks[:period] * (n // period):
            if period == 1:
                break
            return [{"type": "group", "repeat": n // period, "layers": repeated(blocks[:period])}]
    return repeated(blocks)


def quantized(hf: Raw) -> bool:
    """Whether the checkpoint's experts are MXFP4 (the release); one line for any other quantization."""
    q = hf.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method not in QUANT_METHODS:
        raise UserError(f"config.json: quantization_config.quant_method = {method!r} (gpt_oss) has no moep_ds "
                        f"counterpart (supported: {', '.join(QUANT_METHODS)})")
    return True


# ---- tensors --------------------------------------------------------------------------------------------------


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
    """[..., F] gate and up -> [..., 2F] with the gate in the even columns."""
    return [torch.stack([gate, up], -1).flatten(-2).contiguous()]


def unwritable(*ours: torch.Tensor) -> list[torch.Tensor]:
    raise Inexpressible("MXFP4 experts are read, never written: the export writes them unquantised")


def gate_up_rules(gate: str, up: str, theirs: tuple[str, ...], fused: Callable[[list[torch.Tensor]], torch.Tensor],
                  writable: bool = True) -> list[Rule]:
    """Our gate and up ([..., F] each) from their fused [..., 2F] (`fused` of their tensors' rows), each expert from its
    own rows. Written back as one tensor by the gate's rule, which joins the up; the up's rule writes nothing."""
    return [Rule(gate, theirs, lambda ts: fused(ts)[..., 0::2].contiguous(), interleaved if writable else unwritable,
                 rowwise=True, joins=(up,)),
            Rule(up, theirs, lambda ts: fused(ts)[..., 1::2].contiguous(), lambda t: [], rowwise=True)]


def mxfp4_reader(keys: tuple[str, str], expected: tuple[int, int, int, int], what: str
                 ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Rows of an [E, inputs, rows] matrix from their MXFP4 blocks and scales; blocks or scales of another shape than
    config.json gives them: one line (the whole tensors' shapes are checked before anything is read)."""
    def read(ts: list[torch.Tensor]) -> torch.Tensor:
        for key, t, shape in zip(keys, ts, (expected, expected[:3])):
            whole = t.is_meta  # the import's shape pass sees whole tensors; reads see rows of them
            if tuple(t.shape[0 if whole else 1:]) != shape[0 if whole else 1:]:
                raise UserError(f"{key} has shape {list(t.shape)}; config.json's {what} make it {list(shape)}")
        return dequantize(ts[0], ts[1])

    return read


def experts_rules(ours: str, theirs: str, E: int, D: int, F: int, mxfp4: bool) -> list[Rule]:
    out = gate_up_rules(f"{ours}.b1_EF", f"{ours}.b3_EF", (f"{theirs}.gate_up_proj_bias",), lambda ts: ts[0])
    out.append(same(f"{ours}.b2_ED", f"{theirs}.down_proj_bias"))
    if not mxfp4:
        out += gate_up_rules(f"{ours}.w1_EDF", f"{ours}.w3_EDF", (f"{theirs}.gate_up_proj",), lambda ts: ts[0])
        return out + [same(f"{ours}.w2_EFD", f"{theirs}.down_proj")]
    sizes = f"num_local_experts {E}, hidden_size {D}, intermediate_size {F}"
    gate_up = (f"{theirs}.gate_up_proj_blocks", f"{theirs}.gate_up_proj_scales")
    down = (f"{theirs}.down_proj_blocks", f"{theirs}.down_proj_scales")
    out += gate_up_rules(f"{ours}.w1_EDF", f"{ours}.w3_EDF", gate_up,
                         mxfp4_reader(gate_up, blocks_shape(E, 2 * F, D), sizes), writable=False)
    read_down = mxfp4_reader(down, blocks_shape(E, D, F), sizes)
    return out + [Rule(f"{ours}.w2_EFD", down, read_down, unwritable, rowwise=True)]


# ---- the family -----------------------------------------------------------------------------------------------


class GptOss(Family):
    model_type = "gpt_oss"
    hf_class = "GptOssForCausalLM"

    def recipe(self, hf: Raw) -> Raw:
        hf = with_defaults(hf)
        quantized(hf)
        types = layer_types(hf)
        norm = {"type": "rmsnorm", "eps": hf["rms_norm_eps"]}
        attention = {"type": "causal", "num_heads": hf["num_attention_heads"],
                     "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
                     "head_dim": hf["head_dim"], "rope": rope_of(hf, "gpt_oss", yarn=True),
                     "bias": bool(hf["attention_bias"]), "sinks": True}
        moe = {"num_experts": num_experts(hf),
               "expert": {"type": "clamped_swiglu", "hidden_size": hf["intermediate_size"], "bias": True,
                          "limit": float(hf["swiglu_limit"]), "alpha": alpha_of(hf)},
               "router": {**softmax_router(hf, len(types), True, DEFAULTS["router_aux_loss_coef"]), "bias": True},
               "shared_expert": None}
        blocks = [{"type": "ffn_moe", "norm": norm, "moe": moe,
                   "attention": {**attention, "window": hf["sliding_window"] if kind == "sliding_attention" else None}}
                  for kind in types]
        return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"],
                "max_seq_len": hf["max_position_embeddings"], "tie_embeddings": bool(hf["tie_word_embeddings"]),
                "position_embedding": "none", "final_norm": norm, "layers": periodic(blocks)}

    def to_hf(self, model_cfg: Any) -> Raw:
        p = parts_of(model_cfg)
        dense = [i for i, s in enumerate(p.sparse) if not s]
        if dense:
            raise Inexpressible(f"model.layers (block {dense[0]}) is a dense block: every gpt_oss layer is an MoE")
        windows = sorted({layer.attention.window for layer in p.layers} - {None})
        if len(windows) > 1:
            raise Inexpressible(f"model.layers[*].attention.window: {windows} in the model; gpt_oss has one "
                                "sliding_window")
        expert = p.moe.expert
        if expert.type != "clamped_swiglu":
            raise Inexpressible(f"model.layers[*].moe.expert.type: {expert.type!r} in the model; gpt_oss's experts are "
                                "clamped_swiglu")
        out = {**common_hf(p, "causal"), **causal_hf(p), **moe_hf(p, "num_local_experts", "intermediate_size")}
        out.pop("norm_topk_prob")
        out.update(attention_bias=p.attention.bias, sliding_window=windows[0] if windows else None,
                   layer_types=["full_attention" if layer.attention.window is None else "sliding_attention"
                                for layer in p.layers],
                   swiglu_limit=expert.limit, swiglu_alpha=CLAMPED_ALPHA if expert.alpha is None else expert.alpha)
        return out

    def rules(self, model_cfg: Any, hf: Raw) -> list[Rule]:
        mxfp4 = quantized(hf)
        out = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
        if not model_cfg.tie_embeddings:
            out.append(same("head.weight", self.head_keys[0]))
        for i, layer in enumerate(model_cfg.expanded_layers()):
            ours, theirs = f"blocks.{i}", f"model.layers.{i}"
            attn = f"{ours}.attention.attn"
            out += [same(f"{ours}.attention.norm.weight", f"{theirs}.input_layernorm.weight"),
                    same(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
                    *causal_rules(layer.attention, attn, f"{theirs}.self_attn", model_cfg.d_model),
                    same(f"{attn}.sinks", f"{theirs}.self_attn.sinks"),
                    same(f"{ours}.moe.router.weight", f"{theirs}.mlp.router.weight"),
                    same(f"{ours}.moe.router.bias", f"{theirs}.mlp.router.bias")]
            moe = layer.moe
            out += experts_rules(f"{ours}.moe.experts", f"{theirs}.mlp.experts", moe.num_experts, model_cfg.d_model,
                                 moe.expert.hidden_size, mxfp4)
        return out


ADAPTER = GptOss()
