"""The fused gated activation (layers/glu.py) against autograd's unfused definition, and where it is used."""
import logging

import pytest
import torch

from moep_ds.layers import glu
from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.moe.experts import GroupedExperts

KINDS = ["swiglu", "geglu"]


@pytest.fixture
def fused_everywhere(monkeypatch):
    monkeypatch.setattr(glu, "FUSED_MIN_NUMEL", 0)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the uses of the compiled kernels (forward and backward alike) by the test, not by the one-off probe of
    whether they compile (`fused_available`), which runs first here whatever ran before."""
    glu.fused_available(torch.device("cpu"))
    calls = []
    for name in ("kernels", "in_place_backward"):  # the latter for callers that consume their operands
        real = getattr(glu, name)

        def counted(kind, real=real):
            calls.append(kind)
            return real(kind)

        monkeypatch.setattr(glu, name, counted)
    return calls


def operands(dtype, shape=(37, 24), seed=0):
    torch.manual_seed(seed)
    gate = (3 * torch.randn(shape)).to(dtype).requires_grad_()
    up = torch.randn(shape).to(dtype).requires_grad_()
    return gate, up, torch.randn(shape).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_forward_is_bit_identical_and_gradients_match_float64(kind, fused_everywhere):
    gate, up, grad = operands(torch.float32)
    out = glu.gated_activation(kind, gate, up)
    assert type(out.grad_fn).__name__ == "FusedGatedActivationBackward"
    assert torch.equal(out, glu.unfused(kind, gate, up))
    for dtype in (torch.bfloat16, torch.float16):  # rounded where eager rounds
        low = [t.detach().to(dtype) for t in (gate, up)]
        assert torch.equal(glu.gated_activation(kind, *low), glu.unfused(kind, *low))
    fused = torch.autograd.grad(out, (gate, up), grad)
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    exact = torch.autograd.grad(glu.unfused(kind, gate64, up64), (gate64, up64), grad.double())
    unfused = torch.autograd.grad(glu.unfused(kind, gate, up), (gate, up), grad)
    for f, u, e in zip(fused, unfused, exact):
        torch.testing.assert_close(f.double(), e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f, u)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fused_other_dtypes(kind, dtype, fused_everywhere):
    gate, up, grad = operands(dtype)
    out = glu.gated_activation(kind, gate, up)
    assert out.dtype == dtype and type(out.grad_fn).__name__ == "FusedGatedActivationBackward"
    assert torch.equal(out, glu.unfused(kind, gate, up))
    for f, u in zip(torch.autograd.grad(out, (gate, up), grad),
                    torch.autograd.grad(glu.unfused(kind, gate, up), (gate, up), grad)):
        torch.testing.assert_close(f, u)


def test_non_contiguous_operands_and_an_expanded_gradient(fused_everywhere):
    """gate and up as the halves of one [N, 2F] projection; `.sum().backward()` sends an expanded gradient."""
    torch.manual_seed(0)
    h = torch.randn(20, 32, requires_grad=True)
    gate, up = h.chunk(2, dim=-1)
    glu.gated_activation("swiglu", gate, up).sum().backward()
    fused = h.grad.clone()
    h.grad = None
    glu.unfused("swiglu", *h.chunk(2, dim=-1)).sum().backward()
    torch.testing.assert_close(fused, h.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_hand_written_backward_matches_autograd(kind, fused_everywhere, kernel_calls):
    gate, up, grad = operands(torch.float32)
    expected = torch.autograd.grad(glu.unfused(kind, gate, up), (gate, up), grad)
    with torch.no_grad():
        got = glu.gated_activation_backward(kind, grad, gate, up)
    assert kernel_calls == [kind]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_small_buffers_stay_unfused(kernel_calls):
    gate, up, _ = operands(torch.float32)
    assert gate.numel() < glu.FUSED_MIN_NUMEL
    out = glu.gated_activation("swiglu", gate, up)
    assert type(out.grad_fn).__name__ == "MulBackward0" and kernel_calls == []


def test_first_use_draws_no_random_numbers(monkeypatch, fused_everywhere):
    """The compile probe must not move the generators (exact resume replays them)."""
    monkeypatch.setattr(glu, "_available", {})
    gate, up, _ = operands(torch.float32)
    state = torch.get_rng_state()
    glu.gated_activation("swiglu", gate, up)
    assert glu._available == {"cpu": True}
    assert torch.equal(torch.get_rng_state(), state)


def test_failed_compilation_falls_back_with_one_warning(monkeypatch, fused_everywhere, caplog):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler found\nsecond line")
        return run

    monkeypatch.setattr(glu, "_available", {})
    monkeypatch.setattr(glu, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    gate, up, grad = operands(torch.float32)
    with caplog.at_level(logging.WARNING, logger="moep_ds.layers.glu"):
        for _ in range(2):
            out = glu.gated_activation("geglu", gate, up)
            assert type(out.grad_fn).__name__ == "MulBackward0"
    assert [r.getMessage() for r in caplog.records] == [
        "fused gated activation unavailable on cpu (RuntimeError: no C++ compiler found); using the unfused kernels"]
    torch.testing.assert_close(out, glu.unfused("geglu", gate, up))


def run_and_grads(module, x, grad):
    y = module(x) if not isinstance(module, GroupedExperts) else module(x, [5, 0, 9, 2])
    return [y.detach(), *torch.autograd.grad(y, [x, *module.parameters()], grad)]


@pytest.mark.parametrize("where", ["dense swiglu", "dense geglu", "experts library", "experts grouped",
                                   "experts loop"])
def test_ffns_and_experts_use_it_with_unchanged_results(where, monkeypatch, kernel_calls):
    """Dense gated FFNs and every expert kernel take the fused path above the threshold; results as unfused."""
    torch.manual_seed(0)
    if where.startswith("dense"):
        module = build_ffn(FFNConfig(type=where.split()[1], hidden_size=24), 16)
        x = torch.randn(2, 8, 16, requires_grad=True)
    else:
        module = GroupedExperts(FFNConfig(type="swiglu", hidden_size=24), d_model=16, num_experts=4)
        module.kernel = where.split()[1]
        x = torch.randn(16, 16, requires_grad=True)
    grad = torch.randn(x.shape)
    monkeypatch.setattr(glu, "FUSED_MIN_NUMEL", 1 << 62)
    unfused = run_and_grads(module, x, grad)
    assert kernel_calls == []
    monkeypatch.setattr(glu, "FUSED_MIN_NUMEL", 0)
    fused = run_and_grads(module, x, grad)
    assert len(kernel_calls) >= 2  # forward and backward
    for f, u in zip(fused, unfused):
        torch.testing.assert_close(f, u)


def test_inside_a_compiled_region_the_expression_is_left_to_the_compiler(fused_everywhere, kernel_calls):
    """Under train.compile the block's own compilation fuses act(gate) * up; no compiled kernel inside a graph."""
    gate, up, _ = operands(torch.float32)
    compiled = torch.compile(lambda g, u: glu.gated_activation("swiglu", g, u) * 2.0)
    out = compiled(gate, up)
    assert kernel_calls == []
    torch.testing.assert_close(out, 2.0 * glu.unfused("swiglu", gate, up))


