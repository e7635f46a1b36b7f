"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), the linear attention of Qwen3-Next.

# B batch, T tokens, L chunk length, N chunks, D model dim, G key heads (num_k_heads), H value heads
# (num_v_heads, a multiple of G), K head_k_dim, V head_v_dim, C conv channels (2 G K + H V), W conv kernel

Per value head, with a state S [K, V], a decay g_t <= 0 (log space) and a write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T       (the gated delta rule, eq. 10)
    o_t = S_t^T q_t

q and k are l2-normalised and q scaled by K^-1/2; each key head serves H / G consecutive value heads. Around
the rule (Qwen3-Next): x -> in_proj_qkvz -> q, k, v, z and in_proj_ba -> b, a; [q, k, v] pass a causal
depthwise convolution of width W with SiLU; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
out = out_proj(RMSNorm(o) * silu(z)) per value head.

Training runs `chunk_gated_delta_rule` (the WY / UT form: within a chunk of L tokens the L rank-one updates
are one triangular solve; only the state passes from chunk to chunk), generation `recurrent_gated_delta_rule`
one token at a time. Both return the final state, so a prefill hands generation the state it continues from.

Parameter layout: transformers' own (Qwen3NextGatedDeltaNet), so an import maps every tensor 1:1. in_proj_qkvz's
rows are grouped per key head: for each of the G key heads [q K | k K | v (H/G) V | z (H/G) V]; in_proj_ba's
likewise [b (H/G) | a (H/G)] per key head (`split_projections` reads them). conv1d.weight is [C, 1, W] over the
channels [q (G K) | k (G K) | v (H V)].
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.registry import ATTENTIONS
from moep_ds.schema import PositiveFloat, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class GatedDeltaNetConfig:
    type: str = "gated_deltanet"
    num_k_heads: PositiveInt  # G: query/key heads
    num_v_heads: PositiveInt  # H: value heads (and states); a multiple of num_k_heads
    head_k_dim: PositiveInt  # K
    head_v_dim: PositiveInt  # V
    conv_kernel: PositiveInt = 4  # W: width of the causal depthwise convolution over q, k, v
    norm_eps: PositiveFloat = 1e-6  # of the gated RMSNorm on the output
    chunk_size: PositiveInt = 64  # L of the chunked training form (work grows as T L, the loop as T / L)

    def validate(self, path: str) -> None:
        if self.num_v_heads % self.num_k_heads:
            fail(f"{path}.num_v_heads", self.num_v_heads, f"must be a multiple of num_k_heads ({self.num_k_heads})")

    def check_dims(self, path: str, d_model: int) -> None:
        self.validate(path)

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclasses.dataclass
class GatedDeltaNetCache:
    """Decoding state of one layer: the last W - 1 inputs of the convolution [B, C, W - 1] and the rule's state
    [B, H, K, V]; None until the first forward fills them (then zeros stand for both)."""

    conv_BCW: torch.Tensor | None = None
    state_BHKV: torch.Tensor | None = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (FLA's and transformers' form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d(
    x_BTC: torch.Tensor, weight_CW: torch.Tensor, state_BCW: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal convolution): y_t[c] = silu(sum_w weight[c, w] x_{t - W + 1 + w}[c]), with the W - 1
    inputs before x taken from `state` (zeros when None). Returns y [B, T, C] and the new state [B, C, W - 1]
    (the last W - 1 inputs, a state included when T < W - 1)."""
    channels, width = weight_CW.shape
    x_BCT = x_BTC.transpose(1, 2).to(weight_CW.dtype)
    if state_BCW is None:
        state_BCW = x_BCT.new_zeros(x_BCT.shape[0], channels, width - 1)
    full_BCT = torch.cat([state_BCW.to(x_BCT.dtype), x_BCT], dim=-1)
    y_BCT = F.conv1d(full_BCT, weight_CW[:, None], groups=channels)
    return F.silu(y_BCT).transpose(1, 2).to(x_BTC.dtype), full_BCT[:, :, full_BCT.shape[-1] - (width - 1):]


def _heads_first(
    q_BTGK: torch.Tensor, k_BTGK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    normalize_qk: bool,
) -> tuple[torch.Tensor, ...]:
    """[B, H, T, ...] tensors in fp32 (fp64 stays fp64): the state multiplies many decays; q/k repeated to the
    value heads (consecutive ones share a key head), l2-normalised if asked, q scaled by K^-1/2."""
    repeat = v_BTHV.shape[2] // k_BTGK.shape[2]
    if repeat > 1:
        q_BTGK, k_BTGK = q_BTGK.repeat_interleave(repeat, 2), k_BTGK.repeat_interleave(repeat, 2)
    dtype = torch.promote_types(v_BTHV.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH))
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _initial_state(state: torch.Tensor | None, q_BHTK: torch.Tensor, v_BHTV: torch.Tensor) -> torch.Tensor:
    if state is None:
        return q_BHTK.new_zeros(*q_BHTK.shape[:2], q_BHTK.shape[-1], v_BHTV.shape[-1])
    return state.to(q_BHTK.dtype)


def chunk_gated_delta_rule(
    q_BTGK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state_BHKV: torch.Tensor | None = None,
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens in chunks of L (fp32 or fp64 inside; T need not be a multiple of L).

    Within a chunk, with Gamma the cumulative decays from the chunk's start, the L delta updates collapse into
    the UT transform (DeltaNet's WY representation, Yang et al. 2024, with the decays of Gated DeltaNet):
    (I + strict_tril(diag(beta) K K^T * Gamma_ts)) [U | W] = [diag(beta) V | diag(beta) Gamma K], one triangular
    solve for both right-hand sides. The chunk then writes V_new = U - W S to the state and reads
    O = (Q Gamma) S + tril(Q K^T * Gamma_ts) V_new. Only V_new and the state depend on the previous chunk, so
    everything else is computed for all chunks at once and the loop over chunks holds two matmuls.

    Args: q, k [B, T, G, K]; v [B, T, H, V]; g (log decay, <= 0), beta [B, T, H]; initial state [B, H, K, V].
    Returns: o [B, T, H, V] in v's dtype and the final state [B, H, K, V] in fp32 (fp64 for fp64 inputs).
    """
    seq_len, length = v_BTHV.shape[1], chunk_size
    q, k, v, g, beta = _heads_first(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, normalize_qk)
    state_BHKV = _initial_state(initial_state_BHKV, q, v)
    q, k, v, g, beta = (_chunk_major(x, length) for x in (q, k, v, g, beta))
    cum_NBHL = g.cumsum(-1)
    causal_LL = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # decay from token s to token t of a chunk; masked before exp so that nothing above the diagonal overflows
    decay_NBHLL = (cum_NBHL[..., :, None] - cum_NBHL[..., None, :]).masked_fill(~causal_LL, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay_NBHLL  # the solve reads its strict lower triangle only
    rhs = torch.cat([v * beta[..., None], k_beta * cum_NBHL.exp()[..., None]], -1)
    u_NBHLV, w_NBHLK = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], -1)
    k_to_end_NBHKL = (k * (cum_NBHL[..., -1:] - cum_NBHL).exp()[..., None]).transpose(-1, -2)
    starts_NBHKV, v_new_NBHLV, state_BHKV = _scan_chunks(
        u_NBHLV, w_NBHLK, k_to_end_NBHKL, cum_NBHL[..., -1].exp(), state_BHKV)
    o_NBHLV = (q * cum_NBHL.exp()[..., None]) @ starts_NBHKV + ((q @ k.transpose(-1, -2)) * decay_NBHLL) @ v_new_NBHLV
    o_BTHV = o_NBHLV.permute(1, 0, 3, 2, 4).flatten(1, 2)[:, :seq_len]
    return o_BTHV.to(v_BTHV.dtype), state_BHKV


