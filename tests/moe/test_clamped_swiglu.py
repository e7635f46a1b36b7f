"""clamped_swiglu (gpt-oss): our dense FFN and every expert kernel against transformers' GptOssExperts on the same
weights (their gate_up_proj [E, D, 2F] interleaves gate ::2 and up 1::2), forward and gradients, with inputs
large enough that both clamps bite; the config's refusals."""
import pytest
import torch
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.layers.glu import ClampedSwiGLU, gated_activation_backward
from moep_ds.moe.experts import GroupedExperts
from moep_ds.registry import FFNS
from moep_ds.schema import ConfigError, parse_registered

D, F, E, N, LIMIT = 16, 8, 4, 24, 1.5
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hf_experts() -> GptOssExperts:
    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, swiglu_limit=LIMIT)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.5)
    return experts


def ours_config() -> FFNConfig:
    return FFNConfig(type="clamped_swiglu", hidden_size=F, bias=True, limit=LIMIT)


def copy_into_experts(ours: GroupedExperts, hf: GptOssExperts) -> None:
    with torch.no_grad():
        ours.w1_EDF.copy_(hf.gate_up_proj[..., ::2])
        ours.w3_EDF.copy_(hf.gate_up_proj[..., 1::2])
        ours.b1_EF.copy_(hf.gate_up_proj_bias[:, ::2])
        ours.b3_EF.copy_(hf.gate_up_proj_bias[:, 1::2])
        ours.w2_EFD.copy_(hf.down_proj)
        ours.b2_ED.copy_(hf.down_proj_bias)


def hf_grads(hf: GptOssExperts) -> dict[str, torch.Tensor]:
    """transformers' gradients under our names."""
    gu, gub = hf.gate_up_proj.grad, hf.gate_up_proj_bias.grad
    return {"w1_EDF": gu[..., ::2], "w3_EDF": gu[..., 1::2], "b1_EF": gub[:, ::2], "b3_EF": gub[:, 1::2],
            "w2_EFD": hf.down_proj.grad, "b2_ED": hf.down_proj_bias.grad}


def run_hf(hf: GptOssExperts, x: torch.Tensor, expert_N: torch.Tensor, g: torch.Tensor):
    hf.zero_grad()
    x = x.clone().requires_grad_()
    y = hf(x, expert_N[:, None], torch.ones(N, 1))
    (y * g).sum().backward()
    return y, x.grad, hf_grads(hf)


def test_inputs_make_both_clamps_bite(hf_experts):
    torch.manual_seed(1)
    gate_up = torch.randn(N, D) @ hf_experts.gate_up_proj[0] + hf_experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2] > LIMIT).any() and (gate_up[:, 1::2] < -LIMIT).any()


@pytest.mark.parametrize("kernel", ["loop", "grouped", "library"])
def test_expert_kernels_equal_gpt_oss_experts(hf_experts, kernel):
    torch.manual_seed(1)
    x, g = torch.randn(N, D), torch.randn(N, D)
    expert_N = torch.randint(0, E - 1, (N,))  # the last expert gets no tokens
    y_hf, dx_hf, grads_hf = run_hf(hf_experts, x, expert_N, g)
    ours = GroupedExperts(ours_config(), d_model=D, num_experts=E)
    copy_into_experts(ours, hf_experts)
    ours.kernel = kernel
    order = torch.argsort(expert_N, stable=True)
    counts = torch.bincount(expert_N, minlength=E).tolist()
    x_sorted = x[order].clone().requires_grad_()
    y_sorted = ours(x_sorted, counts)
    (y_sorted * g[order]).sum().backward()
    torch.testing.assert_close(y_sorted, y_hf[order], **TOL)
    torch.testing.assert_close(x_sorted.grad, dx_hf[order], **TOL)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_hf[name], **TOL, msg=name)