@pytest.mark.parametrize("kind", KINDS)
def test_consumed_operands_take_the_gradients_in_place(kind, fused_everywhere):
    """consume=True: the same gradients, bit for bit, written over the caller's gate and up (no new buffers);
    a second backward through the graph fails loudly instead of reading the overwritten values."""
    torch.manual_seed(0)
    x, w_gate, w_up = torch.randn(37, 16, requires_grad=True), torch.randn(16, 24), torch.randn(16, 24)
    grad = torch.randn(37, 24)
    expected = torch.autograd.grad(glu.gated_activation(kind, x @ w_gate, x @ w_up), x, grad)[0]
    gate, up = x @ w_gate, x @ w_up
    out = glu.gated_activation(kind, gate, up, consume=True)
    gate_before, up_before = gate.detach().clone(), up.detach().clone()
    d_gate, d_up = torch.autograd.grad(out, (gate, up), grad, retain_graph=True)
    assert d_gate.data_ptr() == gate.data_ptr() and d_up.data_ptr() == up.data_ptr()
    assert not torch.equal(gate.detach(), gate_before) and not torch.equal(up.detach(), up_before)
    ref_gate, ref_up = glu.gated_activation_backward(kind, grad, gate_before, up_before, fused=True)
    assert torch.equal(d_gate, ref_gate) and torch.equal(d_up, ref_up)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (gate, up), grad)
    gate, up = x @ w_gate, x @ w_up
    assert torch.equal(torch.autograd.grad(glu.gated_activation(kind, gate, up, consume=True), x, grad)[0], expected)
