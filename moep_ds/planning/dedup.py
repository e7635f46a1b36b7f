"""Rows the expert-parallel all-to-all sends when each token crosses to a rank once (moe/all_to_all.py `dedup`):
the expected number of distinct (token, destination rank) pairs of a routed stage under balanced routing.

# T routed tokens of a micro-batch, S assignments, E experts on R ranks (L = E/R each, in order), G groups of
# g = E/G experts of which a token keeps M (top-k's num_groups / group_topk), k experts per token

    token choice   a token's M groups are any M of the G alike, its k experts any k of those M*g alike:
                   P(rank r untouched) = sum over group choices of C(M*g - a_r, k) / C(M*g, k), a_r the experts of r
                   in the chosen groups; pairs = T * sum_r (1 - P(r untouched)). Groups placed one per rank
                   (G = R) give at most M ranks per token (the topk_group bound); k = 1 gives S.
    expert choice  each expert picks its S/E tokens of the T alike, independently of the others:
                   pairs = T * R * (1 - (1 - S/(E T))^L)
Node-aware dispatch (train.expert_comm.node_aware) crosses between nodes once per (token, destination node) pair:
the same expectations with the N nodes for the ranks (a node holds n L experts, in order; `nodes_per_token`); groups
placed G/N per node (G a multiple of N, distributed/expert_parallel.py check_node_layout) give at most M nodes a token.
A routing that drops tokens (a capacity) keeps the same share of pairs as of assignments, and never more pairs than
assignments. Balanced routing is what the planner assumes everywhere else too (planning/trace.py expected loads).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

from torch import nn

from moep_ds.routing.topk import TopKConfig


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a stage's router picks: each token `k` experts within `kept_groups` of `num_groups` groups, or, with k
    None, each expert its tokens (expert choice)."""

    k: int | None = None
    num_groups: int = 1
    kept_groups: int = 1


def choice_of(router: nn.Module) -> Choice:
    cfg = getattr(router, "cfg", None)
    if isinstance(cfg, TopKConfig):
        return Choice(cfg.k, cfg.num_groups, cfg.kept_groups())
    return Choice()


def untouched(choice: Choice, num_experts: int, ranks: int, rank: int) -> float:
    """P(none of a token's experts lives on `rank`) under balanced token choice (module docstring)."""
    G, M, k = choice.num_groups, choice.kept_groups, choice.k
    g, L = num_experts // G, num_experts // ranks
    ways = collections.Counter({(0, 0): 1})  # (groups chosen so far, experts of `rank` in them) -> choices
    for j in range(G):
        overlap = len(range(max(j * g, rank * L), min((j + 1) * g, (rank + 1) * L)))
        grown = collections.Counter(ways)
        for (m, a), n in ways.items():
            if m < M:
                grown[m + 1, a + overlap] += n
        ways = grown
    N = M * g
    return sum(n * math.comb(N - a, k) for (m, a), n in ways.items() if m == M) / (math.comb(G, M) * math.comb(N, k))


@functools.lru_cache(maxsize=None)  # a search asks it for every layout and stage: a few distinct arguments
def ranks_per_token(choice: Choice, num_experts: int, ranks: int) -> float:
    """Expected distinct ranks a token's experts live on (token choice)."""
    return sum(1 - untouched(choice, num_experts, ranks, r) for r in range(ranks))


def nodes_per_token(choice: Choice, num_experts: int, nodes: int) -> float:
    """Expected distinct nodes a token's experts live on (token choice; experts split in order over the nodes), at
    most `kept_groups` where the groups are placed on nodes whole."""
    return ranks_per_token(choice, num_experts, nodes)


def expected_pairs(choice: Choice, num_tokens: int, assignments: int, num_experts: int, ranks: int) -> float:
    """Expected distinct (token, rank) pairs of a micro-batch's routing (module docstring)."""
    if not assignments:
        return 0.0
    if choice.k is None:
        picked = assignments / (num_experts * num_tokens)  # the share of the tokens each expert takes
        return min(assignments, num_tokens * ranks * (1 - (1 - picked) ** (num_experts // ranks)))
    kept = assignments / (num_tokens * choice.k)  # < 1 where a capacity drops assignments
    return min(assignments, num_tokens * ranks_per_token(choice, num_experts, ranks) * kept)


__all__ = ["Choice", "choice_of", "expected_pairs", "nodes_per_token", "ranks_per_token", "untouched"]
