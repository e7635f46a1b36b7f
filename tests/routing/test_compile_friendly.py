"""Routing code that torch.compile traces without graph breaks: capacities in integers, counts of fixed size."""
from fractions import Fraction
import math

import pytest
import torch

from moep_ds.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter, expert_choice_capacity
from moep_ds.routing.lifecycle import LifecycleConfig
from moep_ds.routing.plan import expert_counts, round_ratio
from moep_ds.routing.topk import TopKConfig, TopKRouter


def test_integer_rounding_equals_fraction_rounding():
    for p in range(1, 60):
        for q in range(1, 25):
            exact = Fraction(p, q)
            assert round_ratio(p, q, "ceil") == math.ceil(exact), (p, q)
            assert round_ratio(p, q, "nearest") == math.floor(exact + Fraction(1, 2)), (p, q)
    with pytest.raises(ValueError, match=r"^rounding \('up'\) must be 'nearest' or 'ceil'$"):
        round_ratio(1, 2, "up")


def test_capacity_of_decimal_factors_is_exact():
    assert expert_choice_capacity(100, 10, 1.1, "ceil") == 11  # 1.1 * 100 / 10 is 11.000000000000002 in floats
    assert expert_choice_capacity(20, 8, 1.0, "nearest") == 3  # 2.5 rounds half up


def test_expert_counts_equal_bincount():
    g = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 5, (37, 2), generator=g)
    assert torch.equal(expert_counts(experts, 7), torch.bincount(experts.reshape(-1), minlength=7))
    assert expert_counts(experts, 7).dtype == torch.int64


def break_reasons(module, x):
    """Why torch.compile splits module(x), with the token count symbolic (as after a recompilation for a new
    batch shape, or inside a block whose routed subsets vary)."""
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 1)
    return [str(r.reason).splitlines()[0] for r in torch._dynamo.explain(module)(x).break_reasons]


def test_dropless_topk_router_compiles_without_graph_breaks():
    router = TopKRouter(TopKConfig(k=2, load_balancing_weight=0.01, z_loss_weight=0.001), d_model=8,
                        num_experts=4).train()
    assert break_reasons(router, torch.randn(2, 16, 8)) == []


def test_expert_choice_router_compiles_with_its_statistics_update():
    """The threshold update is in the graph (gated by the recording flag, a tensor), and applied once per call."""
    router = ExpertChoiceRouter(ExpertChoiceConfig(capacity_factor=1.25, rounding="ceil"), d_model=8,
                                num_experts=4).train()
    assert break_reasons(router, torch.randn(2, 16, 8)) == []
    assert router.num_threshold_updates.item() == 1 and router.threshold.abs().sum() > 0


def test_lifecycle_router_compiles_with_its_token_count():
    router = TopKRouter(TopKConfig(k=2, lifecycle=LifecycleConfig(min_tokens=4)), d_model=8, num_experts=4).train()
    assert break_reasons(router, torch.randn(2, 16, 8)) == []
    assert router.lifecycle.step_sums[:4].sum().item() == 2 * 16 * 2
