"""The full-size recipes that follow published MoE configs: their dry runs count the parameters (total, and active
per token as the family routes) that transformers' own model of the config.json counts (built on the meta device),
and each one moep-import reads is exactly the recipe its config.json stands for. The quick-start recipes export
natively.

# E experts, K experts per token
"""
from __future__ import annotations

import json

import pytest
import torch

from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.config import load_config
from moep_ds.interop.compare import model_differences
from moep_ds.interop.adapter import model_of
from moep_ds.interop.families import family_of

from repo_paths import CONFIGS

transformers = pytest.importorskip("transformers")

# the released config.json values that shape the model (the recipe's comment names each repository)
PUBLISHED = {
    "mixtral_8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "sliding_window": None, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "hidden_act": "silu"},
    "olmoe_1b_7b": {  # allenai/OLMoE-1B-7B-0924
        "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "norm_topk_prob": False, "clip_qkv": None, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "hidden_act": "silu"},
    "qwen3_30b_a3b": {  # Qwen/Qwen3-30B-A3B
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "use_sliding_window": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
        "hidden_act": "silu"},
    "qwen3_next_80b_a3b": {  # Qwen/Qwen3-Next-80B-A3B-Instruct
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_scaling": None,
        "router_aux_loss_coef": 0.001, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu"},
    "deepseek_v2_lite": {  # deepseek-ai/DeepSeek-V2-Lite
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                "mscale_all_dim": 0.707},
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "moe_layer_freq": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True,
        "tie_word_embeddings": False, "hidden_act": "silu"},
    "glm4_5_air": {  # zai-org/GLM-4.5-Air
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        "rope_scaling": None, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu"},
    "gpt_oss_20b": {  # openai/gpt-oss-20b (its experts in MXFP4: the count is of the dequantised model)
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "initial_context_length": 4096, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "attention_bias": True, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "tie_word_embeddings": False,
        "hidden_act": "silu", "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}},
}


def transformers_counts(published: dict) -> tuple[int, int]:
    """(total, active per token) of transformers' model of the config, built on the meta device: every parameter,
    less, in each MoE layer, the E - K experts a token does not visit."""
    config = transformers.AutoConfig.for_model(**published)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    k = published["num_experts_per_tok"]
    idle = 0
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            E = module.num_experts
            idle += sum(p.numel() for p in module.parameters()) // E * (E - k)
    return total, total - idle


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dry_run_counts_what_transformers_counts(name, capsys):
    assert pretrain_main(["--config", str(CONFIGS / f"{name}.yaml"), "--dry_run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["params_total"], report["params_active"]) == transformers_counts(PUBLISHED[name])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_is_what_moep_import_writes_for_the_config(name):
    published = PUBLISHED[name]
    expected = model_of(family_of(published, name).recipe(published), name)
    assert model_differences(expected, load_config(CONFIGS / f"{name}.yaml").model) == []


# the training settings a recipe chooses where moep-import writes config.json's (or the default): the recipe's
# comment says each, and why
RECIPE_CHOICES = {"olmoe_1b_7b": {"z_loss_weight": 0.001},  # the OLMoE paper's router z-loss
                  "qwen3_30b_a3b": {"load_balancing_scope": "global"},  # Qwen3's global-batch balancing
                  "qwen3_next_80b_a3b": {"load_balancing_scope": "global"}}  # the same, Qwen3-Next


def router_training(model_cfg) -> list[dict]:
    """Per MoE block, its router's training settings (those model_differences leaves out)."""
    from moep_ds.interop.compare import TRAINING_KEYS

    return [{k: getattr(layer.moe.router, k) for k in TRAINING_KEYS if hasattr(layer.moe.router, k)}
            for layer in model_cfg.expanded_layers() if layer.type == "ffn_moe"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_trains_as_moep_import_writes_but_for_its_stated_choices(name):
    """Issue 45 (C): qwen3_30b_a3b.yaml said it was exactly what moep-import writes, with global-batch balancing
    where moep-import writes micro_batch. Every router training setting is moep-import's, less RECIPE_CHOICES."""
    published = PUBLISHED[name]
    imported = router_training(model_of(family_of(published, name).recipe(published), name))
    recipe = router_training(load_config(CONFIGS / f"{name}.yaml").model)
    assert recipe == [{**router, **RECIPE_CHOICES.get(name, {})} for router in imported]
    for key, value in RECIPE_CHOICES.get(name, {}).items():
        assert all(router[key] != value for router in imported), f"{name}: {key} is no choice of the recipe"


QUICK_START_FORMATS = {"mixtral_tiny": "MixtralForCausalLM", "qwen_moe_tiny": "Qwen2MoeForCausalLM",
                       "olmoe_tiny": "OlmoeForCausalLM", "qwen3_moe_tiny": "Qwen3MoeForCausalLM",
                       "deepseek_v3_tiny": "DeepseekV3ForCausalLM", "glm4_moe_tiny": "Glm4MoeForCausalLM",
                       "qwen3_next_tiny": "Qwen3NextForCausalLM", "gpt_oss_tiny": "GptOssForCausalLM",
                       "deepseek_tiny": "Glm4MoeForCausalLM"}  # DeepSeek-V3's routing over GQA is GLM-4.5's


@pytest.mark.parametrize("name", sorted(QUICK_START_FORMATS))
def test_quick_start_recipes_have_a_native_format(name):
    from moep_ds.interop.export_native import native_format

    assert native_format(load_config(CONFIGS / f"{name}.yaml").model).hf_class == QUICK_START_FORMATS[name]


def test_a_router_that_keeps_all_its_groups_compares_as_one_without_groups():
    """num_groups G with group_topk G (or null) limits nothing, nor does a group_score with one group: the same
    model however written (a DeepSeek-V2 greedy config reads without groups, an export may write n_group 8 of 8);
    a real limit, or another group score under one, still differs (both MoE blocks: layers 1 and 2)."""
    def with_router(**fields):
        return load_config(CONFIGS / "deepseek_v3_tiny.yaml",
                           [f"model.layers[1].moe.router.{k}={v}" for k, v in fields.items()]).model

    base = with_router(num_groups=1, group_topk="null")
    assert model_differences(base, with_router(num_groups=4, group_topk=4)) == []
    assert model_differences(base, with_router(num_groups=4, group_topk="null", group_score="max")) == []
    assert model_differences(base, with_router(num_groups=1, group_topk=1, group_score="max")) == []
    assert model_differences(base, with_router(num_groups=4, group_topk=2)) == [
        f"model.layers[{i}].moe.router.{key}: {a} in SRC, {b} in the recipe" for i in (1, 2)
        for key, a, b in (("group_score", None, "'top2_sum'"), ("group_topk", None, 2), ("num_groups", 1, 4))]
    assert model_differences(with_router(num_groups=4, group_topk=2),
                             with_router(num_groups=4, group_topk=2, group_score="max")) == [
        f"model.layers[{i}].moe.router.group_score: 'top2_sum' in SRC, 'max' in the recipe" for i in (1, 2)]


@pytest.mark.parametrize("change,line", [
    ("model.layers[0].attention.bias=true", "model.layers[*].attention.bias: true in the model (glm4_moe's "
     "attention_bias puts biases on q, k and v only, none on o)"),
    ("model.layers[0].attention.rope.yarn={factor: 2.0, original_max_seq_len: 32}",
     "model.layers[*].attention.rope.yarn: set in the model (glm4_moe reads plain RoPE)")])
def test_what_glm4_moe_cannot_express_is_named(change, line):
    """A bias on o and YaRN have no field in glm4_moe's config.json: the family says so (Inexpressible)."""
    from moep_ds.interop.adapter import Inexpressible

    model = load_config(CONFIGS / "glm4_moe_tiny.yaml", [change]).model
    with pytest.raises(Inexpressible) as err:
        family_of({"model_type": "glm4_moe"}, "glm4_moe_tiny").to_hf(model)
    assert str(err.value) == line