def _chunk_major(x_BHT: torch.Tensor, length: int) -> torch.Tensor:
    """[B, H, T, ...] -> [N, B, H, L, ...], T padded to N L with zeros (padded tokens: k = 0, beta = 0, g = 0
    leave the state as it is). Chunk-major and contiguous: every matmul batches over (N, B, H) without a copy,
    and the loop over chunks takes contiguous slices."""
    pad = -x_BHT.shape[2] % length
    x = F.pad(x_BHT, (0, 0) * (x_BHT.dim() - 3) + (0, pad)).unflatten(2, (-1, length))
    return x.movedim(2, 0).contiguous()


def _scan_chunks(
    u_NBHLV: torch.Tensor, w_NBHLK: torch.Tensor, k_to_end_NBHKL: torch.Tensor, decay_NBH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence across chunks: V_new = U - W S; S <- decay S + (K to_end)^T V_new. Returns the state at
    each chunk's start [N, B, H, K, V], V_new [N, B, H, L, V] and the final state [B, H, K, V]."""
    N, B, H = decay_NBH.shape
    # (B H) flattened, so that each step is two batched matmuls (baddbmm); unbind, not indexing: the backward of
    # x[n] writes a gradient the size of all of x at every step (quadratic in N)
    u, w, k_t = (x.flatten(1, 2).unbind(0) for x in (u_NBHLV, w_NBHLK, k_to_end_NBHKL))
    decay = decay_NBH.reshape(N, B * H, 1, 1).unbind(0)
    state = state_BHKV.flatten(0, 1)
    starts, news = [], []
    for n in range(N):
        starts.append(state)
        v_new = torch.baddbmm(u[n], w[n], state, alpha=-1.0)
        state = torch.baddbmm(state * decay[n], k_t[n], v_new)
        news.append(v_new)
    return torch.stack(starts).unflatten(1, (B, H)), torch.stack(news).unflatten(1, (B, H)), state.unflatten(0, (B, H))


def recurrent_gated_delta_rule(
    q_BTGK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    *,
    initial_state_BHKV: torch.Tensor | None = None,
    normalize_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (generation): S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
    o_t = S^T q_t. Same arguments and returns as `chunk_gated_delta_rule`."""
    q, k, v, g, beta = _heads_first(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, normalize_qk)
    state = _initial_state(initial_state_BHKV, q, v)  # [B, H, K, V]
    outs = []
    for t in range(v.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        remembered_BH1V = k[:, :, t, None] @ state  # what the state already returns for k_t
        delta_BH1V = (v[:, :, t, None] - remembered_BH1V) * beta[:, :, t, None, None]
        state = state + k[:, :, t, :, None] @ delta_BH1V
        outs.append(q[:, :, t, None] @ state)
    o_BTHV = torch.cat(outs, 2).transpose(1, 2)
    return o_BTHV.to(v_BTHV.dtype), state


def gated_rms_norm(x_BTHV: torch.Tensor, z_BTHV: torch.Tensor, weight_V: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * silu(z) per head (Qwen3NextRMSNormGated: normalised in fp32, cast back before the
    scale, gated in fp32)."""
    x32 = x_BTHV.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_BTHV.dtype)
    return (weight_V * normed * F.silu(z_BTHV.float())).to(x_BTHV.dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with its [V] scale as `weight` (transformers' `norm.weight`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def split_projections(
    qkvz_BTX: torch.Tensor, ba_BTY: torch.Tensor, cfg: GatedDeltaNetConfig
) -> tuple[torch.Tensor, ...]:
    """Reads the per-key-head grouped rows (module docstring) into q, k [B, T, G, K], v, z [B, T, H, V] and
    b, a [B, T, H]."""
    G, K, V, per_group = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    q, k, v, z = qkvz_BTX.unflatten(-1, (G, -1)).split([K, K, per_group * V, per_group * V], -1)
    b, a = ba_BTY.unflatten(-1, (G, -1)).split([per_group, per_group], -1)
    v, z = (x.reshape(*x.shape[:2], -1, V) for x in (v, z))
    return q, k, v, z, b.flatten(2), a.flatten(2)


@ATTENTIONS.register("gated_deltanet", config=GatedDeltaNetConfig)
class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention layer (module docstring); the parameters are Qwen3NextGatedDeltaNet's."""

    def __init__(self, cfg: GatedDeltaNetConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        G, H, K, V = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        self.in_proj_qkvz = nn.Linear(d_model, 2 * G * K + 2 * H * V, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * H, bias=False)
        channels = cfg.conv_channels
        self.conv1d = nn.Conv1d(channels, channels, cfg.conv_kernel, groups=channels, bias=False)
        # parameters of their own, not Linear biases: model-wide inits would draw them as weights or zero them
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(V, cfg.norm_eps)
        self.out_proj = nn.Linear(H * V, d_model, bias=False)
        self.reset_rule_parameters()

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """As transformers initialises Qwen3-Next: projections and the convolution Normal(0, std) (out_proj, a
        residual output, std * out_scale), then the rule's own parameters."""
        for weight in (self.in_proj_qkvz.weight, self.in_proj_ba.weight, self.conv1d.weight):
            nn.init.normal_(weight, std=std)
        nn.init.normal_(self.out_proj.weight, std=std * out_scale)
        self.reset_rule_parameters()

    @torch.no_grad()
    def reset_rule_parameters(self) -> None:
        """dt_bias 1, A = exp(A_log) uniform in [0.01, 16] (kept off 0 so A_log is finite), norm scale 1."""
        nn.init.ones_(self.dt_bias)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        nn.init.ones_(self.norm.weight)

    def forward(
        self, x_BTD: torch.Tensor, positions_BT: torch.Tensor | None = None, cache: GatedDeltaNetCache | None = None
    ) -> torch.Tensor:
        """Positions are not used (the recurrence orders the tokens). With a cache, continues from its state
        and leaves the final one in it; a single cached token takes the recurrent form."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        q, k, v, z, b, a = split_projections(self.in_proj_qkvz(x_BTD), self.in_proj_ba(x_BTD), cfg)
        qkv_BTC = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
        conv_state = cache.conv_BCW if cache is not None else None
        qkv_BTC, conv_state = causal_conv1d(qkv_BTC, self.conv1d.weight[:, 0], conv_state)
        q, k, v = qkv_BTC.split([cfg.num_k_heads * cfg.head_k_dim] * 2 + [cfg.num_v_heads * cfg.head_v_dim], -1)
        q, k = (x.unflatten(-1, (cfg.num_k_heads, cfg.head_k_dim)) for x in (q, k))
        v = v.unflatten(-1, (cfg.num_v_heads, cfg.head_v_dim))
        beta, g = b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        state = cache.state_BHKV if cache is not None else None
        if state is not None and T == 1:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state_BHKV=state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=cfg.chunk_size, initial_state_BHKV=state)
        if cache is not None:
            cache.conv_BCW, cache.state_BHKV = conv_state.detach(), state.detach()
        return self.out_proj(self.norm(o, z).flatten(2))

    def new_cache(self) -> GatedDeltaNetCache:
        return GatedDeltaNetCache()

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs per token of the chunked rule (the projections count as parameters), per value
        head: within its chunk Q K^T and the UT system's K K^T (2 L K each), the triangular solve for U and W
        (L (K + V): half an L x L matrix times K + V columns), the intra-chunk read of V_new (2 L V); across chunks
        W S, K^T V_new and Q S (2 K V each). Forward x 3 for forward + backward; elementwise decays not counted."""
        cfg = self.cfg
        L, K, V = min(cfg.chunk_size, seq_len), cfg.head_k_dim, cfg.head_v_dim
        return 3.0 * cfg.num_v_heads * (4 * L * K + L * (K + V) + 2 * L * V + 6 * K * V)


__all__ = ["GatedDeltaNet", "GatedDeltaNetCache", "GatedDeltaNetConfig", "GatedRMSNorm", "causal_conv1d",
           "chunk_gated_delta_rule", "gated_rms_norm", "l2norm", "recurrent_gated_delta_rule", "split_projections"]
