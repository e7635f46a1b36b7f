"""Dispatch once per destination rank (`ExpertCommConfig.dedup`) on 2 gloo processes: a token whose experts share a
rank crosses once and that rank returns one weighted sum, with the layer output, the input gradient and every
parameter gradient (router included: its weights travel) of the blocking per-expert path (fp32, 1e-6), fewer bytes
on the wire where a token's experts share a rank, and each expert seeing the same tokens in the same order."""
import os
import pathlib

import pytest
import torch
import torch.distributed as dist

from moep_ds.blocks.msit import MSITBlock, MSITBlockConfig, MSITExpertConfig
from moep_ds.config import load_config
from moep_ds.layers.attention import AttentionConfig
from moep_ds.layers.ffn import FFNConfig
from moep_ds.layers.rope import RopeConfig
from moep_ds.moe import all_to_all as a2a
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig, rank_pairs
from moep_ds.moe.dispatch import ExpertStage, in_token_order, shard_experts
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.moe.shared import SharedExpertConfig
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.plan import RoutingPlan
from moep_ds.routing.topk import TopKConfig
from moep_ds.schema import ConfigError

from layer_results import assert_same_results
from ranks import run_ranks

WORLD, B, T, D, H = 2, 3, 8, 32, 12  # B sequences per rank; rows of D fp32 outweigh the 16 bytes an assignment adds
SWIGLU = FFNConfig(type="swiglu", hidden_size=H)
LAYERS = {
    "top2": MoEConfig(num_experts=8, expert=SWIGLU, router=TopKConfig(k=2)),
    "top3_renormalised": MoEConfig(num_experts=4, expert=SWIGLU, router=TopKConfig(k=3, renormalize=True)),
    "top4_of_2_groups": MoEConfig(num_experts=8, expert=SWIGLU, router=TopKConfig(
        k=4, score="sigmoid", renormalize=True, num_groups=4, group_topk=2)),
    "top2_shared_expert": MoEConfig(num_experts=4, expert=SWIGLU, router=TopKConfig(k=2),
                                    shared_expert=SharedExpertConfig(hidden_size=H, gate="sigmoid")),
    "expert_choice": MoEConfig(num_experts=4, expert=SWIGLU, router=ExpertChoiceConfig(
        scope="sequence", score="softmax_experts", capacity_factor=2.0)),
}
BLOCKS = ["msit", *LAYERS]
QUICKSTART = pathlib.Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "msit":
        cfg = MSITBlockConfig(attention=AttentionConfig(num_heads=2, rope=RopeConfig()),
                              router=ExpertChoiceConfig(capacity_factor=2.0, scope="sequence"),
                              experts=MSITExpertConfig(d_thin=12, num_heads=2, windows=[3, 1, 5, 2]))
        return MSITBlock(cfg, d_model=D, layer_idx=0)
    layer = MoELayer(LAYERS[name], d_model=D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    return layer


def run(name: str, rank: int, dedup: bool) -> dict:
    """Output, gradients and all-to-all bytes of this rank's share of one forward and backward."""
    block = build(name)
    plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
    for stage in [m for m in block.modules() if isinstance(m, ExpertStage)]:
        shard_experts(stage, plan)
        stage.set_dispatcher(AllToAllDispatcher(plan, stage.num_experts, ExpertCommConfig(dedup=dedup)))
    gen = torch.Generator().manual_seed(1 + rank)
    x, g = torch.randn(2, B, T, D, generator=gen).unbind(0)
    x.requires_grad_()
    sent = []
    original = a2a.all_to_all

    def counted(t, group, out_splits, in_splits, *async_op):
        sent.append(t.numel() * t.element_size())
        return original(t, group, out_splits, in_splits, *async_op)

    a2a.all_to_all = counted
    try:
        out = block(x, positions_BT=torch.arange(T).expand(B, T)) if name == "msit" else block(x)
        y = out.x if name == "msit" else out.y
        (y * g).sum().backward()
    finally:
        a2a.all_to_all = original
    return {"y": y.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in block.named_parameters()},
            "bytes": sum(sent)}


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment
    rank = dist.get_rank()
    results = {(name, dedup): run(name, rank, dedup) for name in BLOCKS for dedup in (False, True)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_dedup_equals_the_per_expert_path_with_fewer_bytes(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path))
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in BLOCKS:
            ref, got = results[name, False], results[name, True]
            assert_same_results(got, ref, f"{name} rank {rank}")
            # top-3 of 4 experts on 2 ranks always shares a rank; the others do for some tokens here
            assert got["bytes"] < ref["bytes"], (name, rank, got["bytes"], ref["bytes"])


def test_rank_pairs_name_each_token_once_per_destination_rank():
    # 4 tokens, 4 experts on 2 ranks (experts 0-1 on rank 0): expert 0 <- t2 t0, expert 1 <- t0 t3,
    # expert 2 <- t1, expert 3 <- t1 t0
    plan = RoutingPlan(token_idx_S=torch.tensor([2, 0, 0, 3, 1, 1, 0]), weight_S=torch.ones(7),
                       counts_E=torch.tensor([2, 2, 1, 2]), num_tokens=4)
    token_P, pairs_R, slot_S = rank_pairs(plan, 2)
    assert token_P.tolist() == [0, 2, 3, 0, 1]  # rank 0: t0 t2 t3; rank 1: t0 t1
    assert pairs_R.tolist() == [3, 2]
    assert slot_S.tolist() == [1, 0, 0, 2, 1, 1, 0]  # each assignment's row among those sent to its rank
    first = torch.tensor([0, 0, 0, 0, 3, 3, 3])
    assert torch.equal(token_P[slot_S + first], plan.token_idx_S)
    assert torch.equal(rank_pairs(in_token_order(plan), 2)[0], token_P)


def test_the_option_is_a_recipe_field_checked_before_anything_is_built():
    assert load_config(QUICKSTART).train.expert_comm.dedup is True
    off = load_config(QUICKSTART, ["train.expert_comm.dedup=false"])
    assert off.train.expert_comm == ExpertCommConfig(dedup=False)
    with pytest.raises(ConfigError, match=r"^train\.expert_comm\.dedup \(3\) must be true or false$"):
        load_config(QUICKSTART, ["train.expert_comm.dedup=3"])
    with pytest.raises(ConfigError, match=r"^train\.expert_comm\.dedupe: unknown key"):
        load_config(QUICKSTART, ["train.expert_comm.dedupe=false"])
