"""Node-aware expert-parallel dispatch: the part of AllToAllDispatcher (moe/all_to_all.py) that runs where the
expert-parallel group spans nodes (`ExpertCommConfig.node_aware`, DESIGN.md §4: a token crosses between nodes once per
destination node).

# R ranks in the expert-parallel group, N nodes of n ranks, L experts per rank, T tokens of this rank, C chunks,
# A assignments a hop carries, P distinct (row, destination) pairs, U assignments received, Q rows a hop reads from

The rows take two legs, each a hop (one row per distinct (row, destination) pair, each assignment's weight and
integer columns beside it):
    1. between nodes: to the peer with this local rank on each destination node, over the group of those peers
    2. inside the node: the peer regroups what it received by destination rank and sends each (row, rank) pair once
    3. the expert's rank orders its assignments as the per-expert path does: (local expert, source rank, the
       source's plan order), from the source rank and assignment index that travelled along
    4. combine in reverse: the expert's rank sums each pair, the peer sums its rows' pairs, the source its tokens'
In one chunk (`dispatch`, `combine`) the legs run blocking, after the shared expert, each hop exchanging its own
counts first. In C > 1 chunks (`start`, `finish`) every hop's splits are known before its rows move, so only the
count exchanges wait for the host:
    start   the counts of every chunk between nodes: per node and chunk, for each of its n ranks the L expert counts
            and (token, rank) pairs, then the (token, node) pairs, N*C*(n*(L+1)+1) ints, waited for (their host copy
            gives the splits of every hop between nodes, and the peer, summing over its sources, those it passes on
            inside the node); the peer's sums, which each rank of its node needs as its splits inside the node, issued
            at once (n*C*(L+1) ints, not waited for); the hops between nodes of chunks 1 and 2 issued
            | the shared expert computes
    finish  wait for the counts inside the node and for chunk 1's hop between nodes; issue chunk 1's hop inside
            for chunk i = 1..C:
                wait for chunk i+1's hop between nodes (it travelled behind chunk i-1's experts or the shared expert);
                    issue its hop inside the node (the peer regroups the rows it received: step 2 above)
                issue chunk i+2's hop between nodes
                wait for chunk i's hop inside the node; its experts compute; issue its combine inside the node
                wait for chunk i-1's combine inside the node (the peer adds each pair to its row); issue it between
                    nodes
                wait for chunk i-2's combine between nodes (the source adds each row to its token)
            wait for chunk C's combine inside the node, issue it between nodes; wait for chunks C-1 and C's
so chunk i's experts compute while chunk i+1's hop inside the node, chunk i+2's between nodes, chunk i-1's combine
inside the node and chunk i-2's between nodes travel; backward runs the same in reverse (moe/overlap.py). A hop is
the same four all-to-alls whether blocking or in a chunk (`_start_hop`: the rows, FP8 or not, weights, ints and
positions), so each expert sees, per chunk, exactly the blocking path's rows, order, sequence ids and positions.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from moep_ds.moe.dispatch import ExpertBatch, RunExperts, WeightedCombine, take_meta
from moep_ds.moe.overlap import Ints, Rows, chunk_counts, chunk_plans
from moep_ds.routing.plan import RoutingPlan, counts_on


@dataclasses.dataclass(frozen=True)
class NodeGroups:
    """The expert-parallel group cut by nodes, for node-aware dispatch: `ranks_per_node` consecutive ranks of the
    group share a node; `intra` is this node's ranks (in rank order), `inter` the ranks with this local rank, one per
    node (in node order)."""

    ranks_per_node: int
    intra: Any = dataclasses.field(compare=False, repr=False)
    inter: Any = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class _Hop:
    """One leg as its sender keeps it for the way back: the row of each pair it sent (`token_P`), how many rows it
    had, and the pairs per peer of `group`."""

    group: Any
    token_P: torch.Tensor
    num_rows: int
    send_splits: list[int]
    recv_splits: list[int]


@dataclasses.dataclass(frozen=True)
class _Leg:
    """What a hop delivers: the rows (`x_PD`, `meta_P2`), per received assignment its row among them, weight, code
    and source (index in the hop's group), and the extra counts each source sent."""

    x_PD: torch.Tensor
    row_A: torch.Tensor
    weight_A: torch.Tensor
    code_A: torch.Tensor
    source_A: torch.Tensor
    meta_P2: torch.Tensor | None
    extra: list[list[int]]
    hop: _Hop


@dataclasses.dataclass(frozen=True)
class NodeRoute:
    """The two hops (between nodes, then inside), and on the expert's rank each local assignment's received row and
    weight (expert order)."""

    hops: tuple[_Hop, ...]
    row_S: torch.Tensor
    weight_S: torch.Tensor
    num_received: int


@dataclasses.dataclass(frozen=True)
class _HopInFlight:
    """A hop issued with its splits known (`_start_hop`): rows, weights, ints and positions in flight to the hop's
    group; `result` waits for them and reads each received assignment's row, code and source."""

    rows: Rows
    weights: Rows
    packed: Ints
    meta: Ints | None
    radix: int
    recv_assign: list[int]
    recv_pairs: list[int]
    hop: _Hop

    def result(self) -> _Leg:
        x_PD, weight_U, packed_U = self.rows.result(), self.weights.result(), self.packed.result()
        meta = None if self.meta is None else self.meta.result()
        row_U, code_U, source_U = arrived(packed_U, self.radix, self.recv_assign, self.recv_pairs)
        return _Leg(x_PD, row_U, weight_U, code_U, source_U, meta, [], self.hop)


@dataclasses.dataclass(frozen=True)
class _NodeChunk:
    """One chunk: its first token, its plan (token indices counted from that token) and its splits as the count
    exchange between nodes gave them (host ints): the rows (pairs) and assignments sent to / received from the peer on
    each node on the leg between nodes, and those this rank passes on to each rank of its node on the leg inside it
    (`fan_*`)."""

    start: int
    plan: RoutingPlan
    send_pairs: list[int]
    send_assign: list[int]
    recv_pairs: list[int]
    recv_assign: list[int]
    fan_pairs: list[int]
    fan_assign: list[int]


@dataclasses.dataclass(frozen=True)
class NodePipeline:
    """What `start` hands `finish`: the chunks, the count exchange inside the node in flight ([n ranks, C chunks, L
    expert counts and pairs]), and the legs between nodes of the first two chunks in flight."""

    x_TD: torch.Tensor
    chunks: list[_NodeChunk]
    meta_T2: torch.Tensor | None
    seq_ids_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    run_experts: RunExperts
    inside: Ints
    between: list[_HopInFlight]


@dataclasses.dataclass(frozen=True)
class _FanOut:
    """A chunk's leg inside the node in flight, with its leg between nodes (for the way back) and the tokens each
    local expert receives."""

    inside: _HopInFlight
    between: _Hop
    local_counts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Return:
    """A chunk's combine in flight on one hop of the way back (`level` 1: inside the node, 0: between nodes)."""

    rows: Rows
    route: NodeRoute
    level: int
    acc: torch.dtype
    wire: torch.dtype


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """[G] where each of `sizes` starts (a copy to the device that does not wait for it)."""
    return counts_on([0, *sizes[:-1]], device).cumsum(0)


def arrived(packed_U: torch.Tensor, radix: int, recv_assign: list[int],
             recv_pairs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per assignment a hop delivered (grouped by source): its row among all received rows, its code and its source
    (index in the hop's group), from the int each carried and the counts per source."""
    device = packed_U.device
    source_U = torch.arange(len(recv_assign), device=device).repeat_interleave(
        counts_on(recv_assign, device), output_size=sum(recv_assign))
    row_U = packed_U // radix + _offsets(recv_pairs, device)[source_U]  # a slot counts within its source's rows
    return row_U, packed_U % radix, source_U


def _known_pairs(key_A: torch.Tensor, dest_A: torch.Tensor, pairs_G: list[int],
                 radix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.unique of `key_A` = dest * radix + row (with the inverse) where the pairs per destination are known on
    the host (`pairs_G`, from a count exchange): (row of each distinct pair, sorted by (destination, row); each key's
    pair counted from its destination's first), without the device-to-host copy unique makes for its size."""
    sorted_A, order_A = torch.sort(key_A, stable=True)
    new_A = torch.ones_like(sorted_A, dtype=torch.bool)
    new_A[1:] = sorted_A[1:] != sorted_A[:-1]
    pair_sorted = new_A.cumsum(0) - 1
    pair_A = torch.empty_like(pair_sorted).scatter_(0, order_A, pair_sorted)
    # the keys of one pair are equal: whichever the scatter writes last is the pair's key
    key_P = sorted_A.new_empty(sum(pairs_G)).scatter_(0, pair_sorted, sorted_A)
    return key_P % radix, pair_A - _offsets(pairs_G, key_A.device)[dest_A]


def _summed(z_back: torch.Tensor, hop: _Hop, acc: torch.dtype) -> torch.Tensor:
    """The rows a hop's receivers returned, each added (in `acc`) to the row of its sender it came from."""
    out = z_back.new_zeros(hop.num_rows, z_back.shape[-1], dtype=acc)
    return out.index_add(0, hop.token_P, z_back.to(acc))


class NodeDispatch:
    """Node-aware dispatch over `nodes` for rank `rank` of an expert-parallel group of `size` ranks with
    `num_local_experts` each. `send(x, group, out_splits, in_splits[, async_op])` is the all-to-all every collective
    goes through (the dispatcher's, looked up where it is called: counting it counts every byte); `rows(x, out_splits,
    in_splits, group)` puts differentiable rows in flight (FP8 where the dispatch is)."""

    def __init__(self, nodes: NodeGroups, size: int, rank: int, num_local_experts: int, send: Callable,
                 rows: Callable[..., Rows]):
        self.nodes, self.size, self.rank, self.L = nodes, size, rank, num_local_experts
        self.send, self.rows = send, rows

    def dispatch(self, x_TD: torch.Tensor, plan: RoutingPlan, meta_T2: torch.Tensor | None,
                 seq_ids_T: torch.Tensor | None, positions_T: torch.Tensor | None) -> tuple[ExpertBatch, NodeRoute]:
        """Steps 1-3 in one chunk, blocking: between nodes, then inside the node."""
        n, L, R = self.nodes.ranks_per_node, self.L, self.size
        expert_S = plan.expert_idx_S()
        leg = self._hop(x_TD, plan.token_idx_S, expert_S // (n * L), plan.weight_S, expert_S % (n * L), n * L, meta_T2,
                        expert_S.new_zeros(R // n, 0), self.nodes.inter, R // n)
        counts_nL = torch.bincount(leg.code_A, minlength=n * L).view(n, L)  # code: the expert within this node
        inner = self._hop(leg.x_PD, *self._fan_out_order(leg), L * R, leg.meta_P2, counts_nL, self.nodes.intra, n)
        local_counts = tuple(sum(row[e] for row in inner.extra) for e in range(L))
        return self._expert_batch(inner, leg.hop, local_counts, seq_ids_T, positions_T)

    def combine(self, y_SD: torch.Tensor, route: NodeRoute, out_dtype: torch.dtype) -> torch.Tensor:
        """Step 4 in one chunk, blocking: the expert's rank sums each pair's weighted outputs (fp32 or wider), then each
        hop in reverse returns one row per pair in the experts' dtype and its sender adds it to its row."""
        back = self._start_return(y_SD, route)
        while isinstance(back, _Return):
            back = self._next_return(back)
        return back.to(out_dtype)

    def start(self, x_TD: torch.Tensor, plan: RoutingPlan, bounds: list[int], meta_T2: torch.Tensor | None,
              seq_ids_T: torch.Tensor | None, positions_T: torch.Tensor | None,
              run_experts: RunExperts) -> NodePipeline:
        """In the chunks of tokens [bounds[c], bounds[c+1]): the counts between nodes (blocking), those inside the
        node and the first two chunks' hops between nodes issued."""
        chunks, inside = self._exchange(plan, bounds)
        between = [self._start_between(x_TD, chunk, meta_T2) for chunk in chunks[:2]]
        return NodePipeline(x_TD, chunks, meta_T2, seq_ids_T, positions_T, run_experts, inside, between)

    def finish(self, h: NodePipeline) -> torch.Tensor:
        """The chunks (module docstring: which step waits for which): a chunk's leg between nodes is issued two chunks
        ahead, its leg inside the node one chunk ahead, its combine inside the node behind its experts and between
        nodes one chunk behind."""
        C, L = len(h.chunks), self.L
        inside = h.inside.result().view(-1, C, L + 1).transpose(0, 1).tolist()  # [chunk][rank of this node]
        between, fans = list(h.between), [self._start_fan_out(h.chunks[0], h.between[0], inside[0])]
        backs, returns, outs = [], [], []
        for i in range(C):
            if i + 1 < C:
                fans.append(self._start_fan_out(h.chunks[i + 1], between[i + 1], inside[i + 1]))
            if i + 2 < C:
                between.append(self._start_between(h.x_TD, h.chunks[i + 2], h.meta_T2))
            inner = fans[i].inside.result()
            batch, route = self._expert_batch(inner, fans[i].between, fans[i].local_counts, h.seq_ids_T, h.positions_T)
            backs.append(self._start_return(h.run_experts(batch), route))
            if i > 0:
                returns.append(self._next_return(backs[i - 1]))
            if i > 1:
                outs.append(self._next_return(returns[i - 2]))
        returns.append(self._next_return(backs[-1]))
        outs += [self._next_return(back) for back in returns[len(outs):]]
        return torch.cat(outs).to(h.x_TD.dtype)

    def _hop(self, x_QD: torch.Tensor, row_A: torch.Tensor, dest_A: torch.Tensor, weight_A: torch.Tensor,
             code_A: torch.Tensor, radix: int, meta_Q2: torch.Tensor | None, extra_GX: torch.Tensor, group: Any,
             size: int) -> _Leg:
        """One hop, blocking: its count exchange over `group` (`size` ranks: per destination the `extra_GX` ints,
        which arrive as the leg's `extra`, the assignments and the distinct (row, destination) pairs), then the hop
        `_start_hop` issues, waited for."""
        Q = max(x_QD.shape[0], 1)
        key_P, pair_A = torch.unique(dest_A * Q + row_A, return_inverse=True)  # sorted by (destination, row)
        pairs_G = torch.bincount(key_P // Q, minlength=size)
        send_GX = torch.cat([extra_GX, torch.bincount(dest_A, minlength=size)[:, None], pairs_G[:, None]], dim=1)
        X = send_GX.shape[1]
        recv_GX = self.send(send_GX.reshape(-1), group, [X] * size, [X] * size).view(size, X)
        send_host, recv_host = torch.stack([send_GX, recv_GX]).tolist()  # one copy for every split
        splits = [[row[k] for row in host] for host in (send_host, recv_host) for k in (-1, -2)]  # pairs, assignments
        pairs = key_P % Q, pair_A - (pairs_G.cumsum(0) - pairs_G)[dest_A]
        leg = self._start_hop(x_QD, row_A, dest_A, weight_A, code_A, radix, meta_Q2, group, *splits, pairs).result()
        return dataclasses.replace(leg, extra=[row[:-2] for row in recv_host])

    def _start_hop(self, x_QD: torch.Tensor, row_A: torch.Tensor, dest_A: torch.Tensor, weight_A: torch.Tensor,
                   code_A: torch.Tensor, radix: int, meta_Q2: torch.Tensor | None, group: Any, send_pairs: list[int],
                   send_assign: list[int], recv_pairs: list[int], recv_assign: list[int],
                   pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> _HopInFlight:
        """Send each distinct (row, destination) pair of assignments once over `group`, with every assignment's weight
        (differentiable) and one int64: the row it reads among those its source sent, times `radix`, plus its `code`
        (< radix); assignments grouped by destination, in the order the receiver keeps per source. The splits come
        from a count exchange, so this issues without waiting; `pairs`: (token_P, slot_A) where the sender has them."""
        Q = max(x_QD.shape[0], 1)
        token_P, slot_A = pairs if pairs is not None else _known_pairs(dest_A * Q + row_A, dest_A, send_pairs, Q)
        rows = self.rows(x_QD.index_select(0, token_P), recv_pairs, send_pairs, group)
        weights = Rows(weight_A, group, recv_assign, send_assign, send=self.send)
        packed = Ints(slot_A * radix + code_A, group, recv_assign, send_assign, self.send)
        meta = None if meta_Q2 is None else Ints(meta_Q2.index_select(0, token_P), group, recv_pairs, send_pairs,
                                                 self.send)
        return _HopInFlight(rows, weights, packed, meta, radix, recv_assign, recv_pairs,
                            _Hop(group, token_P, x_QD.shape[0], send_pairs, recv_pairs))

    def _fan_out_order(self, leg: _Leg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, destination in this node, weight, code) of each assignment `leg` delivered from the other nodes,
        stably grouped by destination; code = local expert * R + source rank, which the expert's rank sorts by. Every
        hop keeps each source's assignments in their plan order (grouped by expert), so stable sorts by destination,
        then by (local expert, source rank) give the per-expert path's order without sending it."""
        n, L, R = self.nodes.ranks_per_node, self.L, self.size
        expert_A = leg.code_A  # the expert within this node
        source_A = leg.source_A * n + self.rank % n  # the source's rank in the expert-parallel group
        dest_A = expert_A // L
        order = torch.argsort(dest_A, stable=True)
        code = ((expert_A % L) * R + source_A).index_select(0, order)
        return (leg.row_A.index_select(0, order), dest_A.index_select(0, order), leg.weight_A.index_select(0, order),
                code)

    def _expert_batch(self, inner: _Leg, between: _Hop, local_counts: tuple[int, ...], seq_ids_T: torch.Tensor | None,
                      positions_T: torch.Tensor | None) -> tuple[ExpertBatch, NodeRoute]:
        """On the expert's rank: what the leg inside the node delivered, ordered as the per-expert path orders it."""
        perm_S = torch.argsort(inner.code_A, stable=True)  # (local expert, source rank, plan order)
        row_S = inner.row_A.index_select(0, perm_S)
        seq_ids_S, positions_S = take_meta(inner.meta_P2, row_S, seq_ids_T, positions_T)
        counts_L = counts_on(local_counts, row_S.device)
        batch = ExpertBatch(inner.x_PD.index_select(0, row_S), counts_L, seq_ids_S, positions_S, local_counts)
        return batch, NodeRoute((between, inner.hop), row_S, inner.weight_A.index_select(0, perm_S),
                                inner.x_PD.shape[0])

    def _exchange(self, plan: RoutingPlan, bounds: list[int]) -> tuple[list[_NodeChunk], Ints]:
        """Step 1 for every chunk at once. Per destination node and chunk this rank sends, for each rank of that node,
        its L expert counts and (token, rank) pairs there, then its (token, node) pairs: one all-to-all of
        N*C*(n*(L+1)+1) ints between nodes, whose copy to the host this waits for. The peer that receives them knows
        its splits of both hops: the rows and assignments its sources send it and, summed over its sources, those it
        passes on to each rank of its node, which that rank needs as its own splits inside the node: they go at once,
        n*C*(L+1) ints inside the node, returned in flight (the first hops between nodes travel behind them; the first
        hop inside the node waits for them)."""
        R, L, C, n = self.size, self.L, len(bounds) - 1, self.nodes.ranks_per_node
        N = R // n
        chunk_S, counts_CE, (rank_pairs_CR, node_pairs_CN) = chunk_counts(plan, bounds, (R, N))
        per_rank = torch.cat([counts_CE.view(C, N, n, L), rank_pairs_CR.view(C, N, n, 1)], dim=3).view(C, N, -1)
        send_NCX = torch.cat([per_rank, node_pairs_CN.view(C, N, 1)], dim=2).transpose(0, 1).contiguous()
        X = send_NCX.shape[-1]
        recv_NCX = self.send(send_NCX.reshape(-1), self.nodes.inter, [C * X] * N, [C * X] * N).view(N, C, X)
        fan_nCY = recv_NCX[:, :, :-1].reshape(N, C, n, L + 1).sum(0).transpose(0, 1).contiguous()
        inside = Ints(fan_nCY.reshape(-1), self.nodes.intra, [C * (L + 1)] * n, [C * (L + 1)] * n, self.send)
        send_host, recv_host = torch.stack([send_NCX, recv_NCX]).tolist()  # one copy for every split between nodes
        return self._chunks(plan, bounds, chunk_S, counts_CE, send_host, recv_host), inside

    def _chunks(self, plan: RoutingPlan, bounds: list[int], chunk_S: torch.Tensor, counts_CE: torch.Tensor,
                send_host: list, recv_host: list) -> list[_NodeChunk]:
        """Each chunk's plan and splits from the count exchange between nodes ([node][chunk][n x (L expert counts,
        pairs), node pairs], sent and received)."""
        L, n = self.L, self.nodes.ranks_per_node

        def ranks(row: list[int]) -> list[list[int]]:  # a node's [n][L expert counts, pairs]
            return [row[d * (L + 1):(d + 1) * (L + 1)] for d in range(n)]

        def assignments(row: list[int]) -> int:
            return sum(sum(rank[:L]) for rank in ranks(row))

        counts = [tuple(e for row in send_host for rank in ranks(row[c]) for e in rank[:L])
                  for c in range(len(bounds) - 1)]
        chunks = []
        for c, sub in enumerate(chunk_plans(plan, bounds, chunk_S, counts_CE, counts)):
            # what this rank passes on to each rank of its node: the sum over the sources it received from
            fan = [[sum(column) for column in zip(*(ranks(row[c])[d] for row in recv_host))] for d in range(n)]
            chunks.append(_NodeChunk(bounds[c], sub, [row[c][-1] for row in send_host],
                                     [assignments(row[c]) for row in send_host], [row[c][-1] for row in recv_host],
                                     [assignments(row[c]) for row in recv_host], [rank[L] for rank in fan],
                                     [sum(rank[:L]) for rank in fan]))
        return chunks

    def _start_between(self, x_TD: torch.Tensor, chunk: _NodeChunk, meta_T2: torch.Tensor | None) -> _HopInFlight:
        """A chunk's leg between nodes, issued: each (token, node) pair to the peer with this local rank there."""
        n, L, plan = self.nodes.ranks_per_node, self.L, chunk.plan
        tokens = slice(chunk.start, chunk.start + plan.num_tokens)
        expert_S = plan.expert_idx_S()
        return self._start_hop(x_TD[tokens], plan.token_idx_S, expert_S // (n * L), plan.weight_S, expert_S % (n * L),
                               n * L, None if meta_T2 is None else meta_T2[tokens], self.nodes.inter, chunk.send_pairs,
                               chunk.send_assign, chunk.recv_pairs, chunk.recv_assign)

    def _start_fan_out(self, chunk: _NodeChunk, between: _HopInFlight, inside: list[list[int]]) -> _FanOut:
        """Waits for a chunk's leg between nodes, then issues its leg inside the node (`inside`: the chunk's [L expert
        counts, pairs] from each rank of this node, the exchange inside the node)."""
        L, R = self.L, self.size
        leg = between.result()
        fan = self._start_hop(leg.x_PD, *self._fan_out_order(leg), L * R, leg.meta_P2, self.nodes.intra,
                              chunk.fan_pairs, chunk.fan_assign, [row[L] for row in inside],
                              [sum(row[:L]) for row in inside])
        return _FanOut(fan, leg.hop, tuple(sum(row[e] for row in inside) for e in range(L)))

    def _start_return(self, y_SD: torch.Tensor, route: NodeRoute) -> _Return:
        """A chunk's combine, issued inside the node: each pair's weighted outputs summed (fp32 or wider), one row per
        pair back to the peer, in the experts' dtype."""
        acc = torch.promote_types(y_SD.dtype, route.weight_S.dtype)
        z_PD = WeightedCombine.apply(y_SD.to(acc), route.weight_S.to(acc), route.row_S, route.num_received)
        inner = route.hops[1]
        return _Return(Rows(z_PD.to(y_SD.dtype), inner.group, inner.send_splits, inner.recv_splits, send=self.send),
                       route, 1, acc, y_SD.dtype)

    def _next_return(self, back: _Return) -> _Return | torch.Tensor:
        """Waits for a chunk's combine on one hop and adds each returned row to the row it came from; inside the node
        then issues the hop between nodes, the same way back; between nodes gives the chunk's tokens (in `acc`)."""
        z_QD = _summed(back.rows.result(), back.route.hops[back.level], back.acc)
        if back.level == 0:
            return z_QD
        outer = back.route.hops[0]
        return _Return(Rows(z_QD.to(back.wire), outer.group, outer.send_splits, outer.recv_splits, send=self.send),
                       back.route, 0, back.acc, back.wire)


__all__ = ["NodeDispatch", "NodeGroups", "NodePipeline", "NodeRoute", "arrived"]
