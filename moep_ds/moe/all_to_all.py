"""Expert-parallel dispatch: experts sharded over the ranks of a process group, tokens moved by all-to-all.

# R ranks in the expert-parallel group, L experts per rank (E = R*L; rank r owns experts [r*L, (r+1)*L)),
# T tokens of this rank, S (token, expert) assignments (grouped by global expert = by destination rank),
# P (token, destination rank) pairs, U assignments received by this rank, D model dim; node-aware: N nodes of n ranks

Routing is computed by each rank on its own tokens. Then, by default (`ExpertCommConfig.dedup`, DESIGN.md §4: a
token crosses to a rank once, however many of its experts live there):
    1. exchange per-expert counts and the number of (token, rank) pairs (all-to-all of R*(L+1) ints)
    2. all-to-all of one row per pair (with its sequence id and position), and of each assignment's combine weight
       and the row it reads among those its source sent
    3. the receiver builds each local expert's batch from the rows, in (local expert, source rank) order and the
       plan's order within: exactly the rows, order, sequence ids and positions of the per-expert path below
    4. local experts run; the receiver sums each pair's weighted outputs (fp32) and sends one row back per pair,
       which the source adds to its token
Where the group spans nodes (`node_aware`, DESIGN.md §4: a token crosses between nodes once per destination node),
the same rows take two legs, each a `_hop` (one row per distinct (row, destination) pair, each assignment's weight
and integer columns beside it):
    1. between nodes: to the peer with this local rank on each destination node, over the group of those peers
    2. inside the node: the peer regroups what it received by destination rank and sends each (row, rank) pair once
    3. the expert's rank orders its assignments as the per-expert path does: (local expert, source rank, the
       source's plan order), from the source rank and assignment index that travelled along
    4. combine in reverse: the expert's rank sums each pair, the peer sums its rows' pairs, the source its tokens'
With `dedup: false` (the blocking per-expert path) one row travels per assignment:
    1. exchange per-expert counts (all-to-all of R*L ints)
    2. all-to-all of the tokens (with sequence ids and positions): received rows are ordered by
       (source rank, local expert); a permutation regroups them by (local expert, source rank)
    3. local experts run on their tokens
    4. the inverse permutation and the reverse all-to-all return each output to its source rank, which
       scatter-adds it with the combine weights (the weights never travel)
With `fp8_dispatch` the rows of step 2 (of each leg, node-aware) travel as float8 e4m3 with one fp32 scale per 128
values (moe/fp8.py), dequantised on arrival; the combine and every gradient stay in the model dtype (DeepSeek-V3's
FP8 dispatch, BF16 combine): a straight-through rule for the rounding.
With `overlap_chunks` C > 1 (moe/overlap.py) the flat paths run steps 2-4 per chunk of this rank's tokens (contiguous,
whole sequences where experts attend), the counts of all C chunks exchanged at once in step 1: chunk i+1's step 2
travels while chunk i's experts compute, chunk i's step 4 while chunk i+1's do; each expert sees, per chunk, exactly
the rows the blocking path gives it for those tokens.
Node-aware dispatch in one chunk runs its legs blocking, after the shared expert, each hop exchanging its own counts
first. In C > 1 chunks (`_exchange_nodes`, `_finish_nodes`) every hop's splits are known before its rows move, so
only the count exchanges wait for the host:
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
inside the node and chunk i-2's between nodes travel; backward runs the same in reverse (moe/overlap.py). A chunk's
hops carry what the blocking hops carry for its tokens (the same rows in FP8 or not, weights, ints and positions),
so each expert sees, per chunk, exactly the blocking node-aware path's rows, order, sequence ids and positions.
The all-to-all is differentiable (its backward is the reverse all-to-all; with dedup the weights travel through it
too, so the router's gradient comes back the same way), so gradients of the inputs, the router and the expert
weights equal those of LocalDispatcher on the same global batch (up to summation order).

This is the one model-side module that touches torch.distributed; its process group comes with the
expert-parallel plan (moe/plan.py), in whose rank order rank r holds experts [r*L, (r+1)*L).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from moep_ds.moe import fp8, overlap
from moep_ds.moe.dispatch import Dispatcher, ExpertBatch, RunExperts, WeightedCombine, combine_tokens, gather_tokens
from moep_ds.moe.overlap import Ints, Rows, chunk_bounds, chunk_index
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.plan import RoutingPlan, counts_on, expert_counts
from moep_ds.schema import PositiveInt


SEQ_ID_STRIDE = 2**32  # more sequences than any rank holds in a micro-batch


@dataclasses.dataclass(kw_only=True)
class ExpertCommConfig:
    """How the expert-parallel all-to-all moves tokens (recipe `train.expert_comm`, beside expert_parallel_size).
    Every option keeps the blocking per-expert path's results up to summation order; each can be turned off to
    compare with it or to debug."""

    # a token crosses to a rank once however many of its chosen experts live there; the rank applies each of them
    # and returns one weighted sum (Megatron / DeepEP dispatch per rank); false: one row per (token, expert)
    dedup: bool = True
    # where the group spans nodes, a token crosses between nodes once per destination node (to the peer with its
    # local rank there), which fans it out inside the node; combine in reverse (DeepEP's internode dispatch). null: on
    # wherever the expert-parallel group spans more than one node (distributed/expert_parallel.py node_size)
    node_aware: bool | None = None
    # the dispatched rows travel as float8 e4m3 with one fp32 scale per 128 values (moe/fp8.py; about half of bf16's
    # bytes); the combine and every gradient stay in the model dtype (DeepSeek-V3). Rows must be multiples of 128 wide
    fp8_dispatch: bool = False
    # the routed tokens of a micro-batch go in this many chunks (whole sequences where experts attend): a chunk's
    # all-to-alls travel while another chunk's experts (or the shared expert) compute (moe/overlap.py), node-aware
    # dispatch's two hops a chunk included; 1: blocking (flat: beside the shared expert; node-aware: after it)
    overlap_chunks: PositiveInt = 2


@dataclasses.dataclass(frozen=True)
class NodeGroups:
    """The expert-parallel group cut by nodes, for node-aware dispatch: `ranks_per_node` consecutive ranks of the
    group share a node; `intra` is this node's ranks (in rank order), `inter` the ranks with this local rank, one per
    node (in node order)."""

    ranks_per_node: int
    intra: Any = dataclasses.field(compare=False, repr=False)
    inter: Any = dataclasses.field(compare=False, repr=False)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):  # noqa: ANN001, ANN205
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _Fp8AllToAll(torch.autograd.Function):
    """The forward dispatch of rows in FP8: packed as e4m3 values with their scales (moe/fp8.py), dequantised on
    arrival into the rows' own dtype. Backward sends the gradient back in its own dtype (the model's): a
    straight-through rule for the quantisation, as DeepSeek-V3 (FP8 dispatch, BF16 combine and backward)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):  # noqa: ANN001, ANN205
        if x.shape[-1] % fp8.BLOCK:
            raise ValueError(f"fp8 dispatch: rows of {x.shape[-1]} values are not a multiple of {fp8.BLOCK}")
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return fp8.unpack(all_to_all(fp8.pack(x), group, out_splits, in_splits), x.shape[-1], x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int],
               async_op: bool = False) -> Any:
    """The buffer received, or (buffer, work) with `async_op` (moe/overlap.py)."""
    return overlap.all_to_all(x, group, out_splits, in_splits, async_op)


