"""Node-aware dispatch (`train.expert_comm.node_aware`) on 4 gloo processes as 2 "nodes" of 2 (LOCAL_WORLD_SIZE 2, as
torchrun sets it; tests/ranks.py per_node, the one test of 4 ranks): a token crosses between nodes once per
destination node, to the peer of its local rank, which fans it out inside the node. In one chunk (blocking) and in 2
and 3 overlapped chunks (`overlap_chunks`) the layer output, the input gradient and every parameter gradient equal the
blocking per-expert path's (fp32, 1e-6; in chunks a weight's gradient sums its rows in another order) for top-k with
and without groups, a shared expert and expert choice (with FP8 rows, those of the flat all-to-all in as many chunks:
the peer passes them on re-rounded to the same e4m3 values); in chunks one blocking all-to-all (every chunk's counts
between nodes), the blocking path's rows, and an all-to-all in flight whenever experts compute and while the shared
expert does; the bytes of each leg, count exchanges included, are those moep-plan predicts (planning/comm.py
node_aware_collectives) where the routing fixes them (in 3 chunks up to its rounding of the mean chunk), and in one
chunk never more between nodes than the flat all-to-all's."""
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
from test_all_to_all_overlap import Logged, in_flight_at

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


# mode: (dispatch, train.expert_comm.overlap_chunks); node-aware in 1 chunk runs its legs blocking, in 2 and 3
# overlapped (the flat all-to-all in 2 and 3 chunks for FP8's comparison)
MODES = {"per_expert": ("per_expert", 1), "flat": ("flat", 1), "nodes": ("nodes", 1), "nodes_2": ("nodes", 2),
         "nodes_3": ("nodes", 3), "flat_2": ("flat", 2), "flat_3": ("flat", 3)}
NODE_MODES = ("nodes", "nodes_2", "nodes_3")


def run(name: str, rank: int, mode: str, fp8: bool = False, d_model: int = D) -> dict:
    """Output, gradients and all-to-all bytes (all, and those to another node) of one forward and backward, and the
    order of the all-to-alls and the compute (tests/moe/test_all_to_all_overlap.py)."""
    layer = build(name, d_model)
    route, chunks = MODES[mode]
    plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
    comm = ExpertCommConfig(dedup=route != "per_expert", node_aware=None if route == "nodes" else False,
                            fp8_dispatch=fp8, overlap_chunks=chunks)
    nodes = node_groups(plan, ranks_per_node()) if route == "nodes" else None
    events = []
    for stage in [m for m in layer.modules() if isinstance(m, ExpertStage)]:
        shard_experts(stage, plan)
        stage.set_dispatcher(AllToAllDispatcher(plan, stage.num_experts, comm, nodes))
        stage.run_experts = logged_experts(stage.run_experts, events)
    if layer.shared is not None:
        layer.shared.ffn.register_forward_hook(lambda *_: events.append(("shared", 0)))
    gen = torch.Generator().manual_seed(1 + rank)
    x, g = torch.randn(2, B, T, d_model, generator=gen).unbind(0)
    x.requires_grad_()
    between, inside, crossing, original = [0], [0], [0], a2a.all_to_all

    def counted(t, group, out_splits, in_splits, async_op=False):
        row = t[:1].numel() * t.element_size()
        nodes = [peer // PER_NODE for peer in dist.get_process_group_ranks(group)]
        if len(set(nodes)) == len(nodes) > 1:  # a group of one rank per node: the leg between nodes
            between[0] += t.numel() * t.element_size()
        elif len(set(nodes)) == 1 < len(nodes):  # the ranks of one node: the leg inside it
            inside[0] += t.numel() * t.element_size()
        crossing[0] += row * sum(n for node, n in zip(nodes, in_splits) if node != rank // PER_NODE)
        events.append(("issue" if async_op else "blocking", t.numel() * t.element_size()))
        if not async_op:
            return original(t, group, out_splits, in_splits)
        out, work = original(t, group, out_splits, in_splits, True)
        return out, Logged(work, events)

    a2a.all_to_all = counted
    try:
        out = layer(x)
        forward = len(events)
        (out.y * g).sum().backward()
    finally:
        a2a.all_to_all = original
    return {"y": out.y.detach(), "x_grad": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()},
            "between_nodes": between[0], "inside_the_node": inside[0], "crossing": crossing[0],
            "forward": events[:forward], "backward": events[forward:]}


def logged_experts(run_experts, events: list):
    def logged(batch):
        events.append(("experts", batch.x_SD.shape[0]))
        y_SD = run_experts(batch)
        y_SD.register_hook(lambda grad: events.append(("experts_backward", grad.shape[0])))
        return y_SD

    return logged


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment, 2 ranks per node
    rank = dist.get_rank()
    assert ranks_per_node() == PER_NODE
    results = {(name, mode): run(name, rank, mode) for name in LAYERS for mode in MODES if mode[:5] != "flat_"}
    for mode in MODES:  # FP8 rows (128 wide): the peer passes them on re-rounded to the same e4m3 values
        if mode != "per_expert":
            results["top2_fp8", mode] = run("top2", rank, mode, fp8=True, d_model=128)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def predicted(name: str, assignments: int, chunks: int = 1) -> tuple[float, float, float]:
    """moep-plan's (bytes sent between nodes, bytes between nodes, bytes sent inside the node) of one forward and
    backward of the layer on a rank."""
    layout = Layout(cluster=Cluster(WORLD, PER_NODE), expert_parallel=WORLD, zero_stage=2, precision="fp32",
                    micro_batch=B, grad_accum=1, activation_checkpointing=False, seq_len=T, zero={},
                    expert_node_aware=True, expert_overlap_chunks=chunks)
    stage = RoutedStage("moe", LAYERS[name].num_experts, assignments, D, False, B * T, CHOICES[name])
    collectives = node_aware_collectives(stage, layout)
    return (sum(c.total for c in collectives if "between nodes" in c.what),
            sum(link_bytes(c, layout).inter for c in collectives),
            sum(c.total for c in collectives if "inside the node" in c.what))


@pytest.mark.slow
def test_node_aware_dispatch_equals_the_per_expert_path_and_moves_the_planned_bytes_between_nodes(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path), per_node=PER_NODE)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    close = dict(rtol=1e-6, atol=1e-6)
    for rank, result in enumerate(results):
        for name in LAYERS:
            for mode in NODE_MODES:
                # in chunks a weight's gradient sums its rows in another order: 1e-6 of its largest value (measured:
                # 3.1e-7 at most)
                assert_same_results(result[name, mode], result[name, "per_expert"], f"{name} {mode} rank {rank}",
                                    reordered=mode != "nodes")
                check_schedule(result[name, mode], result[name, "nodes"], MODES[mode][1], f"{name} {mode} {rank}")
        for mode in NODE_MODES:
            # every token to every rank: the bytes the planner predicts on each leg, every collective and count
            # exchange, on every rank (3 chunks: of 16 tokens, 5, 5 and 6; the planner's mean chunk rounded)
            every = result["expert_choice_every_token", mode]
            planned = predicted("expert_choice_every_token", 4 * B * T, MODES[mode][1])
            counted = (every["between_nodes"], every["crossing"], every["inside_the_node"])
            if MODES[mode][1] < 3:
                assert counted == planned, (mode, rank)
            else:
                assert counted == pytest.approx(planned, rel=1e-3), (mode, rank)  # measured: 5 bytes of 17,648
            # FP8: the flat all-to-all's results in as many chunks (its experts see the same rows)
            fp8_flat = result["top2_fp8", mode.replace("nodes", "flat")]
            for key in ("y", "x_grad"):
                torch.testing.assert_close(result["top2_fp8", mode][key], fp8_flat[key], **close,
                                           msg=f"fp8 {mode} rank {rank} {key}")
    # each token to one node: what the leg between nodes moves, all ranks together (a rank returns the rows its peers
    # sent it, which balanced routing makes its own number)
    for mode in ("nodes", "nodes_2"):
        one_node = sum(r["top2_node_groups", mode]["between_nodes"] for r in results)
        assert one_node == WORLD * predicted("top2_node_groups", 2 * B * T, MODES[mode][1])[0], mode
    for name in LAYERS:  # between nodes, all ranks together: once per node < once per rank < once per expert
        crossing = {mode: sum(r[name, mode]["crossing"] for r in results) for mode in ("per_expert", "flat", "nodes")}
        assert crossing["nodes"] < crossing["per_expert"], (name, crossing)
        assert crossing["nodes"] <= crossing["flat"], (name, crossing)


