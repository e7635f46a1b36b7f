"""Routed-subset attention against a dense-masked fp64 reference (T x T scores per sequence).

# B batch, T tokens, H heads, Dh head dim, D model dim, N routed tokens
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moep_ds.layers import routed_attention as ra
from moep_ds.layers.attention import AttentionConfig
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_cos_sin



@pytest.fixture(autouse=True)
def fp64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def dense_masked_reference(q_BTHd, k_BTHd, v_BTHd, sel_BT, pos_BT, window):
    """T x T attention per sequence; mask = both selected, causal and windowed by original position."""
    delta = pos_BT[:, :, None] - pos_BT[:, None, :]
    mask = sel_BT[:, :, None] & sel_BT[:, None, :] & (delta >= 0)
    if window is not None:
        mask &= delta < window
    scores = torch.einsum("bthd,bshd->bhts", q_BTHd, k_BTHd) / q_BTHd.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))  # unselected query rows are all -inf; they are not compared
    return torch.einsum("bhts,bshd->bthd", probs, v_BTHd)


def random_case(B, T, density, seed):
    """Selection and strictly increasing positions with gaps and per-sequence offsets."""
    g = torch.Generator().manual_seed(seed)
    sel_BT = torch.rand(B, T, generator=g) < density
    sel_BT[0, 0] = True
    steps = torch.randint(1, 3, (B, T), generator=g)
    pos_BT = torch.cumsum(steps, 1) + torch.randint(0, 50, (B, 1), generator=g)
    return sel_BT, pos_BT


def compact(sel_BT, pos_BT):
    """Row-major order of the selected tokens = sorted by (sequence, position)."""
    b_N, t_N = sel_BT.nonzero(as_tuple=True)
    return b_N, t_N, pos_BT[b_N, t_N]


CASES = [  # B, T, window, density, chunk (None = default)
    (1, 9, 1, 1.0, None),  # every token's window holds only itself
    (3, 17, 4, 0.5, 3),  # chunk smaller than the window
    (2, 33, 8, 0.3, 5),
    (4, 40, 6, 0.9, 8),
    (2, 30, 2, 0.9, 3),  # w - 1 = 1 earlier key: one aligned block of history, not none
    (2, 40, 10, 0.9, 4),  # w - 1 = 9 earlier keys: two aligned blocks of history, not one
    (2, 24, 64, 0.6, None),  # window larger than the sequence
    (3, 20, None, 0.5, None),  # unbounded (MoEP paths)
    (5, 12, None, 0.2, None),  # some sequences have no routed token
]


@pytest.mark.parametrize("B,T,window,density,chunk", CASES)
def test_matches_dense_masked_reference_with_gradients(B, T, window, density, chunk):
    H, Dh = 2, 4
    sel_BT, pos_BT = random_case(B, T, density, seed=B * 100 + T)
    q, k, v = (torch.randn(B, T, H, Dh, requires_grad=True) for _ in range(3))
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    args = (q[b_N, t_N], k[b_N, t_N], v[b_N, t_N], b_N, pos_N)
    if window is None:
        out_NHd = ra.routed_attention(*args, None)
    else:
        out_NHd = ra.routed_window_attention(*args, window, chunk=chunk)
    ref_NHd = dense_masked_reference(q, k, v, sel_BT, pos_BT, window)[b_N, t_N]
    torch.testing.assert_close(out_NHd, ref_NHd)

    grad_out = torch.randn_like(out_NHd)
    grads = torch.autograd.grad(out_NHd, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref_NHd, (q, k, v), grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_token_alone_in_its_window_returns_its_value():
    # Positions 0, 10, 11 of one sequence with window 4: the token at 0 and (for window 1) all see only themselves.
    pos_N = torch.tensor([0, 10, 11, 3, 4])
    seq_N = torch.tensor([0, 0, 0, 1, 1])
    q, k, v = (torch.randn(5, 2, 4) for _ in range(3))
    out = ra.routed_window_attention(q, k, v, seq_N, pos_N, 4, chunk=2)
    torch.testing.assert_close(out[0], v[0])
    # Token 3 of sequence 1 is adjacent (in the list) to sequence 0's last token but must not see it.
    torch.testing.assert_close(out[3], v[3])
    assert not torch.allclose(out[2], v[2])  # position 11 sees position 10
    alone = ra.routed_window_attention(q, k, v, seq_N, pos_N, 1)
    torch.testing.assert_close(alone, v)


def test_sequences_never_see_each_other():
    sel_BT, pos_BT = random_case(3, 16, 0.6, seed=7)
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    q, k, v = (torch.randn(len(b_N), 2, 4) for _ in range(3))
    for window in (5, None):
        base = ra.routed_attention(q, k, v, b_N, pos_N, window)
        other = b_N == 1
        k2, v2 = k.clone(), v.clone()
        k2[other] += 3.0
        v2[other] -= 2.0
        moved = ra.routed_attention(q, k2, v2, b_N, pos_N, window)
        torch.testing.assert_close(moved[~other], base[~other])
        assert not torch.allclose(moved[other], base[other])


def test_window_cost_is_tokens_times_window(monkeypatch):
    """Each query chunk of C rows scores about C + w - 1 keys: O(N (w + C)), never O(N^2) or O(T^2)."""
    shapes = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(ra.F, "scaled_dot_product_attention", spy)
    N, window = 1000, 16
    q = k = v = torch.randn(N, 2, 4)
    ra.routed_window_attention(q, k, v, torch.zeros(N, dtype=torch.long), torch.arange(N), window)
    (q_shape, k_shape), = shapes
    C = max(window, ra.MIN_CHUNK)
    assert q_shape == (-(-N // C), 2, C, 4)
    assert k_shape[0] == -(-N // C) and k_shape[1:] == (2, k_shape[2], 4)
    assert C + window - 1 <= k_shape[2] < C + window - 1 + ra.KEY_ALIGN


def test_empty_selection():
    q = torch.randn(0, 2, 4)
    idx = torch.zeros(0, dtype=torch.long)
    assert ra.routed_attention(q, q, q, idx, idx, 4).shape == (0, 2, 4)
    assert ra.routed_attention(q, q, q, idx, idx, None).shape == (0, 2, 4)


@pytest.mark.parametrize("window,num_heads,num_kv_heads,base,D", [(3, 2, None, 10000.0, 16), (None, 2, 1, 10000.0, 16),
                                                                  (4, 4, 2, 500.0, 32)])
def test_module_applies_rope_at_original_positions(window, num_heads, num_kv_heads, base, D):
    """The projections, RoPE (the configured base, original positions) and GQA (query head h uses key/value head
    h // (H / G)) of the routed module against the dense masked reference."""
    cfg = AttentionConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, window=window,
                          rope=RopeConfig(fraction=0.5, base=base))
    attn = ra.RoutedSelfAttention(cfg, d_model=D)
    B, T = 3, 14
    sel_BT, pos_BT = random_case(B, T, 0.5, seed=3)
    x_BTD = torch.randn(B, T, D)
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    out_ND = attn(x_BTD[b_N, t_N], b_N, pos_N)

    H, G = num_heads, num_kv_heads or num_heads
    Dh = D // H
    q, k, v = attn.w_qkv(x_BTD).split([H * Dh, G * Dh, G * Dh], -1)
    cos, sin = rope_cos_sin(pos_BT, attn.rot_dim, base)
    q = apply_rope(q.view(B, T, H, Dh), cos[:, :, None], sin[:, :, None])
    k = apply_rope(k.view(B, T, G, Dh), cos[:, :, None], sin[:, :, None]).repeat_interleave(H // G, 2)
    v = v.view(B, T, G, Dh).repeat_interleave(H // G, 2)
    ref = attn.w_o(dense_masked_reference(q, k, v, sel_BT, pos_BT, window).reshape(B, T, H * Dh))
    torch.testing.assert_close(out_ND, ref[b_N, t_N])


@pytest.mark.parametrize("window,num_kv_heads", [(3, None), (None, 1)])
def test_cached_decoding_matches_routed_forward(window, num_kv_heads):
    """Prefill then one token at a time through the RoutedKVCache (window-trimmed) = the compacted forward."""
    cfg = AttentionConfig(num_heads=2, num_kv_heads=num_kv_heads, window=window, rope=RopeConfig())
    attn = ra.RoutedSelfAttention(cfg, d_model=16)
    B, T = 3, 12
    sel_BT, pos_BT = random_case(B, T, 0.5, seed=11)
    x_BTD = torch.randn(B, T, 16)
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    want_ND = attn(x_BTD[b_N, t_N], b_N, pos_N)

    cache = attn.new_cache()
    steps = [slice(0, 5)] + [slice(t, t + 1) for t in range(5, T)]
    out_BTD = torch.cat([attn.forward_cached(x_BTD[:, s], sel_BT[:, s], pos_BT[:, s], cache) for s in steps], 1)
    torch.testing.assert_close(out_BTD[b_N, t_N], want_ND)
    assert torch.isfinite(out_BTD).all()
    if window is not None:
        assert cache.k_BSGd.shape[1] == window


@pytest.mark.slow
def test_flex_attention_forward_on_cpu_matches_the_sdpa_path():
    """The CUDA path's block mask and compiled FlexAttention call, run forward on the CPU (FlexAttention has a CPU
    forward, no CPU backward): same sequence, causal and window by original position, as the SDPA path."""
    H, Dh = 2, 16
    for B, T, window, density in [(3, 40, 8, 0.5), (2, 70, None, 0.6)]:
        sel_BT, pos_BT = random_case(B, T, density, seed=B * 10 + T)
        q, k, v = (torch.randn(B, T, H, Dh) for _ in range(3))
        b_N, t_N, pos_N = compact(sel_BT, pos_BT)
        args = (q[b_N, t_N], k[b_N, t_N], v[b_N, t_N], b_N, pos_N, window)
        want = ra.routed_attention(*args, kernel="sdpa")
        float_args = (x.float() for x in args[:3])  # FlexAttention's CPU kernel takes fp32/fp16/bf16
        got = ra.routed_attention(*float_args, *args[3:], kernel="flex")
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(want, dense_masked_reference(q, k, v, sel_BT, pos_BT, window)[b_N, t_N])


@pytest.mark.slow
def test_flex_attention_traces_into_an_enclosing_compiled_graph():
    """Inside a compiled block (`train.compile` on CUDA) the block mask and the FlexAttention call join the
    block's graph: no graph break (create_block_mask's deprecated `_compile=True` warned, which split it), and the
    traced path (run by dynamo's eager backend: FlexAttention's CPU forward) equals the SDPA path."""
    H, Dh, window = 2, 16, 8
    sel_BT, pos_BT = random_case(3, 40, 0.5, seed=7)
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    q, k, v = (torch.randn(b_N.numel(), H, Dh) for _ in range(3))

    def attend(q, k, v, seq, pos):
        return ra.routed_attention(q, k, v, seq, pos, window, kernel="flex")

    torch._dynamo.reset()
    explained = torch._dynamo.explain(attend)(q, k, v, b_N, pos_N)
    assert explained.graph_count == 1, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    got = torch.compile(attend, backend="eager", fullgraph=True)(q, k, v, b_N, pos_N)
    want = ra.routed_attention(q.double(), k.double(), v.double(), b_N, pos_N, window, kernel="sdpa")
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention path is CUDA-only (no CPU backward)")
@pytest.mark.parametrize("B,T,window,density,chunk", CASES + [(4, 300, 16, 0.4, None), (2, 400, None, 0.5, None)])
def test_flex_attention_on_cuda_matches_the_cpu_reference(B, T, window, density, chunk):
    """The CUDA kernel (block mask, fused forward and backward) against the CPU SDPA path and the dense reference."""
    H, Dh = 2, 16
    sel_BT, pos_BT = random_case(B, T, density, seed=B * 100 + T)
    q, k, v = (torch.randn(B, T, H, Dh, requires_grad=True) for _ in range(3))
    b_N, t_N, pos_N = compact(sel_BT, pos_BT)
    grad_out = torch.randn(b_N.numel(), H, Dh)
    ref_NHd = ra.routed_attention(q[b_N, t_N], k[b_N, t_N], v[b_N, t_N], b_N, pos_N, window, kernel="sdpa")
    ref_grads = torch.autograd.grad(ref_NHd, (q, k, v), grad_out)
    torch.testing.assert_close(ref_NHd, dense_masked_reference(q, k, v, sel_BT, pos_BT, window)[b_N, t_N])

    cuda = [x.detach().float().cuda().requires_grad_() for x in (q, k, v)]
    q_c, k_c, v_c = (x[b_N.cuda(), t_N.cuda()] for x in cuda)
    out = ra.routed_attention(q_c, k_c, v_c, b_N.cuda(), pos_N.cuda(), window)  # kernel None: flex on CUDA
    grads = torch.autograd.grad(out, cuda, grad_out.float().cuda())
    torch.testing.assert_close(out.double().cpu(), ref_NHd, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=1e-4)