def _send(*args: Any) -> Any:
    """This module's all_to_all as it is at call time (tests count the bytes by wrapping it)."""
    return all_to_all(*args)


def source_to_expert_order(recv_counts_RL: torch.Tensor, num_received: int | None = None) -> torch.Tensor:
    """Permutation p with received[p] grouped by (local expert, source rank) instead of (source rank, expert);
    `num_received` (the counts' sum, when known on the host) spares repeat_interleave a device-to-host copy."""
    R, L = recv_counts_RL.shape
    counts = recv_counts_RL.reshape(-1)
    block_U = torch.arange(R * L, device=counts.device).repeat_interleave(counts, output_size=num_received)
    expert_major_U = (block_U % L) * R + block_U // L
    return torch.argsort(expert_major_U, stable=True)


def rank_pairs(plan: RoutingPlan, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (token, destination rank) pairs of `plan` (experts split evenly over `num_ranks` ranks in order).

    Returns token_P (each pair's token, grouped by destination rank, then by token), pairs_R (pairs per rank) and
    slot_S (for each assignment, its pair's row among the rows sent to its rank)."""
    T, L = plan.num_tokens, plan.num_experts // num_ranks
    dest_S = plan.expert_idx_S() // L
    key_P, pair_S = torch.unique(dest_S * T + plan.token_idx_S, return_inverse=True)  # sorted by (rank, token)
    pairs_R = torch.bincount(key_P // T, minlength=num_ranks)
    first_R = pairs_R.cumsum(0) - pairs_R
    return key_P % T, pairs_R, pair_S - first_R[dest_S]


@dataclasses.dataclass(frozen=True)
class _Hop:
    """One leg of node-aware dispatch as its sender keeps it for the way back: the row of each pair it sent
    (`token_P`), how many rows it had, and the pairs per peer of `group`."""

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


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """[G] where each of `sizes` starts (a copy to the device that does not wait for it)."""
    return counts_on([0, *sizes[:-1]], device).cumsum(0)


def _hop(x_QD: torch.Tensor, row_A: torch.Tensor, dest_A: torch.Tensor, weight_A: torch.Tensor, code_A: torch.Tensor,
         radix: int, meta_Q2: torch.Tensor | None, extra_GX: torch.Tensor, group: Any, size: int,
         send_rows: Callable = _AllToAll.apply) -> _Leg:
    """Send each distinct (row, destination) pair of assignments once over `group` (`size` ranks), with every
    assignment's weight (differentiable) and one int64: the row it reads among those its source sent, times `radix`,
    plus its `code` (< radix). Assignments grouped by destination, in the order the receiver keeps per source.
    `extra_GX` (ints per destination) travels with the counts; `send_rows` moves the rows (_Fp8AllToAll: in FP8)."""
    Q, device = max(x_QD.shape[0], 1), x_QD.device
    key_P, pair_A = torch.unique(dest_A * Q + row_A, return_inverse=True)  # sorted by (destination, row)
    pairs_G = torch.bincount(key_P // Q, minlength=size)
    first_G = pairs_G.cumsum(0) - pairs_G
    token_P, slot_A = key_P % Q, pair_A - first_G[dest_A]
    send_GX = torch.cat([extra_GX, torch.bincount(dest_A, minlength=size)[:, None], pairs_G[:, None]], dim=1)
    X = send_GX.shape[1]
    recv_GX = all_to_all(send_GX.reshape(-1), group, [X] * size, [X] * size).view(size, X)
    send_host, recv_host = torch.stack([send_GX, recv_GX]).tolist()  # one copy for every split
    send_assign, send_pairs = [r[-2] for r in send_host], [r[-1] for r in send_host]
    recv_assign, recv_pairs = [r[-2] for r in recv_host], [r[-1] for r in recv_host]
    x_PD = send_rows(x_QD.index_select(0, token_P), group, recv_pairs, send_pairs)
    weight_U = _AllToAll.apply(weight_A, group, recv_assign, send_assign)
    packed_U = all_to_all(slot_A * radix + code_A, group, recv_assign, send_assign)
    meta = None if meta_Q2 is None else all_to_all(meta_Q2.index_select(0, token_P), group, recv_pairs, send_pairs)
    row_U, code_U, source_U = _arrived(packed_U, radix, recv_assign, recv_pairs)
    return _Leg(x_PD, row_U, weight_U, code_U, source_U, meta, [r[:-2] for r in recv_host],
                _Hop(group, token_P, x_QD.shape[0], send_pairs, recv_pairs))


def _arrived(packed_U: torch.Tensor, radix: int, recv_assign: list[int],
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


def _hop_back(z_PD: torch.Tensor, hop: _Hop, acc: torch.dtype, wire: torch.dtype) -> torch.Tensor:
    """The reverse of a hop: each pair's row returns (in `wire` dtype) and its sender adds it to the row it came
    from (in `acc`)."""
    return _summed(_AllToAll.apply(z_PD.to(wire), hop.group, hop.send_splits, hop.recv_splits), hop, acc)


def _summed(z_back: torch.Tensor, hop: _Hop, acc: torch.dtype) -> torch.Tensor:
    """The rows a hop's receivers returned, each added (in `acc`) to the row of its sender it came from."""
    out = z_back.new_zeros(hop.num_rows, z_back.shape[-1], dtype=acc)
    return out.index_add(0, hop.token_P, z_back.to(acc))


@dataclasses.dataclass(frozen=True)
class _NodeRoute:
    """Node-aware dispatch: the two hops (between nodes, then inside), and on the expert's rank each local
    assignment's received row and weight (expert order)."""

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
        row_U, code_U, source_U = _arrived(packed_U, self.radix, self.recv_assign, self.recv_pairs)
        return _Leg(x_PD, row_U, weight_U, code_U, source_U, meta, [], self.hop)


@dataclasses.dataclass(frozen=True)
class _NodeChunk:
    """One chunk of node-aware dispatch in overlapped chunks: its first token, its plan (token indices counted from
    that token) and its splits as the count exchange between nodes gave them (host ints): the rows (pairs) and
    assignments sent to / received from the peer on each node on the leg between nodes, and those this rank passes on
    to each rank of its node on the leg inside it (`fan_*`)."""

    start: int
    plan: RoutingPlan
    send_pairs: list[int]
    send_assign: list[int]
    recv_pairs: list[int]
    recv_assign: list[int]
    fan_pairs: list[int]
    fan_assign: list[int]


@dataclasses.dataclass(frozen=True)
class _NodePipeline:
    """What `start` hands `finish` in node-aware dispatch: the chunks, the count exchange inside the node in flight
    ([n ranks, C chunks, L expert counts and pairs]), and the legs between nodes of the first two chunks in flight."""

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
    route: _NodeRoute
    level: int
    acc: torch.dtype
    wire: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One chunk of this rank's tokens (all of them without overlap): its first token, its plan (token indices
    counted from that token) and what the counts exchange gave per destination / source rank: [L expert counts,
    (with dedup) pairs], on the host, and the received ones on the device."""

    start: int
    plan: RoutingPlan
    send: list[list[int]]
    recv: list[list[int]]
    recv_RX: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A chunk's dispatch in flight: its rows, sequence ids and positions, and with dedup (weights, slots, token_P)."""

    chunk: _Chunk
    rows: Rows
    meta: Ints | None
    extra: tuple
    seq_ids_T: torch.Tensor | None
    positions_T: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """What `start` hands `finish`: the chunks, and the first one's dispatch in flight."""

    x_TD: torch.Tensor
    chunks: list[_Chunk]
    meta_T2: torch.Tensor | None
    seq_ids_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    run_experts: RunExperts
    first: _Pending


@dataclasses.dataclass(frozen=True)
class _Route:
    perm_U: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    plan: RoutingPlan  # the chunk's


@dataclasses.dataclass(frozen=True)
class _PairRoute:
    """Dedup: rows are (token, rank) pairs. `send_splits` / `recv_splits` count pairs per rank."""

    token_P: torch.Tensor  # source: the token of each pair sent
    row_S: torch.Tensor  # receiver: the received pair each local assignment reads (expert order)
    weight_S: torch.Tensor  # receiver: each local assignment's combine weight (differentiable)
    num_received: int
    send_splits: list[int]
    recv_splits: list[int]
    plan: RoutingPlan  # the chunk's


def _chunk_plans(plan: RoutingPlan, bounds: list[int], chunk_S: torch.Tensor, counts_CE: torch.Tensor,
                 counts: list[tuple[int, ...]]) -> list[RoutingPlan]:
    """The plan of each chunk of tokens [bounds[c], bounds[c+1]): its assignments in the plan's order, tokens counted
    from its first; `counts` its E expert counts on the host (from the count exchange)."""
    order_S = torch.argsort(chunk_S, stable=True)  # by chunk, then in the plan's order (grouped by expert)
    token_S, weight_S = plan.token_idx_S.index_select(0, order_S), plan.weight_S.index_select(0, order_S)
    plans, first = [], 0
    for c, counts_E in enumerate(counts):
        rows = slice(first, first + sum(counts_E))
        plans.append(RoutingPlan(token_S[rows] - bounds[c], weight_S[rows], counts_CE[c], bounds[c + 1] - bounds[c],
                                 static_counts=counts_E))
        first = rows.stop
    return plans


def _splits(counts_RX: list[list[int]], L: int) -> tuple[list[int], list[int], list[list[int]]]:
    """(assignments per rank, pairs per rank, per-expert counts) of rows [L expert counts, pairs] (per expert: no
    pairs, 0)."""
    return ([sum(row[:L]) for row in counts_RX], [row[L] if len(row) > L else 0 for row in counts_RX],
            [row[:L] for row in counts_RX])


class AllToAllDispatcher(Dispatcher):
    """Dispatcher over an expert-parallel group (gloo or nccl).

    Sequence ids arrive as source rank * SEQ_ID_STRIDE + seq_id: unique across the group, and, since received
    rows are grouped by source rank, non-decreasing within an expert whenever the plan lists each expert's
    tokens in token order (what routed attention over original positions needs; moe/dispatch.in_token_order).
    `start` exchanges the counts and issues the first chunk's dispatch (moe/overlap.py: `comm.overlap_chunks`
    chunks pipelined; node-aware: the first two chunks' hops between nodes); `finish` runs the chunks. Node-aware
    dispatch in one chunk runs its legs blocking in `finish`.
    """

    def __init__(self, plan: ExpertParallelPlan, num_experts: int, comm: ExpertCommConfig | None = None,
                 nodes: NodeGroups | None = None):
        """`nodes`: the group cut by nodes, for node-aware dispatch (distributed/expert_parallel.py makes it where
        `comm.node_aware` resolves on); None: one flat all-to-all."""
        self.group = plan.group
        self.ep_size = plan.size
        self.ep_rank = plan.rank
        self.num_experts = num_experts
        self.num_local_experts = len(plan.held(num_experts))
        self.comm = comm if comm is not None else ExpertCommConfig()
        if nodes is not None and (plan.size % nodes.ranks_per_node or nodes.ranks_per_node >= plan.size
                                  or not self.comm.dedup):
            raise ValueError(f"node-aware dispatch needs dedup and a group of several nodes: {plan.size} ranks, "
                             f"{nodes.ranks_per_node} per node, dedup {self.comm.dedup}")
        self.nodes = nodes
        self._send_rows = _Fp8AllToAll.apply if self.comm.fp8_dispatch else _AllToAll.apply

    def _check(self, plan: RoutingPlan) -> None:
        if plan.num_experts != self.num_experts:
            raise ValueError(f"plan routes to {plan.num_experts} experts, the dispatcher shards {self.num_experts}")

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, _Route | _PairRoute | _NodeRoute]:
        """All of `plan` in one chunk, blocking."""
        self._check(plan)
        if self.nodes is not None:
            return self._dispatch_nodes(x_TD, plan, seq_ids_T, positions_T)
        chunk, = self._exchange(plan, [0, plan.num_tokens])
        meta_T2 = self._meta_rows(plan, seq_ids_T, positions_T)
        return self._finish_chunk(self._start_chunk(x_TD, chunk, meta_T2, seq_ids_T, positions_T))

    def start(self, x_TD: torch.Tensor, plan: RoutingPlan, run_experts: RunExperts,
              seq_ids_T: torch.Tensor | None = None, positions_T: torch.Tensor | None = None) -> Any:
        """Steps 1 and 2 of the first chunk: the counts of every chunk (blocking), the first chunk's rows issued
        (node-aware: the counts between nodes blocking, those inside the node and the first two chunks' hops between
        nodes issued; in one chunk nothing before `finish`)."""
        self._check(plan)
        if self.nodes is not None and self.comm.overlap_chunks == 1:
            return super().start(x_TD, plan, run_experts, seq_ids_T, positions_T)
        bounds = chunk_bounds(plan.num_tokens, self.comm.overlap_chunks, seq_ids_T)
        meta_T2 = self._meta_rows(plan, seq_ids_T, positions_T)
        if self.nodes is not None:
            chunks, inside = self._exchange_nodes(plan, bounds)
            between = [self._start_between(x_TD, chunk, meta_T2) for chunk in chunks[:2]]
            return _NodePipeline(x_TD, chunks, meta_T2, seq_ids_T, positions_T, run_experts, inside, between)
        chunks = self._exchange(plan, bounds)
        first = self._start_chunk(x_TD, chunks[0], meta_T2, seq_ids_T, positions_T)
        return _Pipeline(x_TD, chunks, meta_T2, seq_ids_T, positions_T, run_experts, first)

    def finish(self, handle: Any) -> torch.Tensor:
        """Chunk i+1's dispatch travels while chunk i's experts compute, chunk i's combine while chunk i+1's do."""
        if isinstance(handle, _NodePipeline):
            return self._finish_nodes(handle)
        if not isinstance(handle, _Pipeline):
            return super().finish(handle)
        h, combines, pending = handle, [], handle.first
        for i in range(len(h.chunks)):
            following = None if i + 1 == len(h.chunks) else self._start_chunk(
                h.x_TD, h.chunks[i + 1], h.meta_T2, h.seq_ids_T, h.positions_T)
            batch, route = self._finish_chunk(pending)
            combines.append(self._start_combine(h.run_experts(batch), route))
            pending = following
        outs = [self._finish_combine(c, h.x_TD.dtype) for c in combines]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _exchange(self, plan: RoutingPlan, bounds: list[int]) -> list[_Chunk]:
        """Step 1 for every chunk of tokens [bounds[c], bounds[c+1]) at once: per destination rank and chunk the L
        expert counts (and, with dedup, the (token, rank) pairs), one all-to-all of R*C*(L+1) ints and one copy to
        the host; then each chunk's plan (its assignments in the plan's order, tokens counted from its first)."""
        R, L, E, C = self.ep_size, self.num_local_experts, plan.num_experts, len(bounds) - 1
        chunk_S = chunk_index(plan.token_idx_S, bounds) if C > 1 else torch.zeros_like(plan.token_idx_S)
        expert_S = plan.expert_idx_S()
        counts_CE = expert_counts(chunk_S * E + expert_S, C * E).view(C, E) if C > 1 else plan.counts_E.view(1, E)
        parts = [counts_CE.view(C, R, L)]
        if self.comm.dedup:
            T = max(plan.num_tokens, 1)
            key_P = torch.unique((expert_S // L) * T + plan.token_idx_S)  # the (rank, token) pairs
            chunk_P = chunk_index(key_P % T, bounds) if C > 1 else torch.zeros_like(key_P)
            parts.append(expert_counts(chunk_P * R + key_P // T, C * R).view(C, R, 1))
        send_RCX = torch.cat(parts, dim=2).transpose(0, 1).contiguous()  # by destination rank
        X = send_RCX.shape[-1]
        recv_RCX = all_to_all(send_RCX.reshape(-1), self.group, [C * X] * R, [C * X] * R).view(R, C, X)
        send_host, recv_host = torch.stack([send_RCX, recv_RCX]).tolist()  # one copy for every split
        if C == 1:
            return [_Chunk(0, plan, [row[0] for row in send_host], [row[0] for row in recv_host], recv_RCX[:, 0])]
        counts = [tuple(n for r in range(R) for n in send_host[r][c][:L]) for c in range(C)]
        return [_Chunk(bounds[c], sub, [row[c] for row in send_host], [row[c] for row in recv_host], recv_RCX[:, c])
                for c, sub in enumerate(_chunk_plans(plan, bounds, chunk_S, counts_CE, counts))]

    def _rows(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any = None) -> Rows:
        """Rows in flight to the experts over `group` (the expert-parallel group by default; FP8 with
        `comm.fp8_dispatch`: packed there, unpacked on arrival)."""
        group = self.group if group is None else group
        if not self.comm.fp8_dispatch:
            return Rows(x, group, out_splits, in_splits, send=_send)
        if x.shape[-1] % fp8.BLOCK:
            raise ValueError(f"fp8 dispatch: rows of {x.shape[-1]} values are not a multiple of {fp8.BLOCK}")
        width, dtype = x.shape[-1], x.dtype
        return Rows(x, group, out_splits, in_splits, fp8.pack, lambda t: fp8.unpack(t, width, dtype), _send)

    def _start_chunk(self, x_TD: torch.Tensor, chunk: _Chunk, meta_T2: torch.Tensor | None,
                     seq_ids_T: torch.Tensor | None, positions_T: torch.Tensor | None) -> _Pending:
        """Step 2 of one chunk, issued: its rows (per assignment, or per (token, rank) pair with dedup), and with
        dedup each assignment's weight and row among its source's pairs; sequence ids and positions."""
        L, plan = self.num_local_experts, chunk.plan
        x_TD = x_TD[chunk.start:chunk.start + plan.num_tokens]
        meta_T2 = None if meta_T2 is None else meta_T2[chunk.start:chunk.start + plan.num_tokens]
        send_assign, send_pairs, _ = _splits(chunk.send, L)
        recv_assign, recv_pairs, _ = _splits(chunk.recv, L)
        if not self.comm.dedup:
            rows, token_idx, send_rows, recv_rows, extra = gather_tokens(x_TD, plan), plan.token_idx_S, \
                send_assign, recv_assign, ()
        else:
            token_idx, _, slot_S = rank_pairs(plan, self.ep_size)
            rows, send_rows, recv_rows = x_TD.index_select(0, token_idx), send_pairs, recv_pairs
            extra = (Rows(plan.weight_S, self.group, recv_assign, send_assign, send=_send),
                     Ints(slot_S, self.group, recv_assign, send_assign, _send), token_idx)
        meta = None if meta_T2 is None else Ints(meta_T2.index_select(0, token_idx), self.group, recv_rows,
                                                 send_rows, _send)
        return _Pending(chunk, self._rows(rows, recv_rows, send_rows), meta, extra, seq_ids_T, positions_T)

    def _finish_chunk(self, p: _Pending) -> tuple[ExpertBatch, _Route | _PairRoute]:
        """Step 3 of one chunk: wait for its rows and order them by (local expert, source rank, plan order)."""
        R, L, chunk = self.ep_size, self.num_local_experts, p.chunk
        send_assign, send_pairs, _ = _splits(chunk.send, L)
        recv_assign, recv_pairs, recv_RL = _splits(chunk.recv, L)
        num_assign = sum(recv_assign)
        local_counts = tuple(sum(row[e] for row in recv_RL) for e in range(L))
        counts_L = chunk.recv_RX[:, :L].sum(0)
        perm_U = source_to_expert_order(chunk.recv_RX[:, :L], num_assign)
        x_rows = p.rows.result()
        meta = None if p.meta is None else p.meta.result()
        if not self.comm.dedup:
            seq_ids_U, positions_U = self._take_meta(meta, perm_U, p.seq_ids_T, p.positions_T)
            batch = ExpertBatch(x_rows.index_select(0, perm_U), counts_L, seq_ids_U, positions_U, local_counts)
            return batch, _Route(perm_U, send_assign, recv_assign, chunk.plan)
        weights, slots, token_P = p.extra
        weight_U, slot_U = weights.result(), slots.result()
        # a slot counts rows within its source's block: offset it by the rows of the sources before
        first_R = torch.tensor([0, *recv_pairs[:-1]], device=slot_U.device).cumsum(0)
        source_U = torch.arange(R, device=slot_U.device).repeat_interleave(
            torch.tensor(recv_assign, device=slot_U.device), output_size=num_assign)
        row_S = (slot_U + first_R[source_U]).index_select(0, perm_U)
        seq_ids_S, positions_S = self._take_meta(meta, row_S, p.seq_ids_T, p.positions_T)
        batch = ExpertBatch(x_rows.index_select(0, row_S), counts_L, seq_ids_S, positions_S, local_counts)
        return batch, _PairRoute(token_P, row_S, weight_U.index_select(0, perm_U), sum(recv_pairs), send_pairs,
                                 recv_pairs, chunk.plan)

    def _dispatch_nodes(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None,
        positions_T: torch.Tensor | None,
    ) -> tuple[ExpertBatch, _NodeRoute]:
        """Steps 1-3 of node-aware dispatch (module docstring): between nodes, then inside the node."""
        n, L, R = self.nodes.ranks_per_node, self.num_local_experts, self.ep_size
        expert_S = plan.expert_idx_S()
        node_experts = n * L
        leg = _hop(x_TD, plan.token_idx_S, expert_S // node_experts, plan.weight_S, expert_S % node_experts,
                   node_experts, self._meta_rows(plan, seq_ids_T, positions_T), expert_S.new_zeros(R // n, 0),
                   self.nodes.inter, R // n, self._send_rows)
        return self._fan_out(leg, seq_ids_T, positions_T)

    def _fan_out(self, leg: _Leg, seq_ids_T: torch.Tensor | None,
                 positions_T: torch.Tensor | None) -> tuple[ExpertBatch, _NodeRoute]:
        """On the peer that received `leg` from the other nodes: send each (row, rank of this node) pair once, and
        order what the expert's rank receives as the per-expert path does. Every hop keeps each source's assignments
        in their plan order (grouped by expert), so stable sorts by destination, then by (local expert, source rank)
        give the per-expert path's order without sending it."""
        n, L, R = self.nodes.ranks_per_node, self.num_local_experts, self.ep_size
        counts_nL = torch.bincount(leg.code_A, minlength=n * L).view(n, L)  # code: the expert within this node
        inner = _hop(leg.x_PD, *self._fan_out_order(leg), L * R, leg.meta_P2, counts_nL, self.nodes.intra, n,
                     self._send_rows)
        local_counts = tuple(sum(row[e] for row in inner.extra) for e in range(L))
        return self._expert_batch(inner, leg.hop, local_counts, seq_ids_T, positions_T)

    def _fan_out_order(self, leg: _Leg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, destination in this node, weight, code) of each assignment `leg` delivered, stably grouped by
        destination; code = local expert * R + source rank, which the expert's rank sorts by."""
        n, L, R = self.nodes.ranks_per_node, self.num_local_experts, self.ep_size
        expert_A = leg.code_A  # the expert within this node
        source_A = leg.source_A * n + self.ep_rank % n  # the source's rank in the expert-parallel group
        dest_A = expert_A // L
        order = torch.argsort(dest_A, stable=True)
        code = ((expert_A % L) * R + source_A).index_select(0, order)
        return (leg.row_A.index_select(0, order), dest_A.index_select(0, order), leg.weight_A.index_select(0, order),
                code)

    def _expert_batch(self, inner: _Leg, between: _Hop, local_counts: tuple[int, ...], seq_ids_T: torch.Tensor | None,
                      positions_T: torch.Tensor | None) -> tuple[ExpertBatch, _NodeRoute]:
        """On the expert's rank: what the leg inside the node delivered, ordered as the per-expert path orders it."""
        perm_S = torch.argsort(inner.code_A, stable=True)  # (local expert, source rank, plan order)
        row_S = inner.row_A.index_select(0, perm_S)
        seq_ids_S, positions_S = self._take_meta(inner.meta_P2, row_S, seq_ids_T, positions_T)
        counts_L = counts_on(local_counts, row_S.device)
        batch = ExpertBatch(inner.x_PD.index_select(0, row_S), counts_L, seq_ids_S, positions_S, local_counts)
        return batch, _NodeRoute((between, inner.hop), row_S, inner.weight_A.index_select(0, perm_S),
                                 inner.x_PD.shape[0])

    def _exchange_nodes(self, plan: RoutingPlan, bounds: list[int]) -> tuple[list[_NodeChunk], Ints]:
        """Step 1 of node-aware dispatch for every chunk at once. Per destination node and chunk this rank sends, for
        each rank of that node, its L expert counts and (token, rank) pairs there, then its (token, node) pairs: one
        all-to-all of N*C*(n*(L+1)+1) ints between nodes, whose copy to the host this waits for. The peer that
        receives them knows its splits of both hops: the rows and assignments its sources send it and, summed over its
        sources, those it passes on to each rank of its node, which that rank needs as its own splits inside the node:
        they go at once, n*C*(L+1) ints inside the node, returned in flight (the first hops between nodes travel
        behind them; the first hop inside the node waits for them)."""
        R, L, E, C = self.ep_size, self.num_local_experts, plan.num_experts, len(bounds) - 1
        n = self.nodes.ranks_per_node
        N, T = R // n, max(plan.num_tokens, 1)
        chunk_S, expert_S = chunk_index(plan.token_idx_S, bounds), plan.expert_idx_S()
        counts_CE = expert_counts(chunk_S * E + expert_S, C * E).view(C, E)
        pairs = []
        for parts in (R, N):  # (token, rank) and (token, node) pairs of each chunk
            key_P = torch.unique((expert_S // (E // parts)) * T + plan.token_idx_S)
            pairs.append(expert_counts(chunk_index(key_P % T, bounds) * parts + key_P // T, C * parts).view(C, parts))
        per_rank = torch.cat([counts_CE.view(C, N, n, L), pairs[0].view(C, N, n, 1)], dim=3).view(C, N, n * (L + 1))
        send_NCX = torch.cat([per_rank, pairs[1].view(C, N, 1)], dim=2).transpose(0, 1).contiguous()
        X = send_NCX.shape[-1]
        recv_NCX = all_to_all(send_NCX.reshape(-1), self.nodes.inter, [C * X] * N, [C * X] * N).view(N, C, X)
        fan_nCY = recv_NCX[:, :, :-1].reshape(N, C, n, L + 1).sum(0).transpose(0, 1).contiguous()
        inside = Ints(fan_nCY.reshape(-1), self.nodes.intra, [C * (L + 1)] * n, [C * (L + 1)] * n, _send)
        send_host, recv_host = torch.stack([send_NCX, recv_NCX]).tolist()  # one copy for every split between nodes
        return self._node_chunks(plan, bounds, chunk_S, counts_CE, send_host, recv_host), inside

    def _node_chunks(self, plan: RoutingPlan, bounds: list[int], chunk_S: torch.Tensor, counts_CE: torch.Tensor,
                     send_host: list, recv_host: list) -> list[_NodeChunk]:
        """Each chunk's plan and splits from the count exchange between nodes ([node][chunk][n x (L expert counts,
        pairs), node pairs], sent and received)."""
        L, n = self.num_local_experts, self.nodes.ranks_per_node

        def ranks(row: list[int]) -> list[list[int]]:  # a node's [n][L expert counts, pairs]
            return [row[d * (L + 1):(d + 1) * (L + 1)] for d in range(n)]

        def assignments(row: list[int]) -> int:
            return sum(sum(rank[:L]) for rank in ranks(row))

        counts = [tuple(e for row in send_host for rank in ranks(row[c]) for e in rank[:L])
                  for c in range(len(bounds) - 1)]
        chunks = []
        for c, sub in enumerate(_chunk_plans(plan, bounds, chunk_S, counts_CE, counts)):
            # what this rank passes on to each rank of its node: the sum over the sources it received from
            fan = [[sum(column) for column in zip(*(ranks(row[c])[d] for row in recv_host))] for d in range(n)]
            chunks.append(_NodeChunk(bounds[c], sub, [row[c][-1] for row in send_host],
                                     [assignments(row[c]) for row in send_host], [row[c][-1] for row in recv_host],
                                     [assignments(row[c]) for row in recv_host], [rank[L] for rank in fan],
                                     [sum(rank[:L]) for rank in fan]))
        return chunks

    def _start_hop(self, x_QD: torch.Tensor, row_A: torch.Tensor, dest_A: torch.Tensor, weight_A: torch.Tensor,
                   code_A: torch.Tensor, radix: int, meta_Q2: torch.Tensor | None, group: Any, send_pairs: list[int],
                   send_assign: list[int], recv_pairs: list[int], recv_assign: list[int]) -> _HopInFlight:
        """`_hop` with its splits known from a count exchange, issued without waiting: the same rows (FP8 with
        `comm.fp8_dispatch`), weights, ints and positions, with no copy to the host."""
        Q = max(x_QD.shape[0], 1)
        token_P, slot_A = _known_pairs(dest_A * Q + row_A, dest_A, send_pairs, Q)
        rows = self._rows(x_QD.index_select(0, token_P), recv_pairs, send_pairs, group)
        weights = Rows(weight_A, group, recv_assign, send_assign, send=_send)
        packed = Ints(slot_A * radix + code_A, group, recv_assign, send_assign, _send)
        meta = None if meta_Q2 is None else Ints(meta_Q2.index_select(0, token_P), group, recv_pairs, send_pairs, _send)
        return _HopInFlight(rows, weights, packed, meta, radix, recv_assign, recv_pairs,
                            _Hop(group, token_P, x_QD.shape[0], send_pairs, recv_pairs))

    def _start_between(self, x_TD: torch.Tensor, chunk: _NodeChunk, meta_T2: torch.Tensor | None) -> _HopInFlight:
        """A chunk's leg between nodes, issued: each (token, node) pair to the peer with this local rank there."""
        n, L, plan = self.nodes.ranks_per_node, self.num_local_experts, chunk.plan
        tokens = slice(chunk.start, chunk.start + plan.num_tokens)
        expert_S = plan.expert_idx_S()
        return self._start_hop(x_TD[tokens], plan.token_idx_S, expert_S // (n * L), plan.weight_S, expert_S % (n * L),
                               n * L, None if meta_T2 is None else meta_T2[tokens], self.nodes.inter, chunk.send_pairs,
                               chunk.send_assign, chunk.recv_pairs, chunk.recv_assign)

    def _start_fan_out(self, chunk: _NodeChunk, between: _HopInFlight, inside: list[list[int]]) -> _FanOut:
        """Waits for a chunk's leg between nodes, then issues its leg inside the node (`inside`: the chunk's [L expert
        counts, pairs] from each rank of this node, the exchange inside the node)."""
        L, R = self.num_local_experts, self.ep_size
        leg = between.result()
        fan = self._start_hop(leg.x_PD, *self._fan_out_order(leg), L * R, leg.meta_P2, self.nodes.intra,
                              chunk.fan_pairs, chunk.fan_assign, [row[L] for row in inside],
                              [sum(row[:L]) for row in inside])
        return _FanOut(fan, leg.hop, tuple(sum(row[e] for row in inside) for e in range(L)))

    def _start_return(self, y_SD: torch.Tensor, route: _NodeRoute) -> _Return:
        """A chunk's combine, issued inside the node: each pair's weighted outputs summed (fp32 or wider), one row per
        pair back to the peer, in the experts' dtype."""
        acc = torch.promote_types(y_SD.dtype, route.weight_S.dtype)
        z_PD = WeightedCombine.apply(y_SD.to(acc), route.weight_S.to(acc), route.row_S, route.num_received)
        inner = route.hops[1]
        return _Return(Rows(z_PD.to(y_SD.dtype), inner.group, inner.send_splits, inner.recv_splits, send=_send), route,
                       1, acc, y_SD.dtype)

    @staticmethod
    def _next_return(back: _Return) -> _Return | torch.Tensor:
        """Waits for a chunk's combine on one hop and adds each returned row to the row it came from; inside the node
        then issues the hop between nodes, the same way back; between nodes gives the chunk's tokens (in `acc`)."""
        z_QD = _summed(back.rows.result(), back.route.hops[back.level], back.acc)
        if back.level == 0:
            return z_QD
        outer = back.route.hops[0]
        return _Return(Rows(z_QD.to(back.wire), outer.group, outer.send_splits, outer.recv_splits, send=_send),
                       back.route, 0, back.acc, back.wire)

    def _finish_nodes(self, h: _NodePipeline) -> torch.Tensor:
        """Node-aware dispatch in C chunks (module docstring: which step waits for which): a chunk's leg between
        nodes is issued two chunks ahead, its leg inside the node one chunk ahead, its combine inside the node behind
        its experts and between nodes one chunk behind."""
        C, L = len(h.chunks), self.num_local_experts
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

    def _meta_rows(self, plan: RoutingPlan, seq_ids_T: torch.Tensor | None,
                   positions_T: torch.Tensor | None) -> torch.Tensor | None:
        """[T, 2] (sequence id unique across the group, position) of this rank's tokens, or None without either."""
        if seq_ids_T is None and positions_T is None:
            return None
        zeros = torch.zeros(plan.num_tokens, dtype=torch.int64, device=plan.token_idx_S.device)
        # Sequence ids are local to their source rank; make them unique across the group.
        seq_T = (zeros if seq_ids_T is None else seq_ids_T.to(torch.int64)) + self.ep_rank * SEQ_ID_STRIDE
        pos_T = zeros if positions_T is None else positions_T.to(torch.int64)
        return torch.stack([seq_T, pos_T], dim=1)

    @staticmethod
    def _take_meta(
        meta_U2: torch.Tensor | None,
        index: torch.Tensor,
        seq_ids_T: torch.Tensor | None,
        positions_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if meta_U2 is None:
            return None, None
        meta_S2 = meta_U2.index_select(0, index)
        return None if seq_ids_T is None else meta_S2[:, 0], None if positions_T is None else meta_S2[:, 1]

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: _Route | _PairRoute | _NodeRoute,
                out_dtype: torch.dtype) -> torch.Tensor:
        if isinstance(state, _NodeRoute):
            return self._combine_nodes(y_SD, state, out_dtype)
        return self._finish_combine(self._start_combine(y_SD, state), out_dtype)

    def _start_combine(self, y_SD: torch.Tensor, route: _Route | _PairRoute) -> tuple[Rows, _Route | _PairRoute, Any]:
        """Step 4 of one chunk, issued. Per expert: each output returns to its source in the received order. With
        dedup the expert side reduces each pair's weighted outputs (fp32 or wider) and one row per pair returns in
        the experts' dtype (the per-expert path's)."""
        if isinstance(route, _Route):
            inverse_U = torch.empty_like(route.perm_U)
            inverse_U[route.perm_U] = torch.arange(route.perm_U.numel(), device=route.perm_U.device)
            back = y_SD.index_select(0, inverse_U)
            return Rows(back, self.group, route.send_splits, route.recv_splits, send=_send), route, None
        acc = torch.promote_types(y_SD.dtype, route.weight_S.dtype)
        z_PD = WeightedCombine.apply(y_SD.to(acc), route.weight_S.to(acc), route.row_S, route.num_received)
        return Rows(z_PD.to(y_SD.dtype), self.group, route.send_splits, route.recv_splits, send=_send), route, acc

    @staticmethod
    def _finish_combine(pending: tuple[Rows, _Route | _PairRoute, Any], out_dtype: torch.dtype) -> torch.Tensor:
        """The chunk's tokens: per expert, the outputs scatter-added with the combine weights (which never
        travelled); with dedup, each returned pair added to its token (in the wider dtype)."""
        rows, route, acc = pending
        y_back = rows.result()
        if acc is None:
            return combine_tokens(y_back, route.plan, out_dtype)
        out_TD = y_back.new_zeros(route.plan.num_tokens, y_back.shape[-1], dtype=acc)
        return out_TD.index_add(0, route.token_P, y_back.to(acc)).to(out_dtype)

    @staticmethod
    def _combine_nodes(y_SD: torch.Tensor, route: _NodeRoute, out_dtype: torch.dtype) -> torch.Tensor:
        """Step 4 of node-aware dispatch: the expert's rank sums each pair's weighted outputs (fp32 or wider), then
        each hop in reverse returns one row per pair in the experts' dtype and its sender adds it to its row."""
        acc = torch.promote_types(y_SD.dtype, route.weight_S.dtype)
        z = WeightedCombine.apply(y_SD.to(acc), route.weight_S.to(acc), route.row_S, route.num_received)
        for hop in reversed(route.hops):
            z = _hop_back(z, hop, acc, y_SD.dtype)
        return z.to(out_dtype)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=self.group)
        return total


__all__ = ["SEQ_ID_STRIDE", "AllToAllDispatcher", "ExpertCommConfig", "NodeGroups", "rank_pairs",
           "source_to_expert_order"]
