"""Node-aware dispatch (`train.expert_comm.node_aware`) on 4 gloo processes as 2 "nodes" of 2 (LOCAL_WORLD_SIZE 2, as
torchrun sets it; tests/ranks.py per_node, the one test of 4 ranks): a token crosses between nodes once per
destination node, to the peer of its local rank, which fans it out inside the node. The layer output, the input
gradient and every parameter gradient equal the blocking per-expert path's (fp32, 1e-6) for top-k with and without
groups, a shared expert and expert choice (with FP8 rows, those of the flat all-to-all: the peer passes them on
re-rounded to the same e4m3 values); the bytes that cross nodes are those moep-plan predicts
(planning/comm.py node_aware_collectives) where the routing fixes them, and never more than the flat all-to-all's."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
import torch
import torch.distributed as dist

from moep_ds.config import config_from_dict
from moep_ds.distributed.expert_parallel import ParallelLayoutError, check_parallel_layout, node_groups, node_size
from moep_ds.distributed.launcher import ranks_per_node
from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe import all_to_all as a2a
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig
from moep_ds.moe.dispatch import ExpertStage, shard_experts
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.moe.shared import SharedExpertConfig
from moep_ds.planning.comm import link_bytes, node_aware_collectives
from moep_ds.planning.dedup import Choice
from moep_ds.planning.layout import Cluster, Layout
from moep_ds.planning.trace import RoutedStage
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.topk import TopKConfig

from layer_results import assert_same_results
from ranks import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import recipe  # noqa: E402

WORLD, PER_NODE, B, T, D, H = 4, 2, 2, 8, 32, 12
SWIGLU = FFNConfig(type="swiglu", hidden_size=H)
LAYERS = {
    "top2": MoEConfig(num_experts=8, expert=SWIGLU, router=TopKConfig(k=2)),
    # a group per node, one group a token: each token crosses to exactly one node
    "top2_node_groups": MoEConfig(num_experts=8, expert=SWIGLU, router=TopKConfig(
        k=2, score="sigmoid", renormalize=True, num_groups=2, group_topk=1)),
    "top3_of_2_of_4_groups_shared_expert": MoEConfig(
        num_experts=8, expert=SWIGLU, router=TopKConfig(k=3, score="sigmoid", renormalize=True, num_groups=4,
                                                        group_topk=2),
        shared_expert=SharedExpertConfig(hidden_size=H, gate="sigmoid")),
    # every expert takes every token: each token crosses to every node
    "expert_choice_every_token": MoEConfig(num_experts=4, expert=SWIGLU, router=ExpertChoiceConfig(
        scope="sequence", score="softmax_experts", capacity_factor=4.0)),
}
CHOICES = {"top2": Choice(2), "top2_node_groups": Choice(2, 2, 1),
           "top3_of_2_of_4_groups_shared_expert": Choice(3, 4, 2), "expert_choice_every_token": Choice()}


def build(name: str, d_model: int = D) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = MoELayer(LAYERS[name], d_model=d_model)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    return layer


def run(name: str, rank: int, mode: str, fp8: bool = False, d_model: int = D) -> dict:
    """Output, gradients and all-to-all bytes (all, and those to another node) of one forward and backward."""
    layer = build(name, d_model)
    plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
    comm = ExpertCommConfig(dedup=mode != "per_expert", node_aware=None if mode == "nodes" else False, fp8_dispatch=fp8,
                            overlap_chunks=1)  # node-aware legs run in one chunk; flat and per expert alike here
    nodes = node_groups(plan, ranks_per_node()) if mode == "nodes" else None
    for stage in [m for m in layer.modules() if isinstance(m, ExpertStage)]:
        shard_experts(stage, plan)
        stage.set_dispatcher(AllToAllDispatcher(plan, stage.num_experts, comm, nodes))
    gen = torch.Generator().manual_seed(1 + rank)
    x, g = torch.randn(2, B, T, d_model, generator=gen).unbind(0)
    x.requires_grad_()
    between, crossing, original = [0], [0], a2a.all_to_all

    def counted(t, group, out_splits, in_splits, *async_op):
        row = t[:1].numel() * t.element_size()
        nodes = [peer // PER_NODE for peer in dist.get_process_group_ranks(group)]
        if len(set(nodes)) == len(nodes) > 1:  # a group of one rank per node: the leg between nodes
            between[0] += t.numel() * t.element_size()
        crossing[0] += row * sum(n for node, n in zip(nodes, in_splits) if node != rank // PER_NODE)
        return original(t, group, out_splits, in_splits, *async_op)

    a2a.all_to_all = counted
    try:
        out = layer(x)
        (out.y * g).sum().backward()
    finally:
        a2a.all_to_all = original
    return {"y": out.y.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()},
            "between_nodes": between[0], "crossing": crossing[0]}


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment, 2 ranks per node
    rank = dist.get_rank()
    assert ranks_per_node() == PER_NODE
    results = {(name, mode): run(name, rank, mode) for name in LAYERS for mode in ("per_expert", "flat", "nodes")}
    for mode in ("flat", "nodes"):  # FP8 rows (128 wide): the peer passes them on re-rounded to the same e4m3 values
        results["top2_fp8", mode] = run("top2", rank, mode, fp8=True, d_model=128)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def predicted(name: str, assignments: int) -> tuple[float, float]:
    """moep-plan's (bytes sent, bytes between nodes) of one forward and backward of the layer on a rank."""
    layout = Layout(cluster=Cluster(WORLD, PER_NODE), expert_parallel=WORLD, zero_stage=2, precision="fp32",
                    micro_batch=B, grad_accum=1, activation_checkpointing=False, seq_len=T, zero={},
                    expert_node_aware=True)
    stage = RoutedStage("moe", LAYERS[name].num_experts, assignments, D, False, B * T, CHOICES[name])
    collectives = node_aware_collectives(stage, layout)
    return (sum(c.total for c in collectives if "between nodes" in c.what),
            sum(link_bytes(c, layout).inter for c in collectives))


