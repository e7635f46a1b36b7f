"""Our MoE layer against the published implementations it names, float32, same weights copied in: transformers'
DeepseekV3MoE (sigmoid scores, e_score_correction_bias as our loss-free balancing bias, n_group / topk_group,
norm_topk_prob, routed_scaling_factor, shared experts), DeepseekV2Moe (softmax, greedy and group-limited greedy) and Qwen2MoeSparseMoeBlock (softmax top-k with and without
norm_topk_prob, sigmoid-gated shared expert): outputs and router choices; DeepSpeed's MoE(use_residual=True)
against shared_expert.gate residual_mix on the same weights and routing."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.shared import SharedExpertConfig
from moep_ds.routing.topk import TopKConfig

D, F_EXPERT = 16, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def our_layer(router: TopKConfig, num_experts: int, shared: SharedExpertConfig | None, hidden=F_EXPERT) -> MoELayer:
    cfg = MoEConfig(num_experts=num_experts, expert=FFNConfig(type="swiglu", hidden_size=hidden), router=router,
                    shared_expert=shared)
    return MoELayer(cfg, d_model=D).float()


@torch.no_grad()
def copy_hf_experts(ours: MoELayer, experts) -> None:
    """transformers' stacked experts: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]."""
    F = experts.down_proj.shape[-1]
    ours.experts.w1_EDF.copy_(experts.gate_up_proj[:, :F, :].transpose(1, 2))
    ours.experts.w3_EDF.copy_(experts.gate_up_proj[:, F:, :].transpose(1, 2))
    ours.experts.w2_EFD.copy_(experts.down_proj.transpose(1, 2))


@torch.no_grad()
def copy_mlp(ffn, mlp) -> None:
    """A gate/up/down SwiGLU MLP into our SwiGLU (w1 gate, w3 up, w2 down)."""
    ffn.w1.weight.copy_(mlp.gate_proj.weight)
    ffn.w3.weight.copy_(mlp.up_proj.weight)
    ffn.w2.weight.copy_(mlp.down_proj.weight)


def our_copy(hf, router: TopKConfig, num_experts: int, shared: SharedExpertConfig, shared_mlp) -> MoELayer:
    """Our layer (eval mode) with the published block `hf`'s router weight, routed experts and shared expert MLP."""
    ours = our_layer(router, num_experts, shared).eval()
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
    copy_hf_experts(ours, hf.experts)
    copy_mlp(ours.shared.ffn, shared_mlp)
    return ours


@torch.no_grad()
def perturb(module: torch.nn.Module, std: float = 0.3) -> None:
    for p in module.parameters():
        p.normal_(std=std)


def our_choices(layer: MoELayer, x_BTD: torch.Tensor) -> torch.Tensor:
    plan = layer.router(x_BTD)
    T = plan.num_tokens
    chosen_TE = torch.zeros(T, layer.num_experts, dtype=torch.bool)
    chosen_TE[plan.token_idx_S, plan.expert_idx_S()] = True
    return chosen_TE


def as_mask(indices_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(indices_TK.shape[0], num_experts, dtype=torch.bool).scatter_(1, indices_TK, True)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_moe(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    E, K, G, M, shared = 16, 3, 4, 2, 2
    hf_cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                              n_group=G, topk_group=M, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
                              n_shared_experts=shared, hidden_act="silu")
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_cfg).float().eval()
    perturb(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.2)  # large enough to change choices
    router = TopKConfig(k=K, score="sigmoid", renormalize=norm_topk_prob, scaling_factor=2.5, bias_update_rate=0.001,
                        num_groups=G, group_topk=M, load_balancing_weight=0.0)
    ours = our_copy(hf, router, E, SharedExpertConfig(hidden_size=F_EXPERT * shared, gate="none"), hf.shared_experts)
    with torch.no_grad():
        ours.router.balancer.bias_E.copy_(hf.gate.e_score_correction_bias)
    x = torch.randn(3, 10, D)
    _, hf_weights, hf_idx = hf.gate(x)
    chosen = our_choices(ours, x)
    assert torch.equal(chosen, as_mask(hf_idx, E))
    unbiased = as_mask(torch.sigmoid(x.reshape(-1, D) @ hf.gate.weight.t()).topk(K, dim=-1).indices, E)
    assert not torch.equal(chosen, unbiased)  # the bias and the group limit decided some choices
    torch.testing.assert_close(ours(x).y, hf(x), **TOL)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_moe(topk_method):
    """Softmax scores, the top-k of all experts or of the topk_group groups of largest maximum score
    (group_score: max), never renormalised, times routed_scaling_factor; shared experts."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    E, K, G, M, shared = 16, 3, 4, 2, 2
    hf_cfg = DeepseekV2Config(hidden_size=D, moe_intermediate_size=F_EXPERT, n_routed_experts=E, num_experts_per_tok=K,
                              topk_method=topk_method, n_group=G, topk_group=M, routed_scaling_factor=16.0,
                              n_shared_experts=shared, hidden_act="silu", num_attention_heads=2)
    torch.manual_seed(2)
    hf = DeepseekV2Moe(hf_cfg).float().eval()
    perturb(hf)
    grouped = dict(num_groups=G, group_topk=M, group_score="max") if topk_method == "group_limited_greedy" else {}
    router = TopKConfig(k=K, score="softmax", renormalize=False, scaling_factor=16.0, load_balancing_weight=0.0,
                        **grouped)
    ours = our_copy(hf, router, E, SharedExpertConfig(hidden_size=F_EXPERT * shared, gate="none"), hf.shared_experts)
    x = torch.randn(3, 10, D)
    _, _, hf_idx = hf.gate(x)
    chosen = our_choices(ours, x)
    assert torch.equal(chosen, as_mask(hf_idx, E))
    unlimited = as_mask(torch.softmax(x.reshape(-1, D) @ hf.gate.weight.t(), -1).topk(K, dim=-1).indices, E)
    assert torch.equal(chosen, unlimited) == (topk_method == "greedy")  # the group limit decided some choices
    torch.testing.assert_close(ours(x).y, hf(x), **TOL)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen2_moe_sparse_block(norm_topk_prob):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    E, K = 8, 2
    hf_cfg = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F_EXPERT, num_experts=E, num_experts_per_tok=K,
                            shared_expert_intermediate_size=12, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    torch.manual_seed(1)
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).float().eval()
    perturb(hf)
    router = TopKConfig(k=K, score="softmax", renormalize=norm_topk_prob, load_balancing_weight=0.001,
                        load_balancing_scope="global")
    ours = our_copy(hf, router, E, SharedExpertConfig(hidden_size=12, gate="sigmoid"), hf.shared_expert)
    with torch.no_grad():
        ours.shared.gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(2, 12, D)
    _, _, hf_idx = hf.gate(x.reshape(-1, D))
    assert torch.equal(our_choices(ours, x), as_mask(hf_idx, E))
    torch.testing.assert_close(ours(x).y, hf(x), **TOL)


@pytest.fixture
def one_process_group(tmp_path):
    """DeepSpeed's MoE needs its expert groups: a world of one gloo process, in this process."""
    if dist.is_initialized():
        yield
        return
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    # DeepSpeed keeps its groups in module globals (_EXPERT_PARALLEL_GROUP, ...): put them back afterwards
    saved = {k: copy.copy(v) for k, v in vars(groups).items() if k.startswith("_") and k.strip("_").isupper()}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # adopts the torch group
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(groups, name, value)
        dist.destroy_process_group()
        ds_comm.cdb = None  # later tests start from an uninitialised deepspeed.comm


