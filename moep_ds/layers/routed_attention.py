"""Causal attention over a routed subset of tokens, at the tokens' positions in their original sequences.

# N routed tokens (one expert's, sorted by (sequence, position)), H heads, Dh head dim, D model dim,
# W window, C query chunk, L keys per chunk (C + W - 1 rounded up to a multiple of 8),
# S sequences present, P longest per-sequence run

An expert (MSIT branch, MoEP path) sees only the tokens routed to it. Routed token t of sequence b attends
to routed tokens s of the same sequence with pos(s) <= pos(t) and, with a window w, pos(t) - w < pos(s);
tokens of different sequences never see each other, and RoPE rotates by the original positions.

Windowed, O(N x (W + C)) instead of O(T^2): positions strictly increase within a sequence, so in the sorted
list at most w entries (the query included) can lie inside a query's window, namely the entries j-w+1..j.
Queries are cut into chunks of C consecutive entries; a chunk's keys are its own entries plus (at least) the
w-1 before it, and a [C, L] mask (same sequence, causal, window by original position) keeps the qualifying ones.

Unbounded (MoEP paths): each sequence's run of routed tokens is padded to the longest run P and attended
with a causal mask over original positions: O(S x P^2), P <= T (about T x k/E for top-k of E paths).

On CUDA both run as one FlexAttention call instead (`routed_flex_attention`, kernel "flex"): the same mask as a
block mask rebuilt from the routed tokens every call (routing is data-dependent), blocks outside every query's
window skipped, a fused flash-style kernel in forward and backward (no [C, L] or [P, P] mask in memory). It needs
torch.compile, which generates that kernel; the CPU keeps the SDPA paths above (FlexAttention has no CPU
backward). `routed_attention(..., kernel="sdpa")` forces the SDPA paths on any device.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Callable

import torch
import torch.nn.functional as F

from moep_ds.layers.attention import AttentionConfig, CausalSelfAttention
from moep_ds.layers.rope import apply_rope, rope_tables

# Smallest query chunk: for tiny windows a chunk of W queries would make many tiny matmuls; 64 rows keep
# the batched matmul efficient while the key overhead (C + W - 1 per query) stays a small constant.
MIN_CHUNK = 32
# Keys per chunk are rounded up to a multiple of 8 (extra earlier keys are masked) so that the mask's rows are
# aligned for the fused GPU attention kernels.
KEY_ALIGN = 8


def uses_flex(x: torch.Tensor, kernel: str | None = None) -> bool:
    """Whether routed attention on `x`'s device runs as FlexAttention (`kernel` None: on CUDA)."""
    return (kernel or ("flex" if x.is_cuda else "sdpa")) == "flex"


