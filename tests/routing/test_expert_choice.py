import pytest
import torch

from moep_ds.routing.expert_choice import (
    ExpertChoiceConfig,
    ExpertChoiceRouter,
    expert_choice_affinities,
    expert_choice_capacity,
    select_topk_tokens,
)
from moep_ds.schema import ConfigError, parse

D, E = 8, 4


def router(**cfg) -> ExpertChoiceRouter:
    torch.manual_seed(0)
    return ExpertChoiceRouter(ExpertChoiceConfig(**cfg), d_model=D, num_experts=E).double()


def assignments(plan) -> list[list[int]]:
    """Token indices of each expert, as Python lists."""
    return [t.tolist() for t in plan.token_idx_S.split(plan.counts())]


@pytest.mark.parametrize(
    "n, e, c, rounding, expected",
    [
        (13, 8, 1.25, "ceil", 3),  # 2.03 -> 3 (Nova)
        (13, 8, 1.25, "nearest", 2),
        (11, 4, 1.0, "ceil", 3),  # 2.75
        (11, 4, 1.0, "nearest", 3),
        (10, 4, 1.0, "nearest", 3),  # 2.5 rounds half up, not to even
        (10, 11, 1.1, "ceil", 1),  # exactly 1: no float error pushing ceil to 2
        (3, 8, 0.5, "nearest", 1),  # at least one token
        (5, 2, 4.0, "ceil", 5),  # at most N tokens
    ],
)
def test_capacity_rounding(n, e, c, rounding, expected):
    assert expert_choice_capacity(n, e, c, rounding) == expected


def test_affinity_normalisation_axes():
    logits = torch.randn(2, 7, E, dtype=torch.float64)
    per_token = expert_choice_affinities(logits, "softmax_experts").sum(-1)
    per_expert = expert_choice_affinities(logits, "softmax_tokens").sum(1)
    torch.testing.assert_close(per_token, torch.ones(2, 7, dtype=torch.float64))
    torch.testing.assert_close(per_expert, torch.ones(2, E, dtype=torch.float64))


def naive_topk_tokens(r_GNE: torch.Tensor, k: int) -> list[list[int]]:
    G, N, _ = r_GNE.shape
    chosen = []
    for i in range(E):
        tokens = []
        for g in range(G):
            ranked = sorted(range(N), key=lambda t: -r_GNE[g, t, i].item())
            tokens += [g * N + t for t in ranked[:k]]
        chosen.append(tokens)
    return chosen


