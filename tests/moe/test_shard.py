"""Expert shards built at construction from an explicit plan (moe/plan.py, moe/shard.py): a rank's experts only,
with the unsharded model's values."""
import copy

import pytest
import torch
from torch import nn

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.models.plan import plan_for
from moep_ds.moe.shard import EXPERT_ROWS, normal_

TOP2 = {"type": "topk", "k": 2, "load_balancing_weight": 0.01}
ATTN = {"num_heads": 4}
# every routed stage kind: FFN experts (with biases and without), MSIT branches, MoEP paths and projections
LAYERS = [
    {"type": "ffn_moe", "attention": ATTN,
     "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 24},
             "router": {"type": "expert_choice", "capacity_factor": 1.25, "rounding": "ceil"}}},
    {"type": "msit", "attention": ATTN, "experts": {"d_thin": 16, "num_heads": 2, "windows": [8, 4, 2, 1]}},
    {"type": "ssm_moe", "mixer": {"state_size": 4, "chunk_size": 8},
     "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 24, "bias": True},
             "router": {**TOP2, "lifecycle": {"min_tokens": 64, "check_interval": 3}}}},
    {"type": "paths", "attention": ATTN, "d_path": 16, "num_paths": 4, "num_projection_experts": 4,
     "path_router": TOP2, "projection_router": TOP2},
]


def model_cfg():
    return config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                                       "layers": copy.deepcopy(LAYERS)}}).model


def build(shard: tuple[int, int] | None, registered: list | None = None) -> nn.Module:
    torch.manual_seed(0)
    handle = None
    if registered is not None:
        handle = nn.modules.module.register_module_parameter_registration_hook(
            lambda module, name, p: registered.append(tuple(p.shape)) if p is not None else None)
    try:
        if shard is None:
            return build_model(model_cfg())
        rank, size = shard
        return build_model(model_cfg(), plan=plan_for(model_cfg(), size, rank))
    finally:
        if handle is not None:
            handle.remove()


def stages(model: nn.Module) -> dict[str, ExpertStage]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertStage)}


def test_each_rank_builds_its_experts_with_the_values_of_the_whole_model():
    whole = build(None)
    whole_params = dict(whole.named_parameters())
    assert len(stages(whole)) == 6  # FFN-MoE, MSIT, SSM-MoE; the paths block: contraction, paths, expansion
    for rank in range(2):
        shard = build((rank, 2))
        for name, stage in stages(shard).items():
            assert (stage.first_local_expert, stage.experts.num_local_experts) == (2 * rank, 2), name
        params = dict(shard.named_parameters())
        assert params.keys() == whole_params.keys()
        for name, p in params.items():
            first, total = getattr(p, EXPERT_ROWS, (0, len(p)))
            if name.startswith(tuple(stage + "." for stage in stages(shard))) and total == 4 and len(p) == 2:
                assert first == 2 * rank, name
                torch.testing.assert_close(p, whole_params[name][first:first + 2], rtol=0, atol=0, msg=name)
            else:  # everything else is replicated: the same values on every rank
                torch.testing.assert_close(p, whole_params[name], rtol=0, atol=0, msg=name)
        for (name, b), (_, wb) in zip(shard.named_buffers(), whole.named_buffers()):
            torch.testing.assert_close(b, wb, rtol=0, atol=0, msg=name)
    # and every expert parameter of the whole model was split (none left replicated by mistake)
    expert_names = {n for n, p in whole_params.items() if hasattr(p, EXPERT_ROWS)}
    assert len(expert_names) > 20 and all(len(whole_params[n]) == 4 for n in expert_names)
    assert expert_names == {n for n, p in build((1, 2)).named_parameters() if hasattr(p, EXPERT_ROWS)}


def test_no_parameter_with_every_expert_exists_in_a_sharded_build():
    whole_registered, shard_registered = [], []
    whole = build(None, whole_registered)
    replicated = {tuple(p.shape) for p in whole.parameters() if not hasattr(p, EXPERT_ROWS)}  # e.g. routers' [E, D]
    all_experts = {tuple(p.shape) for p in whole.parameters() if hasattr(p, EXPERT_ROWS)} - replicated
    assert len(all_experts) >= 8 and all_experts <= set(whole_registered)  # the hook sees them when they exist
    build((1, 2), shard_registered)
    assert not all_experts & set(shard_registered)


def test_sharded_normal_is_the_rows_of_the_whole_draw_and_the_shard_is_validated():
    torch.manual_seed(3)
    whole = torch.empty(6, 5, 4).normal_(std=0.5)
    part = nn.Parameter(torch.empty(2, 5, 4))
    setattr(part, EXPERT_ROWS, (4, 6))
    torch.manual_seed(3)
    normal_(part, 0.5)
    assert torch.equal(part.detach(), whole[4:6])


def test_expert_parallel_setup_refuses_a_model_built_for_another_rank():
    from moep_ds.distributed import expert_parallel

    plan = plan_for(model_cfg(), size=2, rank=1)  # rank 1 of 2, no process group
    for model, held in ((build(None), "[0, 4)"), (build((0, 2)), "[0, 2)")):  # every expert; rank 0's
        with pytest.raises(expert_parallel.ParallelLayoutError) as err:
            expert_parallel.setup_expert_parallel(model, plan)
        assert str(err.value) == (f"a routed stage holds experts {held} of 4; expert-parallel rank 1 of 2 needs "
                                  f"[2, 4): build the model with this plan, build_model(cfg, plan=plan)")


def test_a_build_left_to_a_later_initialisation_draws_nothing_over_all_experts(monkeypatch):
    """build_model(initialise=False) (the trainer's, after which it reseeds and initialises; an evaluation's,
    which loads a checkpoint): the stacked experts and routers leave their parameters alone."""
    whole = {tuple(p.shape) for stage in stages(build(None)).values() for p in stage.experts.parameters()}
    drawn = []
    draw = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: drawn.append(tuple(t.shape)) or draw(t, *a, **k))
    for initialise in (True, False):
        drawn.clear()
        model = build_model(model_cfg(), plan=plan_for(model_cfg(), 2, 0), initialise=initialise)
        routers = {tuple(m.weight.shape) for m in model.modules() if type(m).__name__.endswith("Router")}
        if initialise:  # draws over every expert (and the routers' weights), each rank keeping its rows
            assert whole & set(drawn) and routers & set(drawn)
        else:
            assert not whole & set(drawn) and not routers & set(drawn), set(drawn)
