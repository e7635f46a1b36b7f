"""Selective SSM: chunked scan vs a naive per-step loop (fp64), step mode vs parallel mode, causality."""
from __future__ import annotations

import pytest
import torch

from moep_ds.layers.ssm import SSM, SSMCache, SSMConfig, selective_scan_chunked, selective_scan_step
from moep_ds.registry import MIXERS
from moep_ds.schema import ConfigError, parse_registered

# B batch, T sequence length, C channels, N state size


def naive_scan(u, dt, A, B, C, D, h0=None):
    """The sequential recurrence, one time step at a time (out of place, so autograd can follow it)."""
    batch, seq_len, channels = u.shape
    h = torch.zeros(batch, channels, B.shape[-1], dtype=u.dtype) if h0 is None else h0
    ys = []
    for t in range(seq_len):
        a_BC = torch.exp(-dt[:, t] * A)
        h = a_BC[:, :, None] * h + dt[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        ys.append((C[:, t, None, :] * h).sum(-1) + D * u[:, t])
    return torch.stack(ys, dim=1), h


def random_inputs(batch=2, seq_len=11, channels=3, n_state=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(generator=g, dtype=torch.float64)
    u = torch.randn(batch, seq_len, channels, **kw)
    dt = torch.rand(batch, seq_len, channels, **kw) * 0.5 + 0.01
    A = torch.rand(channels, **kw) * 4 + 0.5
    B = torch.randn(batch, seq_len, n_state, **kw)
    C = torch.randn(batch, seq_len, n_state, **kw)
    D = torch.randn(channels, **kw)
    return u, dt, A, B, C, D


@pytest.mark.parametrize("seq_len,chunk", [(11, 4), (7, 3), (5, 8), (9, 1)])
def test_chunked_scan_matches_naive_loop(seq_len, chunk):
    u, dt, A, B, C, D = random_inputs(seq_len=seq_len)
    h0 = torch.randn(2, 3, 2, dtype=torch.float64)
    y, h = selective_scan_chunked(u, dt, A, B, C, D, h0, chunk_size=chunk)
    y_ref, h_ref = naive_scan(u, dt, A, B, C, D, h0)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


def test_scan_gradients_match_naive_loop():
    inputs = [t.requires_grad_() for t in random_inputs(batch=1, seq_len=6, channels=2)]
    y, h = selective_scan_chunked(*inputs, chunk_size=4)
    grads = torch.autograd.grad((y.sin().sum() + h.sum()), inputs)
    y_ref, h_ref = naive_scan(*inputs)
    grads_ref = torch.autograd.grad((y_ref.sin().sum() + h_ref.sum()), inputs)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


def test_step_function_matches_chunked_scan():
    u, dt, A, B, C, D = random_inputs(seq_len=9)
    y_par, h_par = selective_scan_chunked(u, dt, A, B, C, D, chunk_size=4)
    h = None
    for t in range(u.shape[1]):
        y_t, h = selective_scan_step(u[:, t], dt[:, t], A, B[:, t], C[:, t], D, h)
        torch.testing.assert_close(y_t, y_par[:, t])
    torch.testing.assert_close(h, h_par)


def tiny_ssm(chunk_size=4, seed=0):
    torch.manual_seed(seed)
    cfg = SSMConfig(expand=2, state_size=3, chunk_size=chunk_size)
    return SSM(cfg, d_model=8).double()


def test_module_matches_its_equations():
    """SSM(x) written out from the module docstring: u, gate = in_proj(x); [dt_in, B, C] = x_proj(u) in that order;
    dt = softplus(dt_proj(dt_in) + dt_bias); decay rate exp(A_log); out = w_out(scan(u) * silu(gate))."""
    ssm = tiny_ssm()
    with torch.no_grad():
        ssm.dt_bias.uniform_(-1.0, 1.0)  # steps well inside softplus's curved part
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    C, N, R = ssm.D.numel(), ssm.cfg.state_size, ssm.dt_rank
    proj = x @ ssm.in_proj.weight.T
    u, gate = proj[..., :C], proj[..., C:]
    xp = u @ ssm.x_proj.weight.T
    dt_in, B, Cm = xp[..., :R], xp[..., R : R + N], xp[..., R + N :]
    dt = torch.log1p(torch.exp(dt_in @ ssm.dt_proj.weight.T + ssm.dt_bias))
    y, _ = naive_scan(u, dt, torch.exp(ssm.A_log), B, Cm, ssm.D)
    expected = (y * gate * torch.sigmoid(gate)) @ ssm.w_out.weight.T
    torch.testing.assert_close(ssm(x), expected)


def test_module_step_mode_matches_parallel_mode():
    ssm = tiny_ssm()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    y_par = ssm(x)
    state = None
    for t in range(x.shape[1]):
        y_t, state = ssm.step(x[:, t], state)
        torch.testing.assert_close(y_t, y_par[:, t])


def test_cache_continues_a_prefix():
    """Prefill 7 tokens with a cache, then 3 more: same as one pass over all 10 (and step mode after prefill)."""
    ssm = tiny_ssm(chunk_size=3)
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    y_full = ssm(x)
    cache = SSMCache()
    y_a = ssm(x[:, :7], cache=cache)
    y_b = ssm(x[:, 7:], cache=cache)
    torch.testing.assert_close(torch.cat([y_a, y_b], dim=1), y_full)
    y_8, _ = ssm.step(x[:, 7], ssm_state_after(ssm, x[:, :7]))
    torch.testing.assert_close(y_8, y_full[:, 7])


def ssm_state_after(ssm, x):
    cache = SSMCache()
    ssm(x, cache=cache)
    return cache.h_BCN


def test_causal_and_batch_independent():
    ssm = tiny_ssm()
    x = torch.randn(3, 9, 8, dtype=torch.float64)
    y = ssm(x)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(3, 4, 8, dtype=torch.float64)
    x2[2] = torch.randn(9, 8, dtype=torch.float64)
    y2 = ssm(x2)
    torch.testing.assert_close(y2[:2, :5], y[:2, :5])
    assert not torch.allclose(y2[:2, 5:], y[:2, 5:])


def test_initial_decay_and_step_ranges():
    cfg = SSMConfig(dt_min=0.01, dt_max=0.05, a_init_max=4.0)
    ssm = SSM(cfg, d_model=16)
    dt0 = torch.nn.functional.softplus(ssm.dt_bias)
    assert dt0.min() >= 0.01 - 1e-6 and dt0.max() <= 0.05 + 1e-6
    rate = ssm.A_log.exp()
    assert rate.min() >= 1.0 - 1e-6 and rate.max() <= 4.0 + 1e-6
    assert ssm.dt_rank == 1 and ssm.x_proj.out_features == 1 + 2 * cfg.state_size


def test_fp32_long_sequence_is_finite():
    """Strong decays over a long chunk would overflow a cumprod-ratio formulation; the segsum one is exact."""
    u, dt, A, B, C, D = (t.float() for t in random_inputs(batch=1, seq_len=64, channels=4))
    y, h = selective_scan_chunked(u, dt * 20, A * 10, B, C, D, chunk_size=64)
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    y_ref, _ = selective_scan_chunked(*(t.double() for t in (u, dt * 20, A * 10, B, C, D)), chunk_size=1)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


def test_registered_config_and_errors():
    cfg = parse_registered(MIXERS, {"type": "ssm", "state_size": 4}, "model.layers[0].mixer")
    assert isinstance(cfg, SSMConfig) and cfg.state_size == 4
    assert isinstance(MIXERS.build(cfg, 8), SSM)
    with pytest.raises(ConfigError, match=r"model.layers\[0\].mixer.dt_min \(0.5\) must be <= dt_max \(0.1\)"):
        parse_registered(MIXERS, {"type": "ssm", "dt_min": 0.5}, "model.layers[0].mixer")
    with pytest.raises(ConfigError, match=r"mixer.chunk_size \(0\) must be > 0"):
        parse_registered(MIXERS, {"type": "ssm", "chunk_size": 0}, "mixer")


@torch.no_grad()
def test_init_weights_follows_the_model_contract():
    """CausalLM calls init_weights(std, out_scale): projections Normal(0, std), w_out scaled, steps re-drawn."""
    ssm = SSM(SSMConfig(dt_min=0.01, dt_max=0.02), d_model=64)
    ssm.dt_bias.zero_()
    ssm.init_weights(0.02, out_scale=0.25)
    assert abs(float(ssm.in_proj.weight.std()) - 0.02) < 0.002
    assert abs(float(ssm.w_out.weight.std()) - 0.005) < 0.0005
    dt0 = torch.nn.functional.softplus(ssm.dt_bias)
    assert dt0.min() >= 0.01 - 1e-6 and dt0.max() <= 0.02 + 1e-6
