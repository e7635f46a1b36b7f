"""moep-plan's model of dispatch once per destination rank (train.expert_comm.dedup): the expected distinct
(token, rank) pairs under balanced routing equal the average over every balanced routing (enumerated), the
topk_group bound holds, and the all-to-all bytes of a layout are the per-expert ones with pairs for assignments
(what tests/planning/test_plan_comm.py counts on 2 processes). No new constant: the same assumptions, less time."""
import itertools
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import recipe  # noqa: E402

from moep_ds.config import config_from_dict  # noqa: E402
from moep_ds.planning.comm import link_bytes  # noqa: E402
from moep_ds.planning.dedup import Choice, expected_pairs, nodes_per_token, ranks_per_token  # noqa: E402
from moep_ds.planning.hardware import assumptions, hardware  # noqa: E402
from moep_ds.planning.layout import Cluster  # noqa: E402
from moep_ds.planning.plan import plan_run  # noqa: E402


def enumerated_ranks_per_token(E, R, k, G=1, M=1):
    """Every choice of M groups, then of k of their experts, alike: the mean number of ranks touched."""
    g, L, total, count = E // G, E // R, 0, 0
    for groups in itertools.combinations(range(G), M):
        allowed = [e for j in groups for e in range(j * g, (j + 1) * g)]
        for experts in itertools.combinations(allowed, k):
            total += len({e // L for e in experts})
            count += 1
    return total / count


@pytest.mark.parametrize("E, R, k, G, M", [
    (8, 2, 2, 1, 1), (8, 4, 3, 1, 1), (16, 4, 4, 1, 1), (6, 3, 2, 1, 1), (4, 2, 1, 1, 1),
    (8, 2, 2, 2, 1), (8, 4, 4, 4, 2), (16, 4, 4, 8, 3), (16, 8, 4, 4, 2), (12, 4, 3, 3, 2), (12, 2, 4, 6, 2),
])
def test_expected_ranks_per_token_is_the_mean_over_every_balanced_routing(E, R, k, G, M):
    assert ranks_per_token(Choice(k, G, M), E, R) == pytest.approx(enumerated_ranks_per_token(E, R, k, G, M), 1e-12)


def test_groups_placed_one_per_rank_bound_the_ranks_a_token_reaches():
    for M in (1, 2, 3):  # DeepSeek-V3's node-limited routing on ranks: at most topk_group ranks
        assert ranks_per_token(Choice(8, 8, M), 64, 8) <= M
    assert ranks_per_token(Choice(2, 2, 1), 4, 2) == 1
    assert ranks_per_token(Choice(4), 4, 2) == 2  # every expert: every rank


def test_expert_choice_pairs_are_the_mean_over_every_balanced_selection():
    T, E, R, capacity = 4, 4, 2, 2  # each expert takes any 2 of the 4 tokens alike, independently
    L, total, count = E // R, 0, 0
    for picks in itertools.product(itertools.combinations(range(T), capacity), repeat=E):
        total += len({(t, e // L) for e, pick in enumerate(picks) for t in pick})
        count += 1
    assert expected_pairs(Choice(), T, E * capacity, E, R) == pytest.approx(total / count, 1e-12)
    assert count == math.comb(T, capacity) ** E


def routed_plan(layers, expert_comm, overrides=(), layer=0, expert_parallel=2, gpus=4):
    """moep-plan of a tiny recipe under ZeRO-2 on `gpus` H100s of 2 a node, with `overrides` of layer `layer`'s
    router."""
    raw = recipe(layers, pathlib.Path("/nonexistent"), expert_parallel_size=expert_parallel, expert_comm=expert_comm)
    for path, value in overrides:
        raw["model"]["layers"][layer]["moe"]["router"][path] = value
    return plan_run(config_from_dict(raw), {"zero_optimization": {"stage": 2}}, Cluster(gpus, 2), hardware("h100"),
                    assumptions())


def plan(dedup, layers="top2", overrides=(), chunks=1):
    return routed_plan(layers, {"dedup": dedup, "overlap_chunks": chunks}, overrides)


def test_dedup_moves_the_pairs_of_a_routing_and_its_weights_instead_of_a_row_per_assignment():
    per_expert, once = plan(False), plan(True)
    rows = {c.what: c for c in per_expert.comm.collectives if c.kind == "all_to_all"}
    pairs = {c.what: c for c in once.comm.collectives if c.kind == "all_to_all"}
    tokens = rows["blocks.0.moe: tokens to experts and back"]
    S = 4 * 32 * 2  # micro-batch 4 x 32 tokens, top-2
    assert tokens.bytes == S * 32 * 4  # d_model 32, fp32
    deduped = pairs["blocks.0.moe: tokens to experts and back"]
    assert deduped.bytes == round(S / 2 * (2 - 1 / 3) * 32 * 4) and deduped.calls == tokens.calls  # 5/3 ranks a token
    assert pairs["blocks.0.moe: combine weights"].bytes == 4 * S
    assert pairs["blocks.0.moe: rows of the assignments"].bytes == 8 * S
    assert pairs["blocks.0.moe: expert counts and pairs per rank"].bytes == 8 * (4 + 2)
    assert once.comm.by_kind()["all_to_all"] < per_expert.comm.by_kind()["all_to_all"]
    assert once.assumed == per_expert.assumed and once.time.compute_s == per_expert.time.compute_s
    assert once.time.step_s < per_expert.time.step_s
    grouped = plan(True, overrides=[("num_groups", 2), ("group_topk", 1)])
    assert {c.what: c.bytes for c in grouped.comm.collectives}[
        "blocks.0.moe: tokens to experts and back"] == S / 2 * 32 * 4  # one rank a token


def enumerated_nodes_per_token(E, N, k, G=1, M=1):
    """Every choice of M groups, then of k of their experts, alike: the mean number of nodes touched (E/N experts a
    node, in order)."""
    return enumerated_ranks_per_token(E, N, k, G, M)


@pytest.mark.parametrize("E, N, k, G, M", [
    (8, 2, 2, 1, 1), (16, 4, 4, 1, 1), (8, 2, 2, 2, 1), (16, 2, 4, 4, 2), (16, 4, 4, 8, 3), (12, 3, 3, 6, 2),
])
def test_expected_nodes_per_token_is_the_mean_over_every_balanced_routing(E, N, k, G, M):
    assert nodes_per_token(Choice(k, G, M), E, N) == pytest.approx(enumerated_nodes_per_token(E, N, k, G, M), 1e-12)


def test_groups_placed_whole_on_nodes_bound_the_nodes_a_token_reaches():
    # DeepSeek-V3: 256 experts in 8 groups on 8 nodes, 4 groups a token: at most 4 of the 8 nodes, fewer than
    # the 8 routed experts' ranks
    assert 3.5 < nodes_per_token(Choice(8, 8, 4), 256, 8) <= 4
    assert ranks_per_token(Choice(8, 8, 4), 256, 64) > 7
    for G in (4, 8):  # two groups a node, or one
        assert nodes_per_token(Choice(2, G, 1), 16, 4) == pytest.approx(1, abs=1e-12)
    assert nodes_per_token(Choice(2, 2, 1), 16, 4) > 1  # a group over two nodes: check_node_layout refuses it


def node_plan(node_aware, overrides=(), chunks=1):
    return routed_plan("deepseek", {"node_aware": node_aware, "overlap_chunks": chunks}, overrides, layer=1,
                       expert_parallel=4, gpus=8)


def test_node_aware_dispatch_moves_the_node_pairs_between_nodes_and_the_rank_pairs_inside():
    on, flat = node_plan(None), node_plan(False)
    assert on.layout.expert_node_aware and not flat.layout.expert_node_aware
    between = {c.what: c for c in on.comm.collectives if "(between nodes)" in c.what}
    inside = {c.what: c for c in on.comm.collectives if "(inside the node)" in c.what}
    T, S, D = 4 * 32, 4 * 32 * 2, 32  # micro-batch 4 x 32 tokens, top-2 of 8 experts in 4 groups, 2 a token
    rows = between["blocks.1.moe (between nodes): tokens to experts and back"]
    assert rows.group == 2 and rows.calls == 4
    assert rows.bytes == round(T * nodes_per_token(Choice(2, 4, 2), 8, 2) * D * 4)
    assert inside["blocks.1.moe (inside the node): tokens to experts and back"].bytes == round(
        T * ranks_per_token(Choice(2, 4, 2), 8, 4) * D * 4)
    assert between["blocks.1.moe (between nodes): counts"].bytes == 8 * 2 * 2
    assert inside["blocks.1.moe (inside the node): counts"].bytes == 8 * (2 + 2) * 2  # 2 experts a rank
    for c in [*between.values(), *inside.values()]:
        if "weights" in c.what:
            assert c.bytes == 4 * S
        if "assignments" in c.what:
            assert c.bytes == 8 * S
    links = {name: [link_bytes(c, p.layout) for c in p.comm.collectives if c.kind == "all_to_all"]
             for name, p in (("on", on), ("flat", flat))}
    assert sum(link.intra for link in links["on"] if link.inter) == 0  # the leg between nodes: nothing inside
    assert sum(link.inter for link in links["on"]) < sum(link.inter for link in links["flat"])
    # less time on the links; the step is another matter: in one chunk node-aware dispatch runs blocking, the flat one
    # beside the shared expert
    assert on.time.comm_s < flat.time.comm_s
    # one group a token, groups whole on nodes: one node a token
    one = node_plan(None, [("group_topk", 1)])
    rows = {c.what: c.bytes for c in one.comm.collectives}["blocks.1.moe (between nodes): tokens to experts and back"]
    assert rows == T * D * 4


def test_node_aware_chunks_move_the_same_rows_in_more_calls_and_every_chunks_counts_before_the_first():
    # node-aware dispatch in C chunks (moe/node_dispatch.py NodeDispatch._exchange): between nodes, per node and chunk
    # the L expert counts and pairs of each of its n ranks and the node's pairs; inside the node, L + 1 per rank and
    # chunk
    n, N, L = 2, 2, 2  # 4 ranks on 2 nodes of 2, 8 experts
    one = {c.what: c for c in node_plan(None).comm.collectives if c.kind == "all_to_all"}
    for C in (2, 4):
        chunked = {c.what: c for c in node_plan(None, chunks=C).comm.collectives if c.kind == "all_to_all"}
        assert chunked.keys() == one.keys()
        for what, c in one.items():
            if what.endswith(": counts"):
                ints = n * (L + 1) + 1 if "between nodes" in what else L + 1
                assert (chunked[what].bytes, chunked[what].calls) == (8 * C * ints * c.group, c.calls), what
            else:
                assert (chunked[what].bytes, chunked[what].calls) == (round(c.bytes / C), C * c.calls), what
    assert one["blocks.1.moe (between nodes): counts"].bytes == 8 * 2 * N  # one chunk: assignments and pairs a node


def test_fp8_dispatch_sends_the_rows_there_as_a_byte_a_value_and_a_scale_per_128():
    def run(fp8, precision):
        raw = recipe("top2", pathlib.Path("/nonexistent"), expert_parallel_size=2,
                     expert_comm={"fp8_dispatch": fp8, "overlap_chunks": 1})
        raw["model"]["d_model"] = 128
        ds = {"zero_optimization": {"stage": 2}, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
        return {c.what: c for c in plan_run(config_from_dict(raw), ds, Cluster(4, 2), hardware("h100"),
                                            assumptions()).comm.collectives}

    rows = 4 * 32 * (2 - 1 / 3)  # micro-batch 4 x 32 tokens, top-2 of 4 experts on 2 ranks: 5/3 ranks a token
    for precision, p in (("bf16", 2), ("fp32", 4)):
        off, on = run(False, precision), run(True, precision)
        assert off["blocks.0.moe: tokens to experts and back"].bytes == round(rows * 128 * p)
        there = on["blocks.0.moe: tokens to experts (fp8 and scales)"]
        back = on["blocks.0.moe: tokens back, and gradients"]
        assert (there.bytes, there.calls) == (round(rows * (128 + 4)), 1)
        assert (back.bytes, back.calls) == (round(rows * 128 * p), 3)  # the combine and both gradients as before
        assert "blocks.0.moe: tokens to experts and back" not in on
        # bf16: half, and the scales (0.516); fp32: about a quarter
        ratio = there.bytes / off["blocks.0.moe: tokens to experts and back"].bytes
        assert ratio == pytest.approx(132 / (128 * p), rel=1e-4)  # up to the bytes' rounding


def test_chunks_move_the_same_rows_in_more_calls_and_every_chunks_counts_in_one_exchange():
    # train.expert_comm.overlap_chunks (moe/overlap.py): C calls of a chunk's rows each, one exchange of C chunks' counts
    for dedup in (False, True):
        one, two = plan(dedup), plan(dedup, chunks=2)
        before = {c.what: c for c in one.comm.collectives if c.kind == "all_to_all"}
        after = {c.what: c for c in two.comm.collectives if c.kind == "all_to_all"}
        assert before.keys() == after.keys()
        for what, c in before.items():
            if ": expert counts" in what:
                assert (after[what].bytes, after[what].calls) == (2 * c.bytes, c.calls), what
            else:
                assert (after[what].bytes, after[what].calls) == (round(c.bytes / 2), 2 * c.calls), what
