"""The ffn_moe block and the nova_moe / mixtral_tiny recipes (Nova-MoE's own test list first)."""
import math

import pytest
import torch

from moep_ds import build_model, load_config
from moep_ds.blocks.ffn_moe import FFNMoEBlock
from moep_ds.config import config_from_dict
from moep_ds.models.accounting import meta_param_report
from moep_ds.routing.expert_choice import ExpertChoiceRouter
from moep_ds.schema import ConfigError

from repo_paths import CONFIGS

MOE_LAYERS = [1, 3, 5, 7]  # Nova's layers 2, 4, 6, 8
SHRINK = [  # nova_moe's architecture at toy width
    "model.vocab_size=64",
    "model.d_model=32",
    "model.max_seq_len=64",
    "model.layers[0].layers[0].ffn.hidden_size=48",
    "model.layers[0].layers[1].moe.expert.hidden_size=48",
]


def tiny_nova(*overrides: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(load_config(CONFIGS / "nova_moe.yaml", [*SHRINK, *overrides]).model)


# --- Nova-MoE's test list ---------------------------------------------------------------------------------

def test_nova_moe_active_parameters_exact_and_close_to_dense():
    moe = meta_param_report(load_config(CONFIGS / "nova_moe.yaml").model)
    dense = meta_param_report(load_config(CONFIGS / "nova_dense.yaml").model)
    assert moe.params_active == 34_529_792 == dense.params_total + 4 * 512 * 8
    assert dense.params_active == 34_513_408
    assert (moe.params_active - dense.params_active) / dense.params_active < 0.0005
    assert moe.params_total == dense.params_total + 4 * (7 * 3 * 512 * 2048 + 512 * 8)


def test_nova_moe_layout():
    cfg = load_config(CONFIGS / "nova_moe.yaml").model
    layers = cfg.expanded_layers()
    assert [layer.type for layer in layers] == ["dense", "ffn_moe"] * 4
    for i in MOE_LAYERS:
        moe = layers[i].moe
        assert (moe.num_experts, moe.expert.type, moe.expert.hidden_size) == (8, "swiglu", 2048)
        r = moe.router
        assert (r.type, r.capacity_factor, r.rounding, r.score) == ("expert_choice", 1.25, "ceil", "softmax_tokens")
        attention = layers[i].attention
        assert (attention.num_heads, attention.num_kv_heads, layers[i].norm.type) == (8, 2, "rmsnorm")


def test_ceil_capacity_with_odd_token_counts_and_drop_metrics():
    model = tiny_nova().train()
    ids = torch.randint(0, 64, (1, 13))  # 13 tokens: 1.25 * 13 / 8 = 2.03 -> 3 per expert
    out = model(ids, labels=ids)
    for i in MOE_LAYERS:
        assert out.stats[f"layers.{i}.tokens_per_expert"].tolist() == [3.0] * 8
        dropped = out.stats[f"layers.{i}.dropped_fraction"].item()
        assert 1 - 24 / 13 <= dropped <= 1 - 3 / 13  # at most 8*3 tokens covered, at least one expert's 3
        assert 0 < out.stats[f"layers.{i}.router_entropy"].item() <= math.log(8) + 1e-6
    ids = torch.randint(0, 64, (3, 7))  # scope batch: N = 21 -> ceil(3.28) = 4
    assert model(ids).stats["layers.1.tokens_per_expert"].tolist() == [4.0] * 8


def test_output_shape_and_gradient_reaches_router_weights():
    model = tiny_nova().train()
    ids = torch.randint(0, 64, (2, 9))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 9, 64)
    out.loss.backward()
    for i in MOE_LAYERS:
        grad = model.blocks[i].moe.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_every_expert_of_every_moe_layer_gets_gradients_within_a_few_steps():
    model = tiny_nova().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {i: torch.zeros(8) for i in MOE_LAYERS}
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16))
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        for i in MOE_LAYERS:
            experts = model.blocks[i].moe.experts
            for p in (experts.w1_EDF, experts.w2_EFD, experts.w3_EDF):
                seen[i] += p.grad.abs().flatten(1).sum(1)
        opt.step()
    for i in MOE_LAYERS:
        assert (seen[i] > 0).all(), f"layer {i}: experts without gradient {seen[i]}"


# --- evaluation semantics -----------------------------------------------------------------------------------

def trained_thresholds(model, steps: int = 3):
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randint(0, 64, (4, 16)))
    return model.eval()


