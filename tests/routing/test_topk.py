import math

import pytest
import torch

from moep_ds.routing.topk import TopKConfig, TopKRouter, topk_capacity
from moep_ds.schema import ConfigError, parse

PROBS = torch.tensor(
    [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.4, 0.1], [0.15, 0.25, 0.6]], dtype=torch.float64
)


def router_with_probs(probs_TE: torch.Tensor, **cfg):
    """A router whose logits are log(probs): identity weight, inputs log p (softmax(log p) = p)."""
    E = probs_TE.shape[1]
    r = TopKRouter(TopKConfig(**cfg), d_model=E, num_experts=E).double()
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    return r, probs_TE.log().unsqueeze(0)


def test_load_balancing_loss_hand_computed():
    r, x = router_with_probs(PROBS, k=2, load_balancing_weight=0.01)
    plan = r(x)
    # top-2 per token: {0,1}, {1,2}, {0,1}, {2,1} -> f = [2, 4, 2] / 8;  P = column means = [.3625, .3625, .275]
    expected = 0.01 * 3 * (2 / 8 * 0.3625 + 4 / 8 * 0.3625 + 2 / 8 * 0.275)
    assert plan.aux_losses["load_balancing_loss"].item() == pytest.approx(expected, rel=1e-12)
    r1, _ = router_with_probs(PROBS, k=1, load_balancing_weight=0.01)
    # top-1: 0, 1, 0, 2 -> f = [.5, .25, .25]
    expected1 = 0.01 * 3 * (0.5 * 0.3625 + 0.25 * 0.3625 + 0.25 * 0.275)
    assert r1(x).aux_losses["load_balancing_loss"].item() == pytest.approx(expected1, rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_uniform_router_gives_exactly_alpha(k):
    r = TopKRouter(TopKConfig(k=k, load_balancing_weight=0.05), d_model=6, num_experts=8)
    with torch.no_grad():
        r.weight.zero_()
    loss = r(torch.randn(2, 5, 6)).aux_losses["load_balancing_loss"]
    assert abs(loss.item() - 0.05) < 1e-8


def test_z_loss_value():
    r = TopKRouter(TopKConfig(k=1, z_loss_weight=1e-3, load_balancing_weight=0.0), d_model=2, num_experts=2).double()
    with torch.no_grad():
        r.weight.copy_(torch.eye(2))
    plan = r(torch.tensor([[[0.0, 0.0], [2.0, 0.0]]], dtype=torch.float64))
    expected = 1e-3 * (math.log(2) ** 2 + math.log(math.e**2 + 1) ** 2) / 2
    assert plan.aux_losses["router_z_loss"].item() == pytest.approx(expected, rel=1e-12)
    assert set(plan.aux_losses) == {"router_z_loss"}  # a zero weight adds no loss term


def test_dropless_processes_every_token_k_times():
    torch.manual_seed(0)
    r = TopKRouter(TopKConfig(k=2), d_model=8, num_experts=4)
    with torch.no_grad():
        r.weight[0] += 1.0  # an overloaded expert: nothing is dropped anyway
    x = torch.randn(3, 7, 8).abs()
    plan = r(x)
    assert sorted(plan.token_idx_S.tolist()) == sorted(list(range(21)) * 2)
    assert plan.stats["dropped_fraction"].item() == 0.0
    assert max(plan.counts()) > 21 * 2 / 4 * 1.5  # really unbalanced
    # each expert's tokens are those that chose it, weights are their probabilities
    probs = torch.softmax(x.reshape(21, 8) @ r.weight.T, -1)
    chosen = probs.topk(2, -1).indices
    for e, tokens in enumerate(plan.token_idx_S.split(plan.counts())):
        assert tokens.tolist() == [t for t in range(21) if e in chosen[t].tolist()]
    torch.testing.assert_close(plan.weight_S, probs[plan.token_idx_S, plan.expert_idx_S()])


def naive_capacity_plan(probs_TE: torch.Tensor, k: int, capacity: int) -> list[list[int]]:
    T, E = probs_TE.shape
    chosen = [sorted(range(E), key=lambda e: -probs_TE[t, e].item())[:k] for t in range(T)]
    kept = []
    for e in range(E):
        tokens = [t for t in range(T) if e in chosen[t]]
        kept.append(sorted(sorted(tokens, key=lambda t: -probs_TE[t, e].item())[:capacity]))
    return kept


@pytest.mark.parametrize("k, renormalize", [(1, False), (2, True)])
def test_capacity_drops_lowest_probability(k, renormalize):
    torch.manual_seed(1)
    T, E, D = 13, 4, 8
    r = TopKRouter(TopKConfig(k=k, capacity_factor=0.6, renormalize=renormalize), d_model=D, num_experts=E).double()
    x = torch.randn(1, T, D, dtype=torch.float64)
    plan = r(x)
    capacity = topk_capacity(T, E, k, 0.6)
    assert capacity == math.ceil(0.6 * T * k / E)
    probs = torch.softmax(x[0] @ r.weight.T, -1)
    expected = naive_capacity_plan(probs, k, capacity)
    got = [sorted(t.tolist()) for t in plan.token_idx_S.split(plan.counts())]
    assert got == expected
    covered = {t for tokens in expected for t in tokens}
    assert plan.stats["dropped_fraction"].item() == pytest.approx(1 - len(covered) / T)
    assert max(plan.counts()) <= capacity
    top = probs.topk(k, -1).values
    weights = top / top.sum(-1, keepdim=True) if renormalize else top
    table = torch.zeros(T, E, dtype=torch.float64).scatter(1, probs.topk(k, -1).indices, weights)
    torch.testing.assert_close(plan.weight_S, table[plan.token_idx_S, plan.expert_idx_S()])


@pytest.mark.parametrize(
    "t, e, k, cf, expected",
    [
        (9, 4, 1, 1.0, 3),  # 2.25 rounds up (ceil, not nearest)
        (10, 8, 2, 1.25, 4),  # 3.125
        (10, 11, 1, 1.1, 1),  # exactly 1: no float error pushing ceil to 2
        (3, 8, 1, 0.5, 1),  # at least one token
        (5, 2, 2, 4.0, 5),  # at most T: a token picks an expert at most once
    ],
)
def test_capacity_is_ceil_of_cf_t_k_over_e(t, e, k, cf, expected):
    assert topk_capacity(t, e, k, cf) == expected


def test_jitter_only_in_training():
    torch.manual_seed(0)
    r = TopKRouter(TopKConfig(k=2, jitter=0.5), d_model=8, num_experts=4)
    x = torch.randn(2, 16, 8)
    r.eval()
    assert torch.equal(r(x).weight_S, r(x).weight_S)
    r.train()
    assert not torch.equal(r(x).weight_S, r(x).weight_S)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"^router.k \(0\) must be > 0$"):
        parse(TopKConfig, {"k": 0}, "router")
    with pytest.raises(ConfigError, match=r"^router.capacity_factor \(-1.0\) must be > 0$"):
        parse(TopKConfig, {"capacity_factor": -1}, "router")
    with pytest.raises(ConfigError, match=r"^router.load_balancing_weight \(-0.1\) must be >= 0$"):
        parse(TopKConfig, {"load_balancing_weight": -0.1}, "router")
    with pytest.raises(ConfigError, match=r"^router.k \(5\) must be <= num_experts \(4\)$"):
        TopKRouter(TopKConfig(k=5), d_model=8, num_experts=4)