def test_dense_ffn_equals_one_gpt_oss_expert(hf_experts):
    torch.manual_seed(2)
    x, g = torch.randn(N, D), torch.randn(N, D)
    y_hf, dx_hf, grads_hf = run_hf(hf_experts, x, torch.zeros(N, dtype=torch.long), g)
    ffn = build_ffn(ours_config(), D)
    with torch.no_grad():
        ffn.w1.weight.copy_(hf_experts.gate_up_proj[0, :, ::2].t())
        ffn.w3.weight.copy_(hf_experts.gate_up_proj[0, :, 1::2].t())
        ffn.w1.bias.copy_(hf_experts.gate_up_proj_bias[0, ::2])
        ffn.w3.bias.copy_(hf_experts.gate_up_proj_bias[0, 1::2])
        ffn.w2.weight.copy_(hf_experts.down_proj[0].t())
        ffn.w2.bias.copy_(hf_experts.down_proj_bias[0])
    x = x.clone().requires_grad_()
    y = ffn(x)
    (y * g).sum().backward()
    torch.testing.assert_close(y, y_hf, **TOL)
    torch.testing.assert_close(x.grad, dx_hf, **TOL)
    torch.testing.assert_close(ffn.w1.weight.grad, grads_hf["w1_EDF"][0].t(), **TOL)
    torch.testing.assert_close(ffn.w3.bias.grad, grads_hf["b3_EF"][0], **TOL)
    torch.testing.assert_close(ffn.w2.weight.grad, grads_hf["w2_EFD"][0].t(), **TOL)


def test_hand_written_backward_equals_autograd_at_and_beyond_the_bounds():
    kind = ClampedSwiGLU(limit=LIMIT, alpha=1.3)
    edge = torch.tensor([-2.0, -LIMIT, -0.3, 0.0, 0.7, LIMIT, 2.0])
    gate, up = edge[:, None].expand(7, 7).clone(), edge[None, :].expand(7, 7).clone()
    grad = torch.randn(7, 7)
    gate_a, up_a = gate.clone().requires_grad_(), up.clone().requires_grad_()
    torch.autograd.backward(kind(gate_a, up_a), grad)
    d_gate, d_up = gated_activation_backward(kind, grad, gate, up)
    torch.testing.assert_close(d_gate, gate_a.grad)
    torch.testing.assert_close(d_up, up_a.grad)
    assert (d_gate[gate > LIMIT] == 0).all() and (d_up[up.abs() > LIMIT] == 0).all()


def test_alpha_defaults_to_gpt_oss_value():
    assert build_ffn(ours_config(), D).kind == ClampedSwiGLU(limit=LIMIT, alpha=1.702)
    experts = GroupedExperts(FFNConfig(type="clamped_swiglu", hidden_size=F, limit=7.0, alpha=2.0), d_model=D,
                             num_experts=E)
    assert experts.kind == ClampedSwiGLU(limit=7.0, alpha=2.0)


def test_config_errors():
    path = "model.layers[0].moe.expert"
    with pytest.raises(ConfigError, match=r"^model\.layers\[0\]\.moe\.expert\.limit \(None\) is required for type "
                                          r"clamped_swiglu$"):
        parse_registered(FFNS, {"type": "clamped_swiglu"}, path)
    with pytest.raises(ConfigError, match=r"^ffn\.limit \(7\.0\) applies to type clamped_swiglu only, not swiglu$"):
        parse_registered(FFNS, {"type": "swiglu", "limit": 7.0}, "ffn")
    with pytest.raises(ConfigError, match=r"^ffn\.alpha \(1\.0\) applies to type clamped_swiglu only, not gelu$"):
        parse_registered(FFNS, {"type": "gelu", "alpha": 1.0}, "ffn")
    with pytest.raises(ConfigError, match=r"^ffn\.limit \(None\) is required for type clamped_swiglu$"):
        build_ffn(FFNConfig(type="clamped_swiglu"), D)  # built in code, not parsed
