"""Router bias (TopKConfig.bias, gpt-oss): with softmax scores renormalised over the k, our top-k router picks the
experts and weights of transformers' GptOssTopKRouter (a softmax over the k largest biased logits) on the same
weight and bias, in fp32 and with bf16 activations (logits_dtype input: their F.linear in the model's dtype)."""
import pytest
import torch
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from moep_ds.routing.topk import TopKConfig, TopKRouter

D, E, K, T = 16, 8, 3, 40


@pytest.fixture(scope="module")
def routers():
    torch.manual_seed(0)
    hf = GptOssTopKRouter(GptOssConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K))
    with torch.no_grad():
        hf.weight.normal_(std=0.5)
        hf.bias.normal_(std=2.0)  # large enough to change choices
    ours = TopKRouter(TopKConfig(k=K, bias=True, renormalize=True), d_model=D, num_experts=E)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.bias.copy_(hf.bias)
    return ours, hf


def chosen(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] combine weights (0 where not chosen) and the chosen mask."""
    w_TE = torch.zeros(plan.num_tokens, E, dtype=plan.weight_S.dtype)
    w_TE[plan.token_idx_S, plan.expert_idx_S()] = plan.weight_S
    hit_TE = torch.zeros(plan.num_tokens, E, dtype=torch.bool)
    hit_TE[plan.token_idx_S, plan.expert_idx_S()] = True
    return w_TE, hit_TE


def hf_chosen(hf: GptOssTopKRouter, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, scores_TK, idx_TK = hf(x_TD)
    w_TE = torch.zeros(x_TD.shape[0], E).scatter_(1, idx_TK, scores_TK.float())
    return w_TE, torch.zeros(x_TD.shape[0], E, dtype=torch.bool).scatter_(1, idx_TK, True)


def test_router_bias_equals_gpt_oss_router_fp32(routers):
    ours, hf = routers
    x = torch.randn(2, T // 2, D)
    w_ours, hit_ours = chosen(ours(x))
    w_hf, hit_hf = hf_chosen(hf, x.reshape(T, D))
    assert torch.equal(hit_ours, hit_hf)
    torch.testing.assert_close(w_ours, w_hf, rtol=1e-6, atol=1e-6)
    # the bias matters: without it other experts win
    plain_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, (x.reshape(T, D) @ hf.weight.t()).topk(K).indices, True)
    assert not torch.equal(plain_TE, hit_hf)


def test_router_bias_in_the_activations_dtype_equals_gpt_oss_router_bf16(routers):
    ours, hf = routers
    ours_bf16 = TopKRouter(TopKConfig(k=K, bias=True, renormalize=True, logits_dtype="input"), d_model=D,
                           num_experts=E)
    ours_bf16.load_state_dict(ours.state_dict())
    ours_bf16, hf_bf16 = ours_bf16.bfloat16(), GptOssTopKRouter(hf_config_like(hf)).bfloat16()
    hf_bf16.load_state_dict(hf.state_dict())
    x = torch.randn(T, D).bfloat16()
    w_ours, hit_ours = chosen(ours_bf16(x))
    w_hf, hit_hf = hf_chosen(hf_bf16, x)
    assert torch.equal(hit_ours, hit_hf)
    torch.testing.assert_close(w_ours, w_hf, rtol=1e-2, atol=1e-2)  # theirs: a bf16 softmax; ours: fp32


def hf_config_like(hf: GptOssTopKRouter) -> GptOssConfig:
    return GptOssConfig(hidden_size=hf.hidden_dim, num_local_experts=hf.num_experts, num_experts_per_tok=hf.top_k)


def test_router_bias_parameter_gradient_and_sigmoid_scores(routers):
    ours = routers[0]
    assert dict(ours.named_parameters())["bias"].shape == (E,)
    sig = TopKRouter(TopKConfig(k=K, bias=True, score="sigmoid"), d_model=D, num_experts=E)
    sig.load_state_dict(ours.state_dict())
    x = torch.randn(T, D)
    plan = sig(x)
    logits_TE = x @ ours.weight.detach().t() + ours.bias.detach()
    torch.testing.assert_close(plan.weight_S, torch.sigmoid(logits_TE)[plan.token_idx_S, plan.expert_idx_S()])
    plan.weight_S.sum().backward()
    assert sig.bias.grad is not None and sig.bias.grad.abs().sum() > 0
    assert "bias" not in dict(TopKRouter(TopKConfig(k=K), d_model=D, num_experts=E).named_parameters())