@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("score", ["softmax_experts", "softmax_tokens"])
def test_every_expert_takes_exactly_k_top_tokens(scope, score):
    B, T = 3, 7  # odd token counts
    r = router(capacity_factor=1.25, rounding="ceil", scope=scope, score=score)
    x = torch.randn(B, T, D, dtype=torch.float64)
    plan = r(x)
    n = T if scope == "sequence" else B * T
    k = expert_choice_capacity(n, E, 1.25, "ceil")
    groups = B if scope == "sequence" else 1
    assert plan.counts() == [groups * k] * E
    logits = (x.reshape(B * T, D) @ r.weight.T).view(groups, n, E)
    affinity = expert_choice_affinities(logits, score)
    assert [sorted(a) for a in assignments(plan)] == [sorted(a) for a in naive_topk_tokens(affinity, k)]
    # combine weight = affinity of the chosen token
    expert = plan.expert_idx_S()
    torch.testing.assert_close(plan.weight_S, affinity.reshape(B * T, E)[plan.token_idx_S, expert])
    if scope == "sequence":  # k tokens of each sequence per expert
        for tokens in assignments(plan):
            assert sorted(t // T for t in tokens) == sorted(list(range(B)) * k)


def test_drop_metrics():
    B, T = 2, 9
    r = router(capacity_factor=0.5)
    plan = r(torch.randn(B, T, D, dtype=torch.float64))
    covered = {t for tokens in assignments(plan) for t in tokens}
    assert plan.stats["dropped_fraction"].item() == pytest.approx(1 - len(covered) / (B * T))
    assert plan.stats["tokens_per_expert"].tolist() == [float(c) for c in plan.counts()]
    assert 0 < plan.stats["router_entropy"].item() <= torch.log(torch.tensor(float(E))).item()
    full = router(capacity_factor=float(E))  # every expert takes every token: nothing dropped
    assert full(torch.randn(B, T, D, dtype=torch.float64)).stats["dropped_fraction"].item() == 0.0


@pytest.mark.parametrize("score", ["softmax_experts", "softmax_tokens"])
def test_gradient_reaches_router_weight(score):
    r = router(score=score)
    plan = r(torch.randn(2, 5, D, dtype=torch.float64))
    (plan.weight_S * torch.randn_like(plan.weight_S)).sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_router_logits_are_fp32_for_bf16_inputs():
    r = ExpertChoiceRouter(ExpertChoiceConfig(), d_model=D, num_experts=E).bfloat16()
    plan = r(torch.randn(2, 5, D, dtype=torch.bfloat16))
    assert plan.weight_S.dtype == torch.float32


def test_thresholds_track_kth_affinity_in_training_only():
    decay = 0.9
    r = router(threshold_ema_decay=decay, capacity_factor=1.0)
    x1, x2 = torch.randn(2, 2, 8, D, dtype=torch.float64)
    k = expert_choice_capacity(16, E, 1.0, "nearest")

    def kth(x):
        affinity = torch.softmax(x.reshape(16, D) @ r.weight.T, dim=-1)
        return affinity.topk(k, dim=0).values[-1]

    r.train()
    r(x1)
    torch.testing.assert_close(r.threshold.double(), kth(x1), check_dtype=False)  # first update copies
    r(x2)
    torch.testing.assert_close(r.threshold.double(), decay * kth(x1) + (1 - decay) * kth(x2), check_dtype=False)
    before = r.threshold.clone()
    r.eval()
    r(torch.randn(2, 8, D, dtype=torch.float64))
    assert torch.equal(r.threshold, before) and r.num_threshold_updates.item() == 2
    state = r.state_dict()
    assert {"threshold", "log_norm", "num_threshold_updates"} <= set(state)
    fresh = router(threshold_ema_decay=decay)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.threshold, before)


def test_sequence_scope_statistics_average_over_sequences():
    """scope sequence: the threshold is the mean over sequences of each one's k-th affinity and log_norm the mean
    over sequences of log sum_t exp(l[t, i]) (what threshold mode divides by for one sequence's tokens)."""
    decay, B, T = 0.9, 3, 8
    r = router(score="softmax_tokens", scope="sequence", threshold_ema_decay=decay, capacity_factor=1.0)
    k = expert_choice_capacity(T, E, 1.0, "nearest")

    def naive(x):
        kth, log_norm = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        for b in range(B):
            logits = x[b] @ r.weight.T
            for i in range(E):
                z = sum(torch.exp(logits[t, i]) for t in range(T))
                kth[i] += sorted((torch.exp(logits[t, i]) / z).item() for t in range(T))[-k] / B
                log_norm[i] += torch.log(z) / B
        return kth, log_norm

    x1, x2 = torch.randn(2, B, T, D, dtype=torch.float64) * 3
    r.train()
    r(x1)
    kth1, norm1 = naive(x1)
    torch.testing.assert_close(r.threshold.double(), kth1, check_dtype=False)
    torch.testing.assert_close(r.log_norm.double(), norm1, check_dtype=False)
    r(x2)
    kth2, norm2 = naive(x2)
    torch.testing.assert_close(r.threshold.double(), decay * kth1 + (1 - decay) * kth2, check_dtype=False)
    torch.testing.assert_close(r.log_norm.double(), decay * norm1 + (1 - decay) * norm2, check_dtype=False)


def test_thresholds_stay_fp32_when_the_model_is_cast():
    r = router()
    r.train()
    r(torch.randn(2, 8, D, dtype=torch.float64))
    value = r.threshold.clone()
    r.bfloat16()
    assert r.weight.dtype == torch.bfloat16 and r.threshold.dtype == torch.float32
    assert torch.equal(r.threshold, value.float())


