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
from moep_ds.planning.dedup import Choice, expected_pairs, ranks_per_token  # noqa: E402
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


def plan(dedup, layers="top2", overrides=()):
    raw = recipe(layers, pathlib.Path("/nonexistent"), expert_parallel_size=2, expert_comm={"dedup": dedup})
    for path, value in overrides:
        raw["model"]["layers"][0]["moe"]["router"][path] = value
    return plan_run(config_from_dict(raw), {"zero_optimization": {"stage": 2}}, Cluster(4, 2), hardware("h100"),
                    assumptions())


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