def test_deepspeed_residual_moe(one_process_group):
    """MoE(use_residual=True): out = c0 moe(x) + c1 mlp(x), [c0, c1] = softmax(Linear(x)); its top-2 gate (no
    second-expert sampling, no drops) renormalises the two probabilities, as our top-2 with renormalize."""
    from deepspeed.moe.layer import MoE

    from moep_ds.layers.ffn import SwiGLU

    E = 4
    torch.manual_seed(2)
    ours = our_layer(TopKConfig(k=2, renormalize=True, load_balancing_weight=0.0), E,
                     SharedExpertConfig(hidden_size=F_EXPERT, gate="residual_mix"))
    perturb(ours)
    ds = MoE(D, SwiGLU(FFNConfig(type="swiglu", hidden_size=F_EXPERT), D), num_experts=E, ep_size=1, k=2,
             use_residual=True, drop_tokens=False, top2_2nd_expert_sampling=False, use_rts=False)
    ds.set_deepspeed_parallelism()
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for e, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.weight.copy_(ours.experts.w1_EDF[e].t())
            expert.w3.weight.copy_(ours.experts.w3_EDF[e].t())
            expert.w2.weight.copy_(ours.experts.w2_EFD[e].t())
        ds.mlp.load_state_dict(ours.shared.ffn.state_dict())
        ds.coefficient.load_state_dict(ours.shared.gate.state_dict())
    x = torch.randn(2, 9, D, requires_grad=True)
    y_ds, _, counts_ds = ds(x)
    out = ours(x)
    torch.testing.assert_close(out.y, y_ds, **TOL)
    assert torch.equal(out.stats["tokens_per_expert"].long(), counts_ds.long())
    grad_ds, = torch.autograd.grad(y_ds.square().sum(), x)
    grad_ours, = torch.autograd.grad(out.y.square().sum(), x)
    torch.testing.assert_close(grad_ours, grad_ds, **TOL)


def test_router_logits_in_the_input_dtype_as_mixtral():
    """logits_dtype input: a bf16 model's router multiplies in bf16 and takes the softmax in fp32, as transformers'
    Mixtral (and Qwen-MoE, OLMoE) router; the fp32 default differs from it there."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    from moep_ds.routing.topk import TopKRouter

    E, K = 8, 2
    torch.manual_seed(3)
    hf = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=E, num_experts_per_tok=K)).bfloat16()
    perturb(hf, std=1.0)
    x_TD = torch.randn(64, 64).bfloat16()
    hf_logits, hf_weights, hf_idx = hf(x_TD)
    routers = {}
    for dtype, equal in (("input", True), ("float32", False)):
        routers[dtype] = TopKRouter(TopKConfig(k=K, renormalize=True, logits_dtype=dtype), d_model=64, num_experts=E)
        with torch.no_grad():
            routers[dtype].weight.copy_(hf.weight.float())
        logits = routers[dtype].logits(x_TD)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, hf_logits.float()) == equal
    plan = routers["input"](x_TD)
    chosen_TE = torch.zeros(64, E, dtype=torch.bool)
    chosen_TE[plan.token_idx_S, plan.expert_idx_S()] = True
    assert torch.equal(chosen_TE, as_mask(hf_idx, E))