def routed_attention(
    q_NHd: torch.Tensor,
    k_NHd: torch.Tensor,
    v_NHd: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
    window: int | None,
    kernel: str | None = None,
    block_mask: object | None = None,
) -> torch.Tensor:
    """Causal attention among routed tokens sorted by (sequence, position); window None = unbounded.

    Args:
        q_NHd, k_NHd, v_NHd: queries/keys/values of the routed tokens (RoPE already applied).
        seq_N: sequence id of each token (non-negative int), non-decreasing.
        pos_N: original position of each token, strictly increasing within a sequence.
        window: w (the query included) or None.
        kernel: "flex" (FlexAttention, CUDA), "sdpa" (chunked / per-sequence SDPA), None: flex on CUDA.
        block_mask: for flex, `routed_block_mask(seq_N, pos_N, window)` when the caller already has it (layers
            that attend over the same routed tokens share one); None: built here.
    Returns:
        o_NHd: softmax(q k^T / sqrt(Dh) + mask) v.
    """
    if q_NHd.shape[0] == 0:
        return q_NHd.clone()
    if uses_flex(q_NHd, kernel):
        return routed_flex_attention(q_NHd, k_NHd, v_NHd, seq_N, pos_N, window, block_mask)
    if window is None:
        return routed_causal_attention(q_NHd, k_NHd, v_NHd, seq_N, pos_N)
    return routed_window_attention(q_NHd, k_NHd, v_NHd, seq_N, pos_N, window)


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once per process (the number of routed tokens varies: after the first recompile,
    torch.compile's automatic dynamic shapes make it a symbolic size)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.cache
def compiled_create_block_mask() -> Callable[..., object]:
    """create_block_mask compiled once per process (torch's advice; its `_compile=True` is deprecated and warns,
    which also splits an enclosing compiled graph)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def routed_block_mask(seq_N: torch.Tensor, pos_N: torch.Tensor, window: int | None) -> object:
    """FlexAttention's block mask for routed tokens (same sequence, causal and window by original position), on
    their device. It evaluates the mask on every (query, key) pair at block granularity, so layers over the same
    routed tokens (a MoEP path's `path_depth` layers) build it once. Inside a compiled block it is traced into the
    block's graph; eagerly it runs as its own compiled function."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - FlexAttention's signature
        delta = pos_N[q_idx] - pos_N[kv_idx]
        keep = (seq_N[q_idx] == seq_N[kv_idx]) & (delta >= 0)
        return keep if window is None else keep & (delta < window)

    N = seq_N.shape[0]
    build = create_block_mask if torch.compiler.is_compiling() else compiled_create_block_mask()
    return build(mask_mod, None, None, N, N, device=seq_N.device)


def routed_flex_attention(
    q_NHd: torch.Tensor,
    k_NHd: torch.Tensor,
    v_NHd: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
    window: int | None,
    block_mask: object | None = None,
) -> torch.Tensor:
    """`routed_attention` as one FlexAttention call with a block mask (`routed_block_mask`, built here unless
    given). Inside a compiled block (`train.compile`) it is traced into the block's graph; eagerly it runs as its
    own compiled function."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = routed_block_mask(seq_N, pos_N, window) if block_mask is None else block_mask
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_NHd, k_NHd, v_NHd))  # [1, H, N, Dh]
    flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    o_1HNd = flex(q, k, v, block_mask=block_mask)
    return o_1HNd.squeeze(0).transpose(0, 1)


def routed_window_attention(
    q_NHd: torch.Tensor,
    k_NHd: torch.Tensor,
    v_NHd: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
    window: int,
    chunk: int | None = None,
) -> torch.Tensor:
    """Sliding-window routed attention in O(N x (W + C)); see the module docstring. Shapes as `routed_attention`."""
    N, H, Dh = q_NHd.shape
    window, chunk = static_int(window), chunk and static_int(chunk)
    C = chunk or max(window, MIN_CHUNK)
    front = -(-(window - 1) // KEY_ALIGN) * KEY_ALIGN  # >= W-1 earlier keys per chunk; L = C + front
    back = -N % C
    # Chunk c's keys: the `front` entries before it and its own C. Entries before the first token carry
    # sequence id -1 (never visible to a real query); padding after the last one carries -2 and sees itself
    # (pos 0 - 0 < w), so no mask row is empty.
    k_cLHd, v_cLHd = (chunks_with_history(x, C, front, back, 0.0, 0.0) for x in (k_NHd, v_NHd))
    seq_cL = chunks_with_history(seq_N, C, front, back, -1, -2)
    pos_cL = chunks_with_history(pos_N, C, front, back, 0, 0)
    seq_cC, pos_cC = seq_cL[:, front:], pos_cL[:, front:]  # the chunk's own entries are its last C keys
    q_cCHd = pad_rows(q_NHd, back, 0.0).view(-1, C, H, Dh)

    delta_cCL = pos_cC[:, :, None] - pos_cL[:, None, :]
    mask_cCL = (seq_cC[:, :, None] == seq_cL[:, None, :]) & (delta_cCL >= 0) & (delta_cCL < window)
    o_cHCd = F.scaled_dot_product_attention(
        q_cCHd.transpose(1, 2), k_cLHd.transpose(1, 2), v_cLHd.transpose(1, 2), attn_mask=mask_cCL[:, None]
    )
    return o_cHCd.transpose(1, 2).reshape(-1, H, Dh)[:N]


def static_int(value: int) -> int:
    """`value` as a constant of a compiled graph. The MSIT experts share one module and pass their windows per call,
    so torch.compile sees the same frame with another window and, by its automatic dynamic shapes, makes the window
    a symbol; the chunk geometry derived from it (max, floor division) then fails to lower ("Exponent must be
    non-negative", seen at the first evaluation under train.compile). `operator.index` of a symbolic int is a
    specialisation with a guard (SymInt.__index__): one graph per window, of which there are few. Eagerly a no-op."""
    return operator.index(value)


def chunks_with_history(x_N: torch.Tensor, C: int, front: int, back: int, fill_front, fill_back) -> torch.Tensor:
    """[N, ...] -> [N/C, front + C, ...]: chunk c's C entries preceded by the `front` entries before it.

    Built from shifted views of the chunked tensor and one concatenation (whose backward is slicing), so
    forward and backward stay O(N x (front + C)).
    """
    rest = x_N.shape[1:]
    own = pad_rows(x_N, back, fill_back).view(-1, C, *rest)
    num_chunks, num_prev = own.shape[0], -(-front // C)
    if num_prev == 0:
        return own
    history = torch.cat([own.new_full((num_prev, C, *rest), fill_front), own])
    shifted = [history[num_prev - s : num_prev - s + num_chunks] for s in range(num_prev, 0, -1)]
    shifted[0] = shifted[0][:, num_prev * C - front :]
    return torch.cat([*shifted, own], 1)


def pad_rows(x_N: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x with n rows of `fill` appended (eagerly no copy when n is 0). Under torch.compile with a dynamic token count
    n is symbolic and always concatenated: a test of n == 0 would guard on N modulo the chunk, one more compiled
    graph per residue (a recompile at a later validation, up to dynamo's recompile limit)."""
    if not torch.compiler.is_compiling() and n == 0:
        return x_N
    return F.pad(x_N, (0, 0) * (x_N.dim() - 1) + (0, n), value=fill)


def routed_causal_attention(
    q_NHd: torch.Tensor,
    k_NHd: torch.Tensor,
    v_NHd: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
) -> torch.Tensor:
    """Unbounded routed attention: each sequence's run padded to P, causal by original position.

    Needs each sequence's tokens to be contiguous (any order inside a run); shapes as `routed_attention`.
    """
    N, H, Dh = q_NHd.shape
    _, run_S = torch.unique_consecutive(seq_N, return_counts=True)
    S, P = run_S.numel(), int(run_S.max())  # one host sync: the padded length
    run_N = torch.repeat_interleave(torch.arange(S, device=seq_N.device), run_S, output_size=N)
    start_S = torch.cumsum(run_S, 0) - run_S
    slot_N = torch.arange(N, device=seq_N.device) - start_S[run_N]

    def to_runs(x_NHd: torch.Tensor) -> torch.Tensor:
        out = x_NHd.new_zeros(S, P, H, Dh)
        return out.index_put((run_N, slot_N), x_NHd).transpose(1, 2)  # [S, H, P, Dh]

    valid_SP = torch.arange(P, device=seq_N.device) < run_S[:, None]
    pos_SP = pos_N.new_zeros(S, P).index_put((run_N, slot_N), pos_N)
    # Padding rows attend to themselves only, so no mask row is empty; their outputs are dropped.
    mask_SPP = valid_SP[:, None, :] & (pos_SP[:, None, :] <= pos_SP[:, :, None])
    mask_SPP |= ~valid_SP[:, :, None] & torch.eye(P, dtype=torch.bool, device=seq_N.device)
    o_SHPd = F.scaled_dot_product_attention(to_runs(q_NHd), to_runs(k_NHd), to_runs(v_NHd), attn_mask=mask_SPP[:, None])
    return o_SHPd.transpose(1, 2)[run_N, slot_N]


@dataclasses.dataclass
class RoutedKVCache:
    """Decoding cache of one routed attention: keys/values of recent tokens, each flagged routed or not.

    Unrouted tokens are kept (masked) so that every row of the batch grows in step; with a window only the
    last `window` entries are kept, since positions increase by at least one per token.
    """

    window: int | None = None
    k_BSGd: torch.Tensor | None = None
    v_BSGd: torch.Tensor | None = None
    pos_BS: torch.Tensor | None = None
    routed_BS: torch.Tensor | None = None

    def append(self, k_BTGd, v_BTGd, pos_BT, routed_BT) -> tuple[torch.Tensor, ...]:
        new = (k_BTGd, v_BTGd, pos_BT, routed_BT)
        if self.k_BSGd is None:
            merged = new
        else:
            old = (self.k_BSGd, self.v_BSGd, self.pos_BS, self.routed_BS)
            merged = tuple(torch.cat([a, b], dim=1) for a, b in zip(old, new))
        keep = slice(-self.window, None) if self.window is not None else slice(None)
        self.k_BSGd, self.v_BSGd, self.pos_BS, self.routed_BS = (t[:, keep] for t in merged)
        return merged


class RoutedSelfAttention(CausalSelfAttention):
    """The projections of `CausalSelfAttention`, applied to one expert's routed tokens only.

    forward(x_ND, seq_N, pos_N) -> [N, D]: tokens sorted by (sequence, position), O(N x window).
    forward_cached(x_BTD, routed_BT, positions_BT, cache) -> [B, T, D]: decoding with a RoutedKVCache; every
    new token is projected and routed queries attend to the cached routed keys (rows of unrouted queries are
    finite but meaningless: the caller gives them weight zero).
    """

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D], pos [...] -> q [..., H, Dh], k and v [..., G, Dh], RoPE at `pos`."""
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.w_qkv(x).split([H * Dh, G * Dh, G * Dh], -1)
        q, k, v = q.unflatten(-1, (H, Dh)), k.unflatten(-1, (G, Dh)), v.unflatten(-1, (G, Dh))
        if self.rot_dim:
            cos, sin = rope_tables(pos, self.rot_dim, self.cfg.rope)
            cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def expand_kv(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Repeat G key/value heads to H (grouped-query attention) along `dim`."""
        if self.num_kv_heads == self.num_heads:
            return x
        return x.repeat_interleave(self.num_heads // self.num_kv_heads, dim)

    def forward(self, x_ND: torch.Tensor, seq_N: torch.Tensor, pos_N: torch.Tensor,
                block_mask: object | None = None) -> torch.Tensor:
        """`block_mask`: FlexAttention's mask for these tokens and this module's window, if the caller has it."""
        return self.attend(x_ND, seq_N, pos_N, self.cfg.window, block_mask)

    def attend(self, x_ND: torch.Tensor, seq_N: torch.Tensor, pos_N: torch.Tensor, window: int | None,
               block_mask: object | None = None) -> torch.Tensor:
        """`forward` with a given window (stacked experts share one module but differ in window: MSIT)."""
        q_NHd, k_NGd, v_NGd = self.project(x_ND, pos_N)
        k_NHd, v_NHd = self.expand_kv(k_NGd, 1), self.expand_kv(v_NGd, 1)
        o_NHd = routed_attention(q_NHd, k_NHd, v_NHd, seq_N, pos_N, window, block_mask=block_mask)
        return self.w_o(o_NHd.flatten(-2))

    def forward_cached(
        self, x_BTD: torch.Tensor, routed_BT: torch.Tensor, positions_BT: torch.Tensor, cache: RoutedKVCache
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHd, k_BTGd, v_BTGd = self.project(x_BTD, positions_BT)
        k_BSGd, v_BSGd, pos_BS, routed_BS = cache.append(k_BTGd, v_BTGd, positions_BT, routed_BT)
        S = k_BSGd.shape[1]
        delta_BTS = positions_BT[:, :, None] - pos_BS[:, None, :]
        mask_BTS = routed_BS[:, None, :] & (delta_BTS >= 0)
        if cache.window is not None:  # the cache's: stacked experts share this module but not their window
            mask_BTS &= delta_BTS < cache.window
        # Each query also sees its own key, so the rows of unrouted queries are not empty (no NaN).
        mask_BTS |= torch.arange(S, device=x_BTD.device) == torch.arange(S - T, S, device=x_BTD.device)[:, None]
        o_BHTd = F.scaled_dot_product_attention(
            q_BTHd.transpose(1, 2), self.expand_kv(k_BSGd, 2).transpose(1, 2),
            self.expand_kv(v_BSGd, 2).transpose(1, 2), attn_mask=mask_BTS[:, None],
        )
        return self.w_o(o_BHTd.transpose(1, 2).flatten(-2))

    def new_cache(self) -> RoutedKVCache:
        return RoutedKVCache(window=self.cfg.window)

    # Expected share of the model's tokens routed here (set by the owning block; capacity / num_experts).
    token_share: float = 1.0

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Per model token: a share s of tokens is routed here, each seeing about s of its causal context."""
        return self.token_share**2 * super().attention_flops_per_token(seq_len)


__all__ = [
    "routed_attention", "routed_window_attention", "routed_causal_attention", "routed_flex_attention", "RoutedKVCache",
    "RoutedSelfAttention", "routed_block_mask", "uses_flex",
]