@pytest.mark.slow
def test_node_aware_dispatch_equals_the_per_expert_path_and_moves_the_planned_bytes_between_nodes(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path), per_node=PER_NODE)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    close = dict(rtol=1e-6, atol=1e-6)
    for rank, result in enumerate(results):
        for name in LAYERS:
            assert_same_results(result[name, "nodes"], result[name, "per_expert"], f"{name} rank {rank}")
        # every token to every node: the bytes between nodes the planner predicts, on every rank
        every = result["expert_choice_every_token", "nodes"]
        assert every["crossing"] == predicted("expert_choice_every_token", 4 * B * T)[1], rank
        fp8_flat, fp8_nodes = result["top2_fp8", "flat"], result["top2_fp8", "nodes"]
        for key in ("y", "x_grad"):
            torch.testing.assert_close(fp8_nodes[key], fp8_flat[key], **close, msg=f"fp8 rank {rank} {key}")
    # each token to one node: what the leg between nodes moves, all ranks together (a rank returns the rows its peers
    # sent it, which balanced routing makes its own number)
    one_node = sum(r["top2_node_groups", "nodes"]["between_nodes"] for r in results)
    assert one_node == WORLD * predicted("top2_node_groups", 2 * B * T)[0]
    for name in LAYERS:  # between nodes, all ranks together: once per node < once per rank < once per expert
        crossing = {mode: sum(r[name, mode]["crossing"] for r in results) for mode in ("per_expert", "flat", "nodes")}
        assert crossing["nodes"] < crossing["per_expert"], (name, crossing)
        assert crossing["nodes"] <= crossing["flat"], (name, crossing)


def tiny(layers: str, ep: int, **comm):
    raw = recipe(layers, pathlib.Path("/nonexistent"), expert_parallel_size=ep, expert_comm=comm)
    return config_from_dict(raw)


ZERO2 = {"zero_optimization": {"stage": 2}}


def test_node_aware_dispatch_is_on_where_the_group_spans_nodes_and_refused_in_one_line_where_it_cannot_apply():
    assert ExpertCommConfig().node_aware is None  # on wherever it applies
    assert node_size(ExpertCommConfig(), 4, 8, 2) == 2  # 4 ranks on 2 nodes of 2
    assert node_size(ExpertCommConfig(), 2, 8, 2) is None  # the group on one node
    assert node_size(ExpertCommConfig(), 4, 4, None) is None  # no launcher says: one node
    assert node_size(ExpertCommConfig(node_aware=False), 4, 8, 2) is None
    assert node_size(ExpertCommConfig(dedup=False), 4, 8, 2) is None  # the blocking per-expert path
    check_parallel_layout(tiny("deepseek", 4), ZERO2, 8, 2)  # 4 groups on 2 nodes
    with pytest.raises(ParallelLayoutError, match=r"^train\.expert_comm\.node_aware \(true\) needs expert parallelism "
                                                  r"across nodes: train\.expert_parallel_size \(2\) fits on one node "
                                                  r"of 4 ranks$"):
        check_parallel_layout(tiny("top2", 2, node_aware=True), ZERO2, 8, 4)
    with pytest.raises(ParallelLayoutError, match=r"^train\.expert_comm\.node_aware \(true\) needs "
                                                  r"train\.expert_comm\.dedup \(false\)"):
        check_parallel_layout(tiny("top2", 4, node_aware=True, dedup=False), ZERO2, 4, 2)
    with pytest.raises(ParallelLayoutError, match=r"^model\.layers\[1\]\.moe\.router\.num_groups \(4\) must be a "
                                                  r"multiple of the 8 nodes expert parallelism spans \(8 ranks, 1 per "
                                                  r"node\): node-aware dispatch places each group on one node; or set "
                                                  r"train\.expert_comm\.node_aware false$"):
        check_parallel_layout(tiny("deepseek", 8), ZERO2, 8, 1)
    check_parallel_layout(tiny("deepseek", 8, node_aware=False), ZERO2, 8, 1)


def test_moep_plan_refuses_node_aware_dispatch_on_one_node_in_one_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe("top2", tmp_path / "run", expert_parallel_size=2)))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ZERO2))
    done = subprocess.run([sys.executable, "-m", "moep_ds.cli.plan", str(path), "--ds_config", str(ds), "--gpus", "4",
                           "--gpus_per_node", "4", "--set", "train.expert_comm.node_aware=true"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("error: train.expert_comm.node_aware (true) needs expert parallelism across nodes: "
                           "train.expert_parallel_size (2) fits on one node of 4 ranks\n")