@pytest.mark.parametrize("score", ["softmax_experts", "softmax_tokens"])
def test_threshold_mode_routes_each_token_on_its_own(score):
    r = router(score=score, eval_mode="threshold")
    r.train()
    for _ in range(3):
        r(torch.randn(4, 8, D, dtype=torch.float64))
    r.eval()
    x = torch.randn(3, 8, D, dtype=torch.float64)
    plan = r(x)
    logits = x.reshape(24, D) @ r.weight.T
    if score == "softmax_tokens":
        affinity = torch.exp(logits - r.log_norm.double())
    else:
        affinity = torch.softmax(logits, -1)
    expected = [[t for t in range(24) if affinity[t, i] >= r.threshold[i].double()] for i in range(E)]
    assert assignments(plan) == expected
    assert 0 < sum(map(len, expected)) < 24 * E  # the thresholds actually separate tokens
    # a token's experts do not depend on the other tokens: route the first sequence alone
    alone = r(x[:1])
    assert [[t for t in a if t < 8] for a in assignments(plan)] == assignments(alone)


def test_topk_eval_mode_keeps_training_rule():
    r = router(eval_mode="topk", capacity_factor=1.0)
    r.eval()
    plan = r(torch.randn(2, 6, D, dtype=torch.float64))
    assert plan.counts() == [3] * E and r.num_threshold_updates.item() == 0


def test_select_topk_tokens_offsets_groups():
    r = torch.rand(3, 5, E)
    token_idx, weight, counts, kth = select_topk_tokens(r, 2)
    assert counts.tolist() == [6] * E
    assert token_idx.view(E, 3, 2).div(5, rounding_mode="floor").tolist() == [[[0, 0], [1, 1], [2, 2]]] * E
    torch.testing.assert_close(kth, r.topk(2, dim=1).values[:, -1].mean(0))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"capacity_factor": 0}, "router.capacity_factor (0.0) must be > 0"),
        ({"score": "softmax"}, "router.score ('softmax') must be one of softmax_experts, softmax_tokens"),
        ({"rounding": "floor"}, "router.rounding ('floor') must be one of nearest, ceil"),
        ({"scope": "global"}, "router.scope ('global') must be one of batch, sequence"),
        ({"threshold_ema_decay": 1.0}, "router.threshold_ema_decay (1.0) must be in [0.0, 1.0)"),
    ],
)
def test_config_errors(raw, message):
    with pytest.raises(ConfigError) as err:
        parse(ExpertChoiceConfig, raw, "router")
    assert str(err.value) == message


@pytest.mark.parametrize("setting,c,E,expected", [("one", 2.0, 4, 1), ("capacity", 2.0, 4, 2.0),
                                                  ("capacity", 1.25, 8, 1.25), ("capacity", 6.0, 4, 4)])
def test_the_router_decides_active_experts_per_token(setting, c, E, expected):
    """Nova-MoE counts one expert per token; the MSIT method counts c (at most E): a setting of the router."""
    cfg = ExpertChoiceConfig(capacity_factor=c, active_experts=setting)
    assert ExpertChoiceRouter(cfg, d_model=4, num_experts=E).active_experts_per_token() == expected


@pytest.mark.parametrize("scope", ["batch", "sequence"])
def test_training_plan_counts_are_static(scope):
    """Expert choice knows its counts in advance: dispatch reads them without a device-to-host copy."""
    r = router(scope=scope, capacity_factor=1.5)
    r.train()
    plan = r(torch.randn(3, 8, D, dtype=torch.float64))
    groups, n = (3, 8) if scope == "sequence" else (1, 24)
    k = expert_choice_capacity(n, E, 1.5, "nearest")
    assert plan.static_counts == (groups * k,) * E
    assert plan.counts() == plan.counts_E.tolist() == list(plan.static_counts)
    r.eval()  # threshold mode: counts depend on the data
    assert r(torch.randn(3, 8, D, dtype=torch.float64)).static_counts is None
