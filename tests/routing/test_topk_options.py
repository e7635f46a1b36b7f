"""Top-k routing options against naive per-token references (fp64): sigmoid scores with renormalisation and
scaling, the loss-free balancing bias (selection only; its update; counts not taken twice in a recomputation),
group-limited choice, load-balancing scopes, drop policies, config errors."""
from __future__ import annotations

import math

import pytest
import torch

from moep_ds.recompute import recomputing
from moep_ds.routing.balancing import ExpertBias, loss_free_bias_update
from moep_ds.routing.topk import TopKConfig, TopKRouter
from moep_ds.schema import ConfigError, parse

D = 6


def make_router(E: int, seed: int = 0, **cfg) -> TopKRouter:
    torch.manual_seed(seed)
    r = TopKRouter(TopKConfig(**cfg), d_model=D, num_experts=E).double()
    with torch.no_grad():
        r.weight.normal_(std=1.0)
    return r


def routes(plan) -> dict[int, dict[int, float]]:
    """token -> {expert: weight} of a plan."""
    out: dict[int, dict[int, float]] = {t: {} for t in range(plan.num_tokens)}
    for t, e, w in zip(plan.token_idx_S.tolist(), plan.expert_idx_S().tolist(), plan.weight_S.tolist()):
        out[t][e] = w
    return out


