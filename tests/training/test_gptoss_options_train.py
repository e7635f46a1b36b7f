"""gpt-oss's layer options from scratch: attention sinks (one sliding, one full layer), clamped_swiglu experts with
biases and a router bias in a tiny ffn_moe model, trained a few steps on CPU with activation checkpointing
(identical losses and gradients to the plain model; every new parameter gets a gradient); `--dry_run`'s counts
include the new parameters."""
from __future__ import annotations

import pathlib

import torch

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.models.accounting import meta_param_report
from moep_ds.training.blocks import apply_block_options
from test_blocks import train
from tiny import recipe

L, H, E, F, D = 2, 4, 4, 16, 32


def gpt_oss_layer(window: int | None) -> dict:
    return {"type": "ffn_moe", "attention": {"num_heads": H, "num_kv_heads": 2, "sinks": True, "bias": True,
                                             "window": window},
            "moe": {"num_experts": E, "expert": {"type": "clamped_swiglu", "hidden_size": F, "bias": True,
                                                 "limit": 7.0},
                    "router": {"type": "topk", "k": 2, "renormalize": True, "bias": True}}}


def gpt_oss_recipe() -> dict:
    r = recipe("top2", pathlib.Path("unused"))
    r["model"]["layers"] = [gpt_oss_layer(8), gpt_oss_layer(None)]
    return r


def tiny_gpt_oss(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(config_from_dict(gpt_oss_recipe()).model)


def test_gpt_oss_options_train_with_activation_checkpointing():
    plain, ckpt = tiny_gpt_oss(), tiny_gpt_oss()
    apply_block_options(ckpt, activation_checkpointing=True, compile=False)
    losses_plain, grads_plain = train(plain, 4, one_batch=True)
    losses_ckpt, grads_ckpt = train(ckpt, 4, one_batch=True)
    assert losses_ckpt == losses_plain and losses_plain[-1] < losses_plain[0]
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)
    new = [n for n in grads_plain if n.endswith(("attn.sinks", "router.bias", "experts.b1_EF", "experts.b3_EF"))]
    assert len(new) == 4 * L and all(grads_plain[n].abs().sum() > 0 for n in new), new


def plain_recipe() -> dict:
    """The same model without the three options (and without expert biases)."""
    r = gpt_oss_recipe()
    for layer in r["model"]["layers"]:
        layer["attention"]["sinks"] = False
        layer["moe"]["router"]["bias"] = False
        layer["moe"]["expert"] = {"type": "swiglu", "hidden_size": F}
    return r


def test_dry_run_counts_include_sinks_router_bias_and_expert_biases():
    with_options = config_from_dict(gpt_oss_recipe()).model
    plain = config_from_dict(plain_recipe()).model
    extra = meta_param_report(with_options).params_total - meta_param_report(plain).params_total
    assert extra == L * (H + E + E * (2 * F + D))  # sinks, router bias, expert biases b1, b3, b2
    active = meta_param_report(with_options).params_active - meta_param_report(plain).params_active
    assert active == L * (H + E + 2 * (2 * F + D))  # k = 2 experts' biases per token


def test_moep_plan_holds_sinks_and_router_bias_replicated_and_its_share_of_expert_biases():
    from moep_ds.planning.hardware import assumptions, hardware
    from moep_ds.planning.layout import Cluster
    from moep_ds.planning.plan import plan_run

    def inventory(raw: dict):
        raw["train"]["expert_parallel_size"] = 2
        return plan_run(config_from_dict(raw), {"zero_optimization": {"stage": 2}}, Cluster(4, 2), hardware("h100"),
                        assumptions()).inventory

    ours, plain = inventory(gpt_oss_recipe()), inventory(plain_recipe())
    assert ours.dense_params - plain.dense_params == L * (H + E)  # sinks and router bias on every rank
    assert ours.expert_params - plain.expert_params == L * (E // 2) * (2 * F + D)  # this rank's experts' biases


def test_paths_refuse_sinks_their_routed_attention_cannot_apply():
    import pytest
    from moep_ds.schema import ConfigError

    r = recipe("paths", pathlib.Path("unused"))
    r["model"]["layers"][0]["attention"]["sinks"] = True
    with pytest.raises(ConfigError, match=r"^model\.layers\[0\]\.attention\.sinks \(True\) is not supported by the "
                                          r"paths' routed attention \(give path_attention without sinks\)$"):
        config_from_dict(r)


def test_native_export_refuses_what_llama_and_mixtral_cannot_express():
    import pytest
    from moep_ds.errors import UserError
    from moep_ds.interop.export_native import native_format

    def dense(**change) -> dict:
        r = recipe("nova_moe", pathlib.Path("unused"))
        r["model"]["layers"] = r["model"]["layers"][:1]
        for key, value in change.items():
            r["model"]["layers"][0][key] = {**r["model"]["layers"][0].get(key, {}), **value}
        return config_from_dict(r).model

    # no dense family takes sinks: the nearest family named is whichever differs in fewest settings (Qwen3-Next
    # takes dense layers too)
    with pytest.raises(UserError, match=r"^no Hugging Face architecture expresses this model: the nearest, \w+, "):
        native_format(dense(attention={"sinks": True}))
    with pytest.raises(UserError, match=r"^no Hugging Face architecture expresses this model: the nearest, \w+, "):
        native_format(dense(ffn={"type": "clamped_swiglu", "limit": 7.0}))
    for where, key, value in (("attention", "sinks", True), ("moe.router", "bias", True)):
        r = recipe("top2", pathlib.Path("unused"))
        section = r["model"]["layers"][0]
        for part in where.split("."):
            section = section[part]
        section[key] = value
        with pytest.raises(UserError, match=rf"differs first at model\.layers\[0\]\.{where}\.{key}: False in "
                                            r"MixtralForCausalLM, True in the model"):
            native_format(config_from_dict(r).model)
