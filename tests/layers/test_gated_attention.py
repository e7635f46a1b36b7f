"""Qwen3-Next's full attention as our causal attention: an output gate (per head [query | gate] rows of w_qkv),
zero-centred (1 + w) QK-norm per head, partial rotary, GQA; held to transformers' Qwen3NextAttention on the same
weights, forward and gradients, and its KV-cache decoding to the full forward.

# B batch, T tokens, D model dim, H heads, G key/value heads, Dh head dim
"""
from __future__ import annotations

import pytest
import torch

from moep_ds.layers.attention import AttentionConfig, CausalSelfAttention, QKNormConfig
from moep_ds.layers.rope import RopeConfig

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

B, T, D, H, G, Dh, EPS = 2, 7, 32, 4, 2, 12, 1e-6


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, CausalSelfAttention, torch.nn.Module]:
    """transformers' attention (every weight perturbed, norms off zero), ours with its weights, and its rotary."""
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}  # 6 of 12 dims rotated
    config = transformers.Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=Dh,
                                          rms_norm_eps=EPS, rope_parameters=rope)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = hf.Qwen3NextAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    cfg = AttentionConfig(num_heads=H, num_kv_heads=G, head_dim=Dh, rope=RopeConfig(base=500.0, fraction=0.5),
                          qk_norm=QKNormConfig(type="gemma_rmsnorm", eps=EPS), output_gate=True)
    ours = CausalSelfAttention(cfg, D)
    with torch.no_grad():  # q_proj's rows as stored: our query rows (module docstring of layers/attention.py)
        ours.w_qkv.weight.copy_(torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))
        ours.w_o.weight.copy_(theirs.o_proj.weight)
        ours.q_norm.weight.copy_(theirs.q_norm.weight)
        ours.k_norm.weight.copy_(theirs.k_norm.weight)
    return theirs, ours, hf.Qwen3NextRotaryEmbedding(config)


def theirs_forward(theirs, rotary, x_BTD: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(T)[None].expand(B, T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return theirs(x_BTD, rotary(x_BTD, positions), mask)[0]


def test_gated_attention_equals_qwen3_next_attention(pair):
    """Forward, and the gradients of the input and of every weight (w_qkv's rows: q_proj's, k_proj's, v_proj's)."""
    theirs, ours, rotary = pair
    x_BTD = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    x1, x2 = x_BTD.clone().requires_grad_(), x_BTD.clone().requires_grad_()
    expected, got = theirs_forward(theirs, rotary, x1), ours(x2, torch.arange(T)[None].expand(B, T))
    torch.testing.assert_close(got, expected)
    g = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))
    expected.backward(g)
    got.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(ours.w_qkv.weight.grad, torch.cat([theirs.q_proj.weight.grad, theirs.k_proj.weight.grad,
                                                                  theirs.v_proj.weight.grad]))
    for a, b in (("w_o", "o_proj"), ("q_norm", "q_norm"), ("k_norm", "k_norm")):
        torch.testing.assert_close(getattr(ours, a).weight.grad, getattr(theirs, b).weight.grad)


def test_gated_attention_kv_cache_decoding_equals_full_forward(pair):
    _, ours, _ = pair
    x_BTD = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        full = ours(x_BTD, positions)
        cache = ours.new_cache()
        pieces = [ours(x_BTD[:, a:b], positions[:, a:b], cache) for a, b in ((0, 3), (3, 4), (4, 6), (6, 7))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def test_zero_centred_qk_norm_starts_as_plain_rmsnorm():
    """A new layer's gemma_rmsnorm QK-norm scales by 1 + 0 (zero init), as a new rmsnorm one scales by 1."""
    torch.manual_seed(4)
    cfg = AttentionConfig(num_heads=H, num_kv_heads=G, head_dim=Dh, rope=RopeConfig(fraction=0.5),
                          qk_norm=QKNormConfig(type="gemma_rmsnorm"), output_gate=True)
    gemma = CausalSelfAttention(cfg, D)
    plain = CausalSelfAttention(AttentionConfig(**{**vars(cfg), "qk_norm": QKNormConfig()}), D)
    plain.load_state_dict({k: v for k, v in gemma.state_dict().items() if not k.endswith("_norm.weight")},
                          strict=False)
    assert float(gemma.q_norm.weight.detach().abs().sum()) == 0
    assert gemma.w_qkv.weight.shape == ((2 * H + 2 * G) * Dh, D)
    x_BTD = torch.randn(B, T, D)
    positions = torch.arange(T)[None].expand(B, T)
    torch.testing.assert_close(gemma(x_BTD, positions), plain(x_BTD, positions))
