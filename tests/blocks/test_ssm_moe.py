"""MoE-Stream block: the two residual equations, causality, load balancing, decoding with an SSM cache, and
the `moe_stream` recipe."""
from __future__ import annotations

import torch

from moep_ds.blocks.ssm_moe import SSMMoEBlock, SSMMoEBlockConfig
from moep_ds.config import config_from_dict, load_config
from moep_ds.models.accounting import meta_param_report
from moep_ds.models.causal_lm import build_model
from moep_ds.registry import BLOCKS
from moep_ds.routing.lifecycle import ExpertLifecycle
from moep_ds.routing.topk import load_balancing_loss
from moep_ds.schema import parse_registered
from repo_paths import CONFIGS

# B batch, T tokens, D model dim, E experts

D = 16


def tiny_block(lifecycle: dict | None = None, seed: int = 0) -> SSMMoEBlock:
    raw = {
        "type": "ssm_moe",
        "mixer": {"type": "ssm", "state_size": 4, "chunk_size": 4},
        "moe": {
            "num_experts": 4,
            "expert": {"type": "gelu", "hidden_size": 8},
            "router": {"type": "topk", "k": 2, "load_balancing_weight": 0.01, "lifecycle": lifecycle},
        },
    }
    cfg = parse_registered(BLOCKS, raw, "model.layers[0]")
    torch.manual_seed(seed)
    return BLOCKS.build(cfg, d_model=D, layer_idx=0).double()


def positions(B: int, T: int) -> torch.Tensor:
    return torch.arange(T).expand(B, T)


def test_default_is_top2_of_8_gelu_experts_with_load_balancing_001():
    cfg = SSMMoEBlockConfig()
    assert cfg.moe.num_experts == 8 and cfg.moe.expert.type == "gelu"
    assert cfg.moe.router.type == "topk" and cfg.moe.router.k == 2
    assert cfg.moe.router.load_balancing_weight == 0.01 and cfg.mixer.type == "ssm"


def test_forward_is_the_two_residual_equations():
    block = tiny_block()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    out = block(x, positions_BT=positions(2, 7))
    h = x + block.mixer(block.mixer_norm(x))
    moe = block.moe(block.moe_norm(h))
    torch.testing.assert_close(out.x, h + moe.y)
    # load balancing on this batch's fractions: 0.01 * E * sum_i f_i P_i
    logits = block.moe.router.logits(block.moe_norm(h).reshape(-1, D))
    probs = torch.softmax(logits, dim=-1)
    expected = 0.01 * load_balancing_loss(probs, probs.topk(2, dim=-1).indices)
    torch.testing.assert_close(out.aux_losses["load_balancing_loss"], expected)
    assert out.stats["tokens_per_expert"].sum() == 2 * 7 * 2


def test_block_is_causal_and_rows_are_independent():
    block = tiny_block({"min_tokens": 10})
    block.moe.router.lifecycle.logit_bias_E[1] = 0.7  # exploration biases are per token too
    x = torch.randn(3, 9, D, dtype=torch.float64)
    y = block(x, positions_BT=positions(3, 9)).x
    x2 = x.clone()
    x2[:2, 6:] = torch.randn(2, 3, D, dtype=torch.float64)
    x2[2] = torch.randn(9, D, dtype=torch.float64)
    y2 = block(x2, positions_BT=positions(3, 9)).x
    torch.testing.assert_close(y2[:2, :6], y[:2, :6])
    assert not torch.allclose(y2[:2, 6:], y[:2, 6:])


def test_gradients_reach_every_part():
    block = tiny_block({"min_tokens": 10})
    block.train()
    out = block(torch.randn(2, 5, D, dtype=torch.float64), positions_BT=positions(2, 5))
    (out.x.square().mean() + out.aux_losses["load_balancing_loss"]).backward()
    missing = [n for n, p in block.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert isinstance(block.moe.router.lifecycle, ExpertLifecycle)


def tiny_lm():
    layer = {
        "type": "ssm_moe",
        "repeat": 2,
        "mixer": {"type": "ssm", "state_size": 4, "chunk_size": 4},
        "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 8}, "router": {"type": "topk"}},
    }
    cfg = config_from_dict({"model": {"vocab_size": 32, "d_model": D, "max_seq_len": 32, "layers": [layer]}})
    torch.manual_seed(0)
    return build_model(cfg.model).double().eval()


def test_decoding_with_the_cache_matches_the_full_forward():
    """Prefill 6 tokens, then 4 one at a time: the SSM state carries over; logits equal one full pass."""
    model = tiny_lm()
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    cache = model.new_cache()
    pieces = [model(ids[:, :6], cache=cache).logits]
    for t in range(6, 10):
        pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def test_moe_stream_recipe():
    cfg = load_config(CONFIGS / "moe_stream.yaml")
    layers = cfg.model.expanded_layers()
    assert len(layers) == 8 and all(layer.type == "ssm_moe" for layer in layers)
    moe = layers[0].moe
    assert (moe.num_experts, moe.expert.type, moe.router.type, moe.router.k) == (8, "gelu", "topk", 2)
    assert moe.router.load_balancing_weight == 0.01
    lifecycle = moe.router.lifecycle
    assert (lifecycle.min_tokens, lifecycle.birth_boost, lifecycle.bias_decay) == (5000, 0.35, 0.99)
    # the counts in the recipe's header, from the shapes: SSM (inner C = 2d, rank R = d/16, N states),
    # two LayerNorms, router, experts; tied embedding and a final LayerNorm
    V, d, C, R, N, E, F = 16384, 512, 1024, 32, 16, 8, 1024
    ssm = d * 2 * C + C * (R + 2 * N) + R * C + 3 * C + C * d
    shared = ssm + 2 * 2 * d + E * d
    report = meta_param_report(cfg.model)
    assert report.params_total == 8 * (shared + E * 2 * d * F) + V * d + 2 * d == 88_941_568
    assert report.params_active == 8 * (shared + 2 * 2 * d * F) + V * d + 2 * d == 38_609_920
