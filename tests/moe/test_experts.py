"""Both expert execution paths (CPU expert loop, accelerator grouped matmuls) equal the per-expert definition."""
import pytest
import torch

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.expert_loop import expert_loop_ffn
from moep_ds.moe.experts import GroupedExperts, choose_kernel, expert_ffn, grouped_expert_ffn
from moep_ds.moe.grouped_mm import library_supports

D, H, E = 6, 10, 4


def experts_of(kind: str, bias: bool) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(FFNConfig(type=kind, hidden_size=H, bias=bias), d_model=D, num_experts=E).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.4)
    return experts


def per_expert(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    w1, w2, w3, b1, b2, b3 = experts.weights()
    pick = lambda t, e: None if t is None else t[e]  # noqa: E731
    return torch.cat([
        expert_ffn(x_e, w1[e], w2[e], pick(w3, e), pick(b1, e), pick(b2, e), pick(b3, e), experts.kind)
        for e, x_e in enumerate(x.split(counts))
    ])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [2, 2, 2, 2]], ids=["uneven_with_idle", "equal"])
@pytest.mark.parametrize("kind, bias", [("swiglu", False), ("geglu", True), ("gelu", True), ("gelu", False),
                                         ("gelu_tanh", True)])
@pytest.mark.parametrize("ffn", [expert_loop_ffn, grouped_expert_ffn], ids=["expert_loop", "grouped"])
def test_expert_paths_match_per_expert_definition(ffn, kind, bias, counts):
    experts = experts_of(kind, bias)
    x = torch.randn(sum(counts), D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(counts), D, dtype=torch.float64)
    params = [x, *experts.parameters()]
    y = ffn(x, counts, *experts.weights(), experts.kind)
    ref = per_expert(experts, x, counts)
    torch.testing.assert_close(y, ref)
    ours = torch.autograd.grad((y * g).sum(), params)
    expected = torch.autograd.grad((ref * g).sum(), params, allow_unused=True)
    for a, b, p in zip(ours, expected, params):
        torch.testing.assert_close(a, torch.zeros_like(p) if b is None else b)
    if counts[1] == 0:
        assert all(grad[1].abs().sum() == 0 for grad in ours[1:])  # an idle expert gets zero gradients


def test_expert_loop_gradcheck():
    experts = experts_of("swiglu", True)
    x = torch.randn(7, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: expert_loop_ffn(a[0], [4, 0, 2, 1], *a[1:], "swiglu"),
                                    (x, *experts.weights()))


def test_frozen_experts_only_input_gradient():
    experts = experts_of("swiglu", False).requires_grad_(False)
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    expert_loop_ffn(x, [1, 1, 1, 2], *experts.weights(), "swiglu").sum().backward()
    assert x.grad is not None and all(p.grad is None for p in experts.parameters())


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0]], ids=["uneven_with_idle", "one_expert"])
@pytest.mark.parametrize("kind, bias", [("swiglu", False), ("gelu", True), ("gelu_tanh", True)])
def test_library_grouped_mm_matches_the_expert_loop(kind, bias, counts):
    """torch's F.grouped_mm path (fp32 on CPU, rows of 16-byte multiples) against the per-expert loop reference,
    gradients included, with a non-contiguous incoming gradient (the library's backward needs a contiguous one)."""
    torch.manual_seed(0)
    experts = GroupedExperts(FFNConfig(type=kind, hidden_size=12, bias=bias), d_model=8, num_experts=E)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.4)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    g_DS = torch.randn(8, sum(counts))
    params = [x, *experts.parameters()]
    results = {}
    for kernel in ("library", "loop"):
        experts.kernel = kernel
        y = experts(x, counts)
        results[kernel] = (y, torch.autograd.grad((y.t() * g_DS).sum(), params))
    experts.kernel = None
    assert choose_kernel(x, experts.w1_EDF, counts) == "library"
    torch.testing.assert_close(results["library"][0], results["loop"][0])
    for a, b in zip(results["library"][1], results["loop"][1]):
        torch.testing.assert_close(a, b)


def test_library_grouped_mm_under_torch_compile_on_cpu():
    """train.compile with uneven loads on CPU: torch's fake grouped_mm admits only bf16, so the fp32 CPU call runs
    outside the graph (aot_eager traces with fake tensors as inductor does); same outputs and gradients as eager."""
    torch.manual_seed(0)
    experts = GroupedExperts(FFNConfig(type="swiglu", hidden_size=12, bias=False), d_model=8, num_experts=E)
    experts.kernel = "library"
    x = torch.randn(9, 8, requires_grad=True)
    results = {}
    for name, run in (("eager", experts), ("compiled", torch.compile(experts, backend="aot_eager"))):
        y = run(x, [3, 0, 5, 1])
        results[name] = (y, torch.autograd.grad(y.square().sum(), [x, *experts.parameters()]))
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=0, atol=0)
    for a, b in zip(results["compiled"][1], results["eager"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kernel_choice():
    w = torch.zeros(E, 8, 12)
    assert choose_kernel(torch.zeros(4, 8), w, [1, 1, 1, 1]) == "loop"  # equal loads on CPU: the expert loop
    assert choose_kernel(torch.zeros(4, 8), w, [2, 0, 1, 1]) == "library"
    assert choose_kernel(torch.zeros(4, 8, dtype=torch.float64), w.double(), [2, 0, 1, 1]) == "loop"
    assert not library_supports(torch.zeros(4, 6), torch.zeros(E, 6, 12))  # 24-byte rows: not 16-byte aligned


def test_expert_loop_writes_every_weight_gradient_element(monkeypatch):
    """The weight-gradient buffers start uninitialised (no zero fill of [E, D, F]); poisoned with NaN here, the
    result must still equal the definition, the idle expert's gradients exactly zero."""
    from moep_ds.moe import expert_loop

    def poisoned(t, needed):
        return torch.full_like(t, float("nan")) if t is not None and needed else None

    monkeypatch.setattr(expert_loop, "_empty_if", poisoned)
    experts = experts_of("swiglu", True)
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), D, dtype=torch.float64, requires_grad=True)
    params = [x, *experts.parameters()]
    ours = torch.autograd.grad(expert_loop_ffn(x, counts, *experts.weights(), "swiglu").sum(), params)
    expected = torch.autograd.grad(per_expert(experts, x, counts).sum(), params, allow_unused=True)
    for a, b, p in zip(ours, expected, params):
        torch.testing.assert_close(a, torch.zeros_like(p) if b is None else b)
    assert all(torch.equal(grad[1], torch.zeros_like(grad[1])) for grad in ours[1:])
