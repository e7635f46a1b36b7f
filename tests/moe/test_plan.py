"""The expert-parallel plan (moe/plan.py, models/plan.py): validated once with one-line errors naming the recipe
field and value, passed explicitly to build_model, and the only carrier of which experts a process builds."""
import copy

import pytest
import torch

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.models.plan import plan_for, routed_stages
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan, RoutedStage
from moep_ds.schema import ConfigError

TOP2 = {"type": "topk", "k": 2}
ATTN = {"num_heads": 4}
LAYERS = [
    {"type": "dense", "attention": ATTN},
    {"type": "ffn_moe", "attention": ATTN, "repeat": 2,
     "moe": {"num_experts": 8, "expert": {"type": "swiglu", "hidden_size": 16}, "router": TOP2}},
    {"type": "msit", "attention": ATTN, "experts": {"d_thin": 16, "num_heads": 2, "windows": [8, 4, 2, 1]}},
    {"type": "paths", "attention": ATTN, "d_path": 16, "num_paths": 4, "num_projection_experts": 2,
     "path_router": TOP2, "projection_router": {"type": "topk", "k": 1}},
]


def model_cfg(layers=None):
    return config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                                       "layers": copy.deepcopy(layers or LAYERS)}}).model


def test_the_plan_lists_every_routed_stage_by_its_recipe_field():
    assert routed_stages(model_cfg()) == (
        RoutedStage("model.layers[1].moe.num_experts", 8, 8),
        RoutedStage("model.layers[2].experts.windows", [8, 4, 2, 1], 4, note="one expert per window"),
        RoutedStage("model.layers[3].num_paths", 4, 4),
        RoutedStage("model.layers[3].num_projection_experts", 2, 2),
    )
    plan = plan_for(model_cfg(), size=2, rank=1)
    assert plan.local_experts == {"model.layers[1].moe.num_experts": range(4, 8),
                                  "model.layers[2].experts.windows": range(2, 4),
                                  "model.layers[3].num_paths": range(2, 4),
                                  "model.layers[3].num_projection_experts": range(1, 2)}
    assert plan.held(8) == range(4, 8) and SINGLE_PROCESS.held(8) == range(0, 8)


@pytest.mark.parametrize("size, rank, layers, message", [
    (4, 0, None, "model.layers[3].num_projection_experts (2) must be divisible by expert_parallel_size (4)"),
    (3, 0, None, "model.layers[1].moe.num_experts (8) must be divisible by expert_parallel_size (3)"),
    (8, 0, LAYERS[2:3], "model.layers[0].experts.windows ([8, 4, 2, 1]) must have a length divisible by "
                        "expert_parallel_size (8): one expert per window"),
    (2, 0, LAYERS[:1], "train.expert_parallel_size (2) must be 1: the model has no routed experts to shard"),
    (0, 0, None, "train.expert_parallel_size (0) must be an integer >= 1"),
    (2, 2, None, "expert-parallel rank (2) must be in [0, 2)"),
    (2, -1, None, "expert-parallel rank (-1) must be in [0, 2)"),
])
def test_the_plan_is_validated_once_with_one_line_errors(size, rank, layers, message):
    with pytest.raises(ConfigError) as err:
        plan_for(model_cfg(layers), size, rank)
    assert str(err.value) == message


def test_the_recipe_is_checked_by_the_same_plan():
    raw = {"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                     "layers": copy.deepcopy(LAYERS)}, "train": {"expert_parallel_size": 4}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value) == "model.layers[3].num_projection_experts (2) must be divisible by expert_parallel_size (4)"


def test_a_model_built_with_an_explicit_plan_holds_the_plans_experts():
    torch.manual_seed(0)
    whole = build_model(model_cfg())
    for rank in range(2):
        plan = plan_for(model_cfg(), size=2, rank=rank)
        torch.manual_seed(0)
        model = build_model(model_cfg(), plan=plan)
        held = {name: (m.first_local_expert, m.experts.num_local_experts, m.num_experts)
                for name, m in model.named_modules() if isinstance(m, ExpertStage)}
        assert held == {"blocks.1.moe": (4 * rank, 4, 8), "blocks.2.moe": (4 * rank, 4, 8),  # repeat: 2 layers
                        "blocks.3.experts": (2 * rank, 2, 4),
                        "blocks.4.contract": (rank, 1, 2), "blocks.4.paths": (2 * rank, 2, 4),
                        "blocks.4.expand": (rank, 1, 2)}
        w1 = model.blocks[1].moe.experts.w1_EDF
        torch.testing.assert_close(w1, whole.blocks[1].moe.experts.w1_EDF[4 * rank:4 * rank + 4], rtol=0, atol=0)
        assert model.blocks[3].experts.windows[model.blocks[3].experts.held()] == [[8, 4], [2, 1]][rank]


def test_build_model_refuses_a_plan_made_for_another_model():
    other = plan_for(model_cfg(LAYERS[1:2]), size=2)
    with pytest.raises(ValueError, match=r"^the expert-parallel plan \(size 2\) was not made for this model's routed"):
        build_model(model_cfg(), plan=other)
    with pytest.raises(ValueError, match=r"was not made for this model's routed stages"):
        build_model(model_cfg(), plan=ExpertParallelPlan(size=2))  # a plan of no model


def test_the_plan_is_a_frozen_value():
    plan = plan_for(model_cfg(), size=2, rank=1)
    with pytest.raises(AttributeError):
        plan.rank = 0
    assert plan == plan_for(model_cfg(), size=2, rank=1, group=object())  # the group is not part of its value