def check_schedule(got: dict, blocking: dict, chunks: int, what: str) -> None:
    """Node-aware dispatch in one chunk: each hop's counts blocking, its rows, weights, ints and positions issued
    together and waited for before anything computes: nothing in flight while the experts or the shared expert
    compute, forward or backward. In C chunks: one blocking all-to-all (the counts between nodes of every chunk), the
    counts inside the node issued next, the rows' bytes of the one-chunk path, both ways, and an all-to-all in flight
    whenever a chunk's experts compute, forward and backward, and while the shared expert does."""
    fwd, bwd = got["forward"], got["backward"]
    if chunks == 1:
        assert [kind for kind, _ in fwd if kind in ("blocking", "issue")][:2] == ["blocking", "issue"], what
        assert in_flight_at(fwd, "experts") and in_flight_at(bwd, "experts_backward"), what
        for events, compute in ((fwd, "experts"), (fwd, "shared"), (bwd, "experts_backward")):
            assert set(in_flight_at(events, compute)) <= {0}, (what, compute)
        assert {kind for kind, _ in bwd} <= {"issue", "wait", "experts_backward"}, what
        return
    kinds = [kind for kind, _ in fwd]
    assert kinds.count("blocking") == 1 and kinds[0] == "blocking" and kinds[1] == "issue", what
    issued = [n for kind, n in fwd if kind == "issue"]
    one_chunk = [(kind, n) for kind, n in blocking["forward"] if kind in ("blocking", "issue")]
    counts = [n for kind, n in one_chunk if kind == "blocking"]  # each hop's count exchange
    assert len(counts) == 2, what
    assert sum(issued[1:]) == sum(n for _, n in one_chunk) - sum(counts), what
    assert {kind for kind, _ in bwd} == {"issue", "wait", "experts_backward"}, what
    assert sum(n for kind, n in bwd if kind == "issue") == sum(
        n for kind, n in blocking["backward"] if kind == "issue") > 0, what
    for flying in (in_flight_at(fwd, "experts"), in_flight_at(bwd, "experts_backward")):
        assert len(flying) == chunks and all(n > 0 for n in flying), (what, flying)
    assert all(n > 0 for n in in_flight_at(fwd, "shared")), what


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