def naive_routes(r: TopKRouter, x_BTD: torch.Tensor) -> dict[int, dict[int, float]]:
    """Token by token, by the definitions (routing/topk.py docstring), in plain Python over experts."""
    cfg, E = r.cfg, r.num_experts
    bias = [0.0] * E if r.balancer is None else r.balancer.bias_E.tolist()
    x_TD = x_BTD.reshape(-1, D)
    out = {}
    for t in range(x_TD.shape[0]):
        logits = [float(x_TD[t] @ r.weight[e].detach()) for e in range(E)]
        if cfg.score == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            z = sum(math.exp(v) for v in logits)
            s = [math.exp(v) / z for v in logits]
        c = [s[e] + bias[e] for e in range(E)]
        allowed = list(range(E))
        if cfg.num_groups > 1 and cfg.group_topk is not None:
            n = E // cfg.num_groups
            take = 1 if cfg.group_score == "max" else 2  # the largest, or the sum of the two largest
            group_score = [sum(sorted(c[g * n:(g + 1) * n], reverse=True)[:take]) for g in range(cfg.num_groups)]
            kept = sorted(range(cfg.num_groups), key=lambda g: -group_score[g])[:cfg.group_topk]
            allowed = [e for e in range(E) if e // n in kept]
        chosen = sorted(allowed, key=lambda e: -c[e])[:cfg.k]
        total = sum(s[e] for e in chosen) if cfg.renormalize else 1.0
        out[t] = {e: s[e] / total * cfg.scaling_factor for e in chosen}
    return out


def assert_same_routes(got, want):
    assert got.keys() == want.keys()
    for t in got:
        assert got[t].keys() == want[t].keys(), (t, got[t], want[t])
        for e in got[t]:
            assert got[t][e] == pytest.approx(want[t][e], rel=1e-10), (t, e)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_scores_renormalisation_and_scaling_factor(score, renormalize):
    r = make_router(8, k=3, score=score, renormalize=renormalize, scaling_factor=2.5)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    assert_same_routes(routes(r(x)), naive_routes(r, x))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_changes_selection_only(score):
    r = make_router(8, k=2, score=score, bias_update_rate=0.01)
    x = torch.randn(3, 8, D, dtype=torch.float64)
    before = routes(r(x))
    with torch.no_grad():
        r.balancer.bias_E.copy_(torch.linspace(-0.3, 0.3, 8))
    after = routes(r(x))
    assert before != after
    assert_same_routes(after, naive_routes(r, x))  # weights are the unbiased scores of the chosen experts
    assert torch.equal(r(x).stats["expert_bias"], r.balancer.bias_E.float())


@pytest.mark.parametrize("groups,group_topk,k", [(4, 2, 3), (4, 1, 2), (8, 3, 4), (2, 1, 2)])
def test_group_limited_choice(groups, group_topk, k):
    r = make_router(16, seed=groups + k, k=k, score="sigmoid", num_groups=groups, group_topk=group_topk,
                    bias_update_rate=0.0, renormalize=True)
    with torch.no_grad():
        r.balancer.bias_E.copy_(torch.randn(16, dtype=torch.float64) * 0.1)
    x = torch.randn(4, 6, D, dtype=torch.float64)
    got = routes(r(x))
    assert_same_routes(got, naive_routes(r, x))
    n = 16 // groups
    assert max(len({e // n for e in chosen}) for chosen in got.values()) <= group_topk


def test_groups_scored_by_their_largest_score_choose_otherwise():
    """group_score max (DeepSeek-V2's group_limited_greedy, softmax scores) by the definition, and on these tokens
    a choice other than the sum of each group's two largest makes."""
    common = dict(k=3, score="softmax", num_groups=4, group_topk=2, scaling_factor=2.0)
    r = make_router(16, seed=5, group_score="max", **common)
    x = torch.randn(8, 6, D, dtype=torch.float64)
    got = routes(r(x))
    assert_same_routes(got, naive_routes(r, x))
    top2 = make_router(16, seed=5, **common)
    assert torch.equal(top2.weight, r.weight) and routes(top2(x)) != got


def test_loss_free_bias_update_formula_and_state():
    bias = torch.tensor([0.0, 0.1, -0.2, 0.0])
    counts = torch.tensor([10, 2, 4, 4])  # mean 5
    assert torch.equal(loss_free_bias_update(bias, counts, 0.5), torch.tensor([-0.5, 0.6, 0.3, 0.5]))
    assert torch.equal(loss_free_bias_update(bias, torch.tensor([3, 3, 3, 3]), 0.5), bias)  # balanced: unchanged
    r = make_router(4, k=1, bias_update_rate=0.5).float()
    assert r.balancer.bias_E.dtype == torch.float32
    r.bfloat16()  # as DeepSpeed casts a bf16 model: the bias and counts keep their precision
    assert r.balancer.bias_E.dtype == torch.float32 and r.balancer.step_counts_E.dtype == torch.float64
    assert "balancer.bias_E" in r.state_dict() and "balancer.step_counts_E" not in r.state_dict()
    assert [n for n, _ in r.named_parameters()] == ["weight"]  # router state, not a parameter


def test_counts_are_taken_in_training_forwards_only_and_not_in_recomputation():
    r = make_router(4, k=2, bias_update_rate=0.1).train()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    plan = r(x)
    once = r.balancer.step_counts_E.clone()
    assert once.sum() == 2 * 5 * 2 and torch.equal(once, plan.counts_E.double())  # dropless: counts = assignments
    with recomputing(r):
        r(x)
    with torch.no_grad():
        r(x)
    r.eval()(x)
    assert torch.equal(r.balancer.step_counts_E, once)
    r.train()(x)
    assert torch.equal(r.balancer.step_counts_E, 2 * once)
    r.balancer.end_step()
    assert not r.balancer.step_counts_E.any()
    assert torch.equal(r.balancer.bias_E, loss_free_bias_update(torch.zeros(4), 2 * once, 0.1))


def imbalance_after(rate: float, steps: int = 60) -> float:
    """max/min expert load over the last 10 steps of a router with a skewed weight on a fixed token stream."""
    r = make_router(8, seed=3, k=2, score="sigmoid", bias_update_rate=rate).train()
    with torch.no_grad():
        r.weight[0] += 1.5  # expert 0 would take most tokens
    gen = torch.Generator().manual_seed(0)
    loads = torch.zeros(8, dtype=torch.float64)
    for step in range(steps):
        r(torch.randn(4, 16, D, dtype=torch.float64, generator=gen) + 0.5)
        if step >= steps - 10:
            loads += r.balancer.step_counts_E
        r.balancer.end_step()
    return float(loads.max() / loads.min().clamp(min=1))


def test_loss_free_balancing_evens_out_the_load():
    assert imbalance_after(0.02) < 0.5 * imbalance_after(0.0)
    assert imbalance_after(0.02) < 2.0


def test_sequence_scope_is_the_mean_of_each_sequences_loss():
    r = make_router(6, k=2, score="sigmoid", load_balancing_weight=0.1, load_balancing_scope="sequence")
    x = torch.randn(3, 5, D, dtype=torch.float64)
    got = r(x).aux_losses["load_balancing_loss"]
    per_sequence = []
    for b in range(3):
        rb = make_router(6, k=2, score="sigmoid", load_balancing_weight=0.1)
        per_sequence.append(rb(x[b:b + 1]).aux_losses["load_balancing_loss"])
        # by hand: f from the counts of this sequence's choices, P from normalised sigmoid scores
        s = torch.sigmoid(x[b] @ rb.weight.t())
        p = s / s.sum(-1, keepdim=True)
        counts = torch.zeros(6, dtype=torch.float64)
        for t in range(5):
            for e in s[t].topk(2).indices.tolist():
                counts[e] += 1
        assert float(per_sequence[-1]) == pytest.approx(0.1 * 6 * float((counts / 10 * p.mean(0)).sum()), rel=1e-12)
    assert float(got) == pytest.approx(float(sum(per_sequence) / 3), rel=1e-12)
    whole = make_router(6, k=2, score="sigmoid", load_balancing_weight=0.1)(x).aux_losses["load_balancing_loss"]
    assert float(got) != pytest.approx(float(whole), rel=1e-6)


def test_global_scope_takes_f_from_the_counts_summed_over_ranks():
    """A stand-in for the trainer's all-reduce adds another rank's counts: f is the global share, P local; the
    gradient flows through P only. In evaluation (or without a reducer) the scope falls back to the micro-batch."""
    other = torch.tensor([30.0, 0.0, 2.0, 0.0, 0.0, 0.0, 40.0], dtype=torch.float64)  # 6 experts + total 32+... below
    other[-1] = other[:-1].sum()
    r = make_router(6, k=2, load_balancing_weight=1.0, load_balancing_scope="global")
    r.count_reducer = lambda t: t + other
    x = torch.randn(2, 4, D, dtype=torch.float64)
    got = r(x).aux_losses["load_balancing_loss"]
    probs = torch.softmax(x.reshape(-1, D) @ r.weight.t(), -1)
    local = torch.zeros(6, dtype=torch.float64)
    for e in probs.topk(2, -1).indices.flatten().tolist():
        local[e] += 1
    f = (local + other[:6]) / (16 + other[6])
    assert float(got) == pytest.approx(float(6 * (f * probs.mean(0)).sum()), rel=1e-12)
    with torch.no_grad():
        micro = make_router(6, k=2, load_balancing_weight=1.0)(x).aux_losses["load_balancing_loss"]
    assert float(r.eval()(x).aux_losses["load_balancing_loss"]) == pytest.approx(float(micro), rel=1e-12)


@pytest.mark.parametrize("policy", ["probability", "position"])
def test_drop_policies(policy):
    r = make_router(4, k=2, capacity_factor=0.5, drop_policy=policy)
    x = torch.randn(1, 12, D, dtype=torch.float64)
    plan = r(x)
    capacity = math.ceil(0.5 * 12 * 2 / 4)
    probs = torch.softmax(x.reshape(-1, D) @ r.weight.t(), -1)
    chosen = probs.topk(2, -1).indices
    kept = routes(plan)
    for e in range(4):
        tokens = [t for t in range(12) if e in chosen[t].tolist()]
        if policy == "probability":
            want = sorted(tokens, key=lambda t: -float(probs[t, e]))[:capacity]
        else:
            want = tokens[:capacity]
        assert sorted(t for t in kept if e in kept[t]) == sorted(want), (e, policy)


@pytest.mark.parametrize("cfg,message", [
    ({"k": 2, "num_groups": 3}, "router.num_groups (3) must divide num_experts (8)"),
    ({"k": 2, "num_groups": 4, "group_topk": 5}, "router.group_topk (5) must be <= num_groups (4)"),
    ({"k": 5, "num_groups": 4, "group_topk": 2}, "router.k (5) must be <= the experts of the group_topk (2) groups a token may use (4)"),
    ({"k": 2, "score": "relu"}, "score"),
    ({"k": 2, "drop_policy": "random"}, "drop_policy"),
    ({"k": 2, "load_balancing_scope": "batch"}, "load_balancing_scope"),
    ({"k": 2, "bias_update_rate": -0.1}, "bias_update_rate"),
])
def test_config_errors_name_the_field(cfg, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        TopKRouter(parse(TopKConfig, cfg, "router"), d_model=D, num_experts=8)


def test_expert_bias_resets_a_replaced_expert():
    b = ExpertBias(4, 0.1)
    b.bias_E.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    b.reset_expert(1)
    assert b.bias_E.tolist() == pytest.approx([0.3, 0.0, 0.1, 0.0])


def test_activation_checkpointing_counts_each_forward_once():
    """A checkpointed block runs its forward again in backward: the bias counts (and so the update) must equal the
    plain model's, in every balanced router of the routing recipes (FFN-MoE, SSM-MoE, MoEP paths)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
    import tiny

    from moep_ds.config import config_from_dict
    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.balancing import LossFreeBalancing
    from moep_ds.training.blocks import apply_block_options

    cfg = config_from_dict(tiny.recipe("qwen", pathlib.Path("unused"))).model
    torch.manual_seed(0)
    plain = build_model(cfg).train()
    ckpt = build_model(cfg).train()
    ckpt.load_state_dict(plain.state_dict())
    apply_block_options(ckpt, activation_checkpointing=True, compile=False)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    for model in (plain, ckpt):
        model(ids, labels=ids).loss.backward()
    counts_plain, counts_ckpt = LossFreeBalancing(plain).local_counts(), LossFreeBalancing(ckpt).local_counts()
    assert counts_plain.numel() == 3 * 4 and counts_plain.sum() > 0
    assert torch.equal(counts_ckpt, counts_plain)
