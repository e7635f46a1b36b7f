"""StackedExperts: E expert modules as one module with parameters stacked [E, ...]."""
import pytest
import torch
from torch import nn

from moep_ds.moe.stacked import StackedExperts


def experts(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3, bias=False)).double() for _ in range(n)]


def test_each_expert_computes_as_its_own_module_and_gets_its_own_gradient():
    separate = experts(3)
    stacked = StackedExperts(experts(3))  # same seed: the same three experts
    assert {n: tuple(p.shape) for n, p in stacked.named_parameters()} == {
        "expert.0.weight": (3, 6, 4), "expert.0.bias": (3, 6), "expert.1.weight": (3, 6), "expert.1.bias": (3, 6),
        "expert.2.weight": (3, 3, 6)}
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    outs = [stacked.call(p, x[e]) for e, p in enumerate(stacked.per_expert())]
    for e, module in enumerate(separate):
        torch.testing.assert_close(outs[e], module(x[e]))
        torch.testing.assert_close(stacked.expert_module(e)(x[e]), module(x[e]))
    outs[1].sum().backward()  # only expert 1 ran: the others get zero gradient
    grad = stacked.expert[0].weight.grad
    assert grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0


def test_shards_concatenate_to_the_whole_stack():
    """What resharding a checkpoint relies on: rank r's experts are rows [r*L, (r+1)*L) of every tensor."""
    whole = StackedExperts(experts(4))
    shards = [StackedExperts(experts(4)) for _ in range(2)]
    for r, shard in enumerate(shards):
        shard.keep_experts_(2 * r, 2)
        assert shard.num_local_experts == 2 and len(shard.per_expert()) == 2
    for name, p in whole.named_parameters():
        torch.testing.assert_close(torch.cat([s.get_parameter(name) for s in shards]), p)
    with pytest.raises(ValueError, match=r"experts \[2, 4\) are not within the 2 held"):
        shards[0].keep_experts_(2, 2)


def test_experts_with_buffers_are_refused():
    with pytest.raises(ValueError, match="BatchNorm1d has buffers"):
        StackedExperts([nn.BatchNorm1d(3), nn.BatchNorm1d(3)])
