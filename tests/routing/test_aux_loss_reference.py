"""The top-k router's auxiliary losses and jitter against the implementations they name, on the same weights:

- load balancing, scopes micro_batch / sequence / global: Megatron-Core 0.16's `aux_loss`, `seq_aux_loss` and
  `global_aux_loss` (megatron/core/transformer/moe/router.py, moe_utils.py: compute_routing_scores_for_aux_loss,
  switch_load_balancing_loss_func), transcribed below as pure functions of the router logits (the process-group
  reductions are the identity on one process; the global scope's other ranks are added by hand). f counts an
  unbiased top-k over all experts, whatever selection bias and group limit the routing itself uses.
- router z-loss: ST-MoE eq. 5 as transformers' switch_transformers `router_z_loss_func` and Megatron-Core's
  `z_loss_func` compute it.
- jitter: transformers' `SwitchTransformersTop1Router` (Switch Transformer's multiplicative input noise), whose
  router logits ours equal under the same random stream.

When megatron-core is importable (`pip install --no-deps megatron-core`) the transcription is also checked
against it; the test suite does not need it.
"""
from __future__ import annotations

import pytest
import torch

from moep_ds.routing.topk import TopKConfig, TopKRouter

E, D, B, S, K = 8, 6, 3, 10, 2

# ---- Megatron-Core 0.16, transcribed (single process: every reduction over a group of size 1) ----------------


def mcore_scores_for_aux_loss(logits, topk, score_function):
    """compute_routing_scores_for_aux_loss: (routing_map [T, E] bool, scores [T, E]) of an unbiased top-k."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)  # Megatron's dtype=torch.float32: the same for fp32 logits
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=1).indices
    return torch.zeros_like(logits).int().scatter(1, top, 1).bool(), scores


def mcore_switch_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    """switch_load_balancing_loss_func (unfused, no padding mask)."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def mcore_aux_loss(logits_SBE, topk, score_function, coeff, other_counts=None, ranks=1):
    """TopKRouter.routing's aux_loss; with `other_counts` (the other ranks' routing_map sums) its global_aux_loss
    (one accumulation step: the running average is this micro-batch's global counts)."""
    routing_map, scores = mcore_scores_for_aux_loss(logits_SBE.reshape(-1, logits_SBE.shape[-1]), topk,
                                                    score_function)
    counts = routing_map.sum(dim=0)
    if other_counts is not None:
        counts = counts + other_counts
    total = routing_map.shape[0] * ranks
    return mcore_switch_loss(scores, counts, total, topk, logits_SBE.shape[-1], coeff)


def mcore_seq_aux_loss(logits_SBE, topk, score_function, coeff):
    """TopKRouter._apply_seq_aux_loss: [S, B*E] columns, one per (sequence, expert), divided by B."""
    seq_length, bsz, num_experts = logits_SBE.shape
    routing_map, scores = mcore_scores_for_aux_loss(logits_SBE.reshape(-1, num_experts), topk, score_function)
    scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
    counts = routing_map.sum(dim=0)
    return mcore_switch_loss(scores, counts, seq_length, topk, num_experts, coeff) / bsz