def test_threshold_eval_is_causal_and_batch_invariant():
    model = trained_thresholds(tiny_nova().double())
    routers = [m for m in model.modules() if isinstance(m, ExpertChoiceRouter)]
    assert len(routers) == 4 and all(r.num_threshold_updates.item() == 3 for r in routers)
    ids = torch.randint(0, 64, (16, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(changed)
        alone = model(ids[:1]).logits
    torch.testing.assert_close(a.logits[0, :8], b.logits[0, :8], rtol=0, atol=1e-12)
    assert not torch.allclose(a.logits[0, 8:], b.logits[0, 8:])
    torch.testing.assert_close(alone[0], a.logits[0], rtol=0, atol=1e-12)
    # the thresholds really select: some but not all (token, expert) pairs
    covered = a.stats["layers.1.tokens_per_expert"].sum().item()
    assert 0 < covered < 16 * 12 * 8


def test_topk_eval_mode_is_not_causal():
    """What threshold mode is for: the training rule lets later tokens change earlier outputs."""
    model = trained_thresholds(tiny_nova("model.layers[0].layers[1].moe.router.eval_mode=topk").double())
    ids = torch.randint(0, 64, (2, 12))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 64
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert not torch.allclose(a[0, :10], b[0, :10])


def test_threshold_eval_works_with_kv_cache():
    model = trained_thresholds(tiny_nova().double())
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


# --- top-k recipe, aux losses, config -----------------------------------------------------------------------

def tiny_mixtral(**router):
    raw = {"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 32, "layers": [
        {"type": "dense", "attention": {"num_heads": 4}},
        {"type": "ffn_moe", "repeat": 2, "attention": {"num_heads": 4, "num_kv_heads": 2},
         "moe": {"num_experts": 8, "expert": {"hidden_size": 24},
                 "router": {"type": "topk", "k": 2, "z_loss_weight": 1e-3, **router}}}]}}
    return config_from_dict(raw).model


def test_model_sums_aux_losses_into_loss_and_reports_each():
    torch.manual_seed(0)
    model = build_model(tiny_mixtral())
    ids = torch.randint(0, 64, (2, 8))
    out = model(ids, labels=ids)
    names = {f"layers.{i}.{n}" for i in (1, 2) for n in ("load_balancing_loss", "router_z_loss")}
    assert set(out.aux_losses) == names
    torch.testing.assert_close(out.loss, out.ce_loss + sum(out.aux_losses.values()))
    assert all(v.requires_grad for v in out.aux_losses.values())
    assert {"layers.1.tokens_per_expert", "layers.2.dropped_fraction", "layers.2.router_entropy"} <= set(out.stats)


def test_mixtral_tiny_recipe():
    cfg = load_config(CONFIGS / "mixtral_tiny.yaml").model
    report = meta_param_report(cfg)
    d, f, e, layers, vocab = 256, 896, 8, 4, 8000
    attention = d * d * 2 + 2 * d * (d // 8 * 2)  # q, o and GQA k, v (2 KV heads of 32)
    per_layer_fixed = attention + 2 * d + d * e  # two RMSNorms, router
    embeddings = 2 * vocab * d  # untied, as Mixtral
    assert report.params_total == embeddings + d + layers * (per_layer_fixed + e * 3 * d * f)
    assert report.params_active == embeddings + d + layers * (per_layer_fixed + 2 * 3 * d * f)
    layer = cfg.expanded_layers()[0]
    router = layer.moe.router
    assert (router.type, router.k, router.renormalize, router.capacity_factor) == ("topk", 2, True, None)
    # Mixtral's coefficient 0.02 on one K * E * sum f P loss over all layers = 0.02 * K / L per layer here
    assert router.load_balancing_weight == pytest.approx(0.02 * router.k / layers)
    assert (cfg.tie_embeddings, layer.attention.rope.base) == (False, 1e6)


def test_parallel_residual_layout():
    torch.manual_seed(0)
    cfg = tiny_mixtral()
    block_cfg = cfg.layers[1]
    block_cfg.parallel_residual = True
    block = FFNMoEBlock(block_cfg, d_model=32, layer_idx=0)
    x = torch.randn(1, 5, 32)
    pos = torch.arange(5)[None]
    expected = x + block.attention(x, pos, None) + block.moe(block.ffn_norm(x)).y
    torch.testing.assert_close(block(x, positions_BT=pos).x, expected)


def test_config_error_names_the_layer():
    with pytest.raises(ConfigError, match=r"^model.layers\[1\].moe.router.k \(9\) must be <= num_experts \(8\)$"):
        tiny_mixtral(k=9)
    with pytest.raises(ConfigError, match=r"^model.layers\[0\].moe.expert.type: unknown ffn 'relu'; known: "
                                          r"clamped_swiglu, geglu, gelu, gelu_tanh, swiglu$"):
        config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "max_seq_len": 32, "layers": [
            {"type": "ffn_moe", "attention": {"num_heads": 4},
             "moe": {"num_experts": 4, "expert": {"type": "relu"}, "router": "topk"}}]}})
