import math

import pytest
import torch

from moep_ds.layers.attention import AttentionConfig, CausalSelfAttention
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_cos_sin, rotary_dims


def naive_attention(q, k, v, q_pos, k_pos, window):
    """fp64 loop-free reference: explicit mask, explicit softmax; k/v repeated for GQA."""
    B, H, T, Dh = q.shape
    G = k.shape[1]
    k = k.repeat_interleave(H // G, dim=1)
    v = v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-1, -2) / Dh**0.5
    mask = torch.zeros(B, 1, T, k.shape[2], dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for s in range(k.shape[2]):
                d = int(q_pos[b, t] - k_pos[b, s])
                mask[b, 0, t, s] = d >= 0 and (window is None or d < window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def run_layer(layer, x, positions, cache=None):
    return layer(x, positions, cache)


def layer_reference(layer, x, positions):
    """The same layer's projections, with attention done by the naive reference."""
    B, T, _ = x.shape
    H, G, Dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = layer.w_qkv(x).split([H * Dh, G * Dh, G * Dh], -1)
    q = q.view(B, T, H, Dh).transpose(1, 2)
    k = k.view(B, T, G, Dh).transpose(1, 2)
    v = v.view(B, T, G, Dh).transpose(1, 2)
    if layer.rot_dim:
        cos, sin = rope_cos_sin(positions, layer.rot_dim, layer.cfg.rope.base, torch.float64)
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    out = naive_attention(q, k, v, positions, positions, layer.cfg.window)
    return layer.w_o(out.transpose(1, 2).reshape(B, T, H * Dh))


@pytest.mark.parametrize(
    "heads,kv_heads,window,rope",
    [(4, None, None, None), (4, 2, None, 1.0), (4, 1, 3, 0.5), (2, None, 1, 1.0), (4, 4, 5, None)],
)
def test_attention_matches_naive_fp64(heads, kv_heads, window, rope):
    torch.manual_seed(0)
    cfg = AttentionConfig(num_heads=heads, num_kv_heads=kv_heads, window=window,
                          rope=RopeConfig(fraction=rope) if rope else None)
    layer = CausalSelfAttention(cfg, d_model=32).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(9).expand(2, 9)
    out = run_layer(layer, x, positions)
    ref = layer_reference(layer, x, positions)
    torch.testing.assert_close(out, ref)
    g_out, = torch.autograd.grad(out.sum(), x)
    g_ref, = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g_out, g_ref)


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_decoding_equals_full_forward(window):
    torch.manual_seed(1)
    cfg = AttentionConfig(num_heads=4, num_kv_heads=2, window=window, rope=RopeConfig())
    layer = CausalSelfAttention(cfg, d_model=32).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    positions = torch.arange(10).expand(2, 10)
    full = layer(x, positions)
    cache = layer.new_cache()
    chunks = [(0, 4), (4, 5), (5, 8), (8, 9), (9, 10)]
    pieces = [layer(x[:, a:b], positions[:, a:b], cache) for a, b in chunks]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


def test_rope_leaves_position_zero_unchanged():
    x = torch.randn(3, 2, 1, 16, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.zeros(1, dtype=torch.long), 16, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


@pytest.mark.parametrize("fraction,base", [(1.0, 10000.0), (0.25, 500.0)])
def test_rope_dot_product_depends_only_on_offset(fraction, base):
    torch.manual_seed(2)
    rot = rotary_dims(16, fraction)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor(pq), rot, base, torch.float64)
        ck, sk = rope_cos_sin(torch.tensor(pk), rot, base, torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(dot(5, 2), dot(103, 100))
    torch.testing.assert_close(dot(0, 7), dot(40, 47))
    assert not torch.allclose(dot(5, 2), dot(5, 3))


@pytest.mark.parametrize("rot,base", [(16, 10000.0), (4, 500.0)])
def test_rope_rotates_pairs_i_and_i_plus_half_by_position_times_base_power(rot, base):
    """GPT-NeoX / Llama rotate_half, written out: (x_i, x_{i+R/2}) turns by theta = pos * base^(-2i/R),
    counter-clockwise (a sign or frequency error would still give offset-only dot products)."""
    torch.manual_seed(3)
    x = torch.randn(3, 16, dtype=torch.float64)
    positions = torch.tensor([0, 1, 37])
    cos, sin = rope_cos_sin(positions, rot, base, torch.float64)
    out = apply_rope(x, cos, sin)
    expected = x.clone()
    for row, pos in enumerate(positions.tolist()):
        for i in range(rot // 2):
            theta = pos * base ** (-2 * i / rot)
            a, b = x[row, i].item(), x[row, i + rot // 2].item()
            expected[row, i] = a * math.cos(theta) - b * math.sin(theta)
            expected[row, i + rot // 2] = a * math.sin(theta) + b * math.cos(theta)
    torch.testing.assert_close(out, expected)


def test_partial_rotary_leaves_tail_dims_untouched():
    x = torch.randn(4, 64, dtype=torch.float64)
    rot = rotary_dims(64, 0.25)
    assert rot == 16
    cos, sin = rope_cos_sin(torch.arange(4), rot, 10000.0, torch.float64)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[:, rot:], x[:, rot:])
    assert not torch.allclose(out[1:, :rot], x[1:, :rot])