def mcore_z_loss(logits, coeff):
    """z_loss_func (no padding mask)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


# ---- the comparison ------------------------------------------------------------------------------------------


def router(score, scope, biased, **cfg):
    torch.manual_seed(0)
    options = dict(num_groups=4, group_topk=2, bias_update_rate=0.01) if biased else {}
    r = TopKRouter(TopKConfig(k=K, score=score, load_balancing_weight=0.1, load_balancing_scope=scope,
                              **options, **cfg), d_model=D, num_experts=E).double()
    with torch.no_grad():
        r.weight.normal_()
        if biased:  # a selection bias as loss-free balancing leaves it after some steps
            r.balancer.bias_E.copy_(0.1 * torch.randn(E, dtype=torch.float64))
    return r


def ours_and_megatron(r, x_BSD, reference):
    """(our loss, its router-weight gradient, Megatron's loss, its gradient) on the same weights and input."""
    ours = r(x_BSD).aux_losses["load_balancing_loss"]
    (grad,) = torch.autograd.grad(ours, r.weight)
    w = r.weight.detach().clone().requires_grad_(True)
    logits_SBE = (x_BSD @ w.t()).transpose(0, 1)  # Megatron's [sequence, batch, experts] layout
    theirs = reference(logits_SBE)
    (ref_grad,) = torch.autograd.grad(theirs, w)
    return ours, grad, theirs, ref_grad


@pytest.mark.parametrize("biased", [False, True], ids=["plain", "bias+groups"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("scope", ["micro_batch", "sequence", "global"])
def test_load_balancing_loss_and_gradient_equal_megatron_cores(scope, score, biased):
    """Issue 40 item 14: with a selection bias and a group limit the routing chooses other experts than the
    unbiased top-k; the loss counts the latter, as Megatron-Core and DeepSeek-V3 eq. 18."""
    r = router(score, scope, biased)
    x = torch.randn(B, S, D, dtype=torch.float64)
    other = torch.tensor([19.0, 0.0, 3.0, 11.0, 0.0, 14.0, 9.0, 4.0], dtype=torch.float64)  # another rank: 30 x 2
    if scope == "global":
        r.count_reducer = lambda counts: counts + torch.cat([other, other.sum().reshape(1)])
        reference = lambda logits: 2 * mcore_aux_loss(logits, K, score, 0.1, other_counts=other, ranks=2)
        # Megatron's value on each of the N = 2 ranks is the rank's share P_local * T_local / T_global of the
        # global-batch loss; ours is E sum f P_local, whose mean over the ranks is the global-batch loss
    elif scope == "sequence":
        reference = lambda logits: mcore_seq_aux_loss(logits, K, score, 0.1)
    else:
        reference = lambda logits: mcore_aux_loss(logits, K, score, 0.1)
    ours, grad, theirs, ref_grad = ours_and_megatron(r, x, reference)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-15)
    if biased:  # the case the test is about: the routing's own choice differs from the counted top-k
        plan = r(x)
        chosen = plan.token_idx_S * E + plan.expert_idx_S()
        scores = torch.sigmoid(x.reshape(-1, D) @ r.weight.t()) if score == "sigmoid" else \
            torch.softmax(x.reshape(-1, D) @ r.weight.t(), -1)
        unbiased = scores.topk(K, -1).indices + E * torch.arange(B * S).unsqueeze(1)
        assert set(chosen.tolist()) != set(unbiased.flatten().tolist())


def test_z_loss_equals_st_moe_as_transformers_and_megatron_compute_it():
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    torch.manual_seed(0)
    r = TopKRouter(TopKConfig(k=K, load_balancing_weight=0.0, z_loss_weight=1e-3), d_model=D, num_experts=E).double()
    with torch.no_grad():
        r.weight.normal_(std=3.0)
    x = torch.randn(B, S, D, dtype=torch.float64)
    ours = r(x).aux_losses["router_z_loss"]
    (grad,) = torch.autograd.grad(ours, r.weight)
    w = r.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    switch = 1e-3 * router_z_loss_func(logits)  # [groups = B, tokens per group = S, E]
    (ref_grad,) = torch.autograd.grad(switch, w)
    torch.testing.assert_close(ours, switch, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours, mcore_z_loss(logits.reshape(-1, E), 1e-3), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jitter_is_switch_transformers_router_noise(dtype):
    """The same random stream gives the same noise: router logits equal transformers' SwitchTransformersTop1Router
    (which jitters the input after casting it to its fp32 router dtype), in training only."""
    from transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router

    hf = SwitchTransformersTop1Router(SwitchTransformersConfig(
        d_model=D, num_experts=E, router_jitter_noise=0.3, router_bias=False, expert_capacity=B * S))
    ours = TopKRouter(TopKConfig(k=1, jitter=0.3, load_balancing_weight=0.0), d_model=D, num_experts=E)
    with torch.no_grad():
        ours.weight.copy_(hf.classifier.weight)
    x = torch.randn(B, S, D).to(dtype)
    for training in (True, False):
        hf.train(training), ours.train(training)
        torch.manual_seed(1)
        _, _, hf_logits = hf(x.clone())
        torch.manual_seed(1)
        torch.testing.assert_close(ours_logits(ours, x), hf_logits.reshape(-1, E), rtol=0, atol=0)
    assert not torch.equal(jittered(ours, x, seed=1), jittered(ours, x, seed=2))
    assert not torch.equal(jittered(ours, x, seed=1), ours_logits(ours.eval(), x))


def ours_logits(r: TopKRouter, x_BSD: torch.Tensor) -> torch.Tensor:
    """The logits our router computes in its forward (jitter included), captured from its `logits` call."""
    seen = []
    original = r.logits
    r.logits = lambda x_TD: seen.append(original(x_TD)) or seen[-1]
    try:
        r(x_BSD)
    finally:
        del r.logits
    return seen[0]


def jittered(r, x, seed):
    r.train()
    torch.manual_seed(seed)
    return ours_logits(r, x)


def test_the_transcription_is_megatron_cores():
    """When megatron-core is installed: the functions above are its own on the same inputs."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    torch.manual_seed(0)
    logits = torch.randn(S * B, E)
    for score in ("softmax", "sigmoid"):
        ref_map, ref_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, K, score)
        routing_map, scores = mcore_scores_for_aux_loss(logits, K, score)
        assert torch.equal(routing_map, ref_map) and torch.equal(scores, ref_scores)
        counts = routing_map.sum(0)
        assert torch.equal(
            moe_utils.switch_load_balancing_loss_func(scores, counts, S * B, K, E, 0.1),
            mcore_switch_loss(scores, counts, S * B, K, E, 0.1))
    assert torch.equal(moe_utils.z_loss_func(logits, 1e-3), mcore_z_loss(logits, 1e-3))
