"""Small randomly initialised transformers MoE models of the nine families (DeepSeek-V3 also without a
low-rank query, DeepSeek-V2 also as V2-Lite: greedy routing, a full-rank query, gpt-oss also with its experts in
MXFP4 as released), every weight moved off its initial value and DeepSeek's and GLM-4.5's selection bias
non-zero, and the experts each one's routers choose.

# B batch, T tokens, V vocabulary, E experts, L layers
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hf_models import perturbed

transformers = __import__("pytest").importorskip("transformers")

V, D, T, E = 300, 32, 16, 8
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
COMMON = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, max_position_embeddings=64,
              tie_word_embeddings=False, **NO_SPECIAL_TOKENS)
YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 1.0}
YARN_NO_MSCALE = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                  "beta_fast": 8.0, "beta_slow": 1.0}


def hf_config(case: str) -> Any:
    if case == "mixtral":  # GQA, a sliding window shorter than the test's sequences
        return transformers.MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2,
                                          num_local_experts=E, num_experts_per_tok=2, sliding_window=6,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if case == "qwen2_moe":  # layer 1 dense (mlp_only_layers), q/k/v biases, sigmoid-gated shared expert
        return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=12,
                                           shared_expert_intermediate_size=20, num_hidden_layers=3,
                                           num_key_value_heads=2, num_experts=E, num_experts_per_tok=2,
                                           mlp_only_layers=[1], norm_topk_prob=False)
    if case == "qwen3_moe":  # every second layer an MoE (decoder_sparse_step), head_dim not D / heads, QK-norm per head
        return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=12,
                                           num_hidden_layers=2, num_key_value_heads=2, head_dim=12, num_experts=E,
                                           num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=True)
    if case == "olmoe":  # QK-norm over the whole projections, GQA
        return transformers.OlmoeConfig(**COMMON, intermediate_size=12, num_hidden_layers=2, num_key_value_heads=2,
                                        num_experts=E, num_experts_per_tok=2, norm_topk_prob=False)
    if case in ("deepseek_v3", "deepseek_v3_no_q_lora"):  # MLA (YaRN with the low-rank query), 1 dense layer first
        q_lora = case == "deepseek_v3"
        return transformers.DeepseekV3Config(
            **COMMON, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3, num_key_value_heads=4,
            n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16 if q_lora else None,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
            rope_parameters=dict(YARN) if q_lora else {"rope_type": "default", "rope_theta": 1e4})
    if case == "deepseek_v2":  # DeepSeek-V2's group-limited greedy routing (softmax), low-rank query, YaRN
        return transformers.DeepseekV2Config(
            **COMMON, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3, num_key_value_heads=4,
            n_routed_experts=E, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=2.0, q_lora_rank=16, kv_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_parameters=dict(YARN))
    if case == "deepseek_v2_lite":  # DeepSeek-V2-Lite's shape: greedy top-k, a full-rank query, no dense layer
        return transformers.DeepseekV2Config(
            **COMMON, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2, num_key_value_heads=4,
            n_routed_experts=E, num_experts_per_tok=2, topk_method="greedy", first_k_dense_replace=0,
            n_shared_experts=1, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if case == "qwen3_next":  # Gated DeltaNet and gated attention layers, layer 2 dense (mlp_only_layers), GQA,
        # head_dim not D / heads, half of each head rotated, more value heads than key heads, a conv of width 3
        return transformers.Qwen3NextConfig(
            **COMMON, intermediate_size=40, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_hidden_layers=4, num_key_value_heads=2, head_dim=12, num_experts=E, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[2],
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_conv_kernel_dim=3, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5})
    if case == "glm4_moe":  # DeepSeek-V3's MoE over GQA: 1 dense layer first, groups, q/k/v biases, QK-norm per head,
        # RoPE on half of a head_dim that is not D / heads
        return transformers.Glm4MoeConfig(
            **COMMON, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3, num_key_value_heads=2,
            head_dim=12, n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    if case in ("gpt_oss", "gpt_oss_mxfp4"):  # sliding (window < T) and full layers, sinks, YaRN, a clamp that bites
        return transformers.GptOssConfig(
            **COMMON, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
            num_local_experts=E, num_experts_per_tok=2, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3, swiglu_alpha=1.5,
            router_aux_loss_coef=0.9, rope_parameters={**YARN_NO_MSCALE, "truncate": False})
    raise KeyError(case)


CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
           "deepseek_v3_no_q_lora": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
           "deepseek_v2_lite": "DeepseekV2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
           "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "gpt_oss_mxfp4": "GptOssForCausalLM"}
CASES = list(CLASSES)


def hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    # routers far from uniform (clear choices), gpt-oss's sinks large enough to matter, everything else moved off its
    # initial value
    model = perturbed(CLASSES[case], hf_config(case), seed,
                      lambda name: 1.0 if name.endswith(("gate.weight", "router.weight", "sinks")) else 0.05)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


# the source's own special tokens (as a release has them, eos a list in generation_config.json): the native export
# carries them through (issue 45)
SOURCE_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SOURCE_GENERATION = {**SOURCE_TOKENS, "eos_token_id": [2, 7], "temperature": 0.7, "do_sample": True}


def hf_source(case: str, folder: Path) -> torch.nn.Module:
    """The case's model saved into `folder` as transformers saves it, and transformers' model of that folder (the
    reference). gpt_oss_mxfp4: the experts stored as the release stores them, MXFP4 blocks and scales with
    quantization_config mxfp4, and the reference loaded as transformers dequantises them (Mxfp4Config(dequantize))."""
    model = hf_model(case)
    model.config.update(SOURCE_TOKENS)
    model.generation_config = transformers.GenerationConfig(**SOURCE_GENERATION)
    model.save_pretrained(folder)
    if not case.endswith("_mxfp4"):
        return model
    quantise_experts(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()


def quantise_experts(folder: Path) -> None:
    """gate_up_proj / down_proj of model.safetensors as *_blocks / *_scales, quantization_config as the release's."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[f"{key}_blocks"], state[f"{key}_scales"] = mxfp4_quantised(state.pop(key))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def mxfp4_quantised(w_EIR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, inputs, rows] -> MXFP4 blocks [E, R, I/32, 16] and scales [E, R, I/32]: per block of 32 inputs the
    smallest power of two that brings its largest value within 6, each value rounded to the nearest e2m1."""
    from moep_ds.interop.mxfp4 import FP4_E2M1, SCALE_BIAS

    E, I, R = w_EIR.shape
    x_ERGV = w_EIR.float().transpose(1, 2).reshape(E, R, I // 32, 32)
    exponent_ERG = torch.ceil(torch.log2(x_ERGV.abs().amax(-1) / 6)).clamp(-SCALE_BIAS, SCALE_BIAS)
    y_ERGV = x_ERGV / torch.exp2(exponent_ERG)[..., None]
    magnitudes = torch.tensor(FP4_E2M1[:8])
    nibble = ((y_ERGV.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (y_ERGV < 0)).to(torch.uint8)
    return nibble[..., 0::2] | (nibble[..., 1::2] << 4), (exponent_ERG + SCALE_BIAS).to(torch.uint8)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def hf_choices(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and, per MoE layer, the [B*T, E] mask of the experts each token went to (transformers' routers)."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    return run_recording(model, input_ids, routers, lambda out: mask(out[2]))


def our_choices(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from moep_ds.routing.topk import TopKRouter

    def chosen(plan) -> torch.Tensor:
        out = torch.zeros(plan.num_tokens, E, dtype=torch.bool)
        out[plan.token_idx_S, plan.expert_idx_S()] = True
        return out

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return run_recording(model, input_ids, routers, chosen)


def mask(indices_TK: torch.Tensor) -> torch.Tensor:
    return torch.zeros(indices_TK.shape[0], E, dtype=torch.bool).scatter_(1, indices_TK, True)


def run_recording(model, input_ids, routers, choice) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append(choice(out))) for r in routers]
    try:
        with torch.no_grad():
            logits = model(input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(routers) > 0
    return logits, seen
