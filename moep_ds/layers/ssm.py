"""Gated diagonal selective state-space layer (MoE-Stream's sequence mixer).

# B batch, T sequence length, L chunk length, D model dim, C inner channels (expand * D), N state size,
# R rank of the step projection

Per channel c and state index n, with input-dependent step dt_t[c] and input-dependent B_t, C_t:

    a_t[c]      = exp(-dt_t[c] * exp(A_log[c]))                     (decay in (0, 1))
    h_t[c, n]   = a_t[c] * h_{t-1}[c, n] + dt_t[c] * B_t[n] * u_t[c]
    y_t[c]      = sum_n C_t[n] * h_t[c, n] + D[c] * u_t[c]
    out_t       = w_out(y_t * silu(gate_t))

The decay is one scalar per channel, shared by its N states (as in Mamba-2 with one channel per head): that
keeps the within-chunk decay matrix at [B, L, L, C] and lets the chunked scan be exact in closed form.
Training uses `selective_scan_chunked` (O(T * L) work, a Python loop over T / L chunks only); generation
uses `selective_scan_step`, one token at a time. Both carry the state h [B, C, N] across calls.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.registry import MIXERS
from moep_ds.schema import Gt, PositiveFloat, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class SSMConfig:
    type: str = "ssm"
    expand: PositiveInt = 2  # inner channels C = expand * d_model
    state_size: PositiveInt = 16  # N states per channel
    dt_rank: PositiveInt | None = None  # rank of the step projection; None = ceil(d_model / 16)
    chunk_size: PositiveInt = 16  # L: work and memory of the scan grow as B * T * L * C
    dt_min: PositiveFloat = 1e-3  # initial steps are log-uniform in [dt_min, dt_max]
    dt_max: PositiveFloat = 1e-1
    a_init_max: Annotated[float, Gt(1.0)] = 16.0  # exp(A_log) starts uniform in [1, a_init_max]
    bias: bool = False  # on in_proj / w_out

    def validate(self, path: str) -> None:
        if self.dt_min > self.dt_max:
            fail(f"{path}.dt_min", self.dt_min, f"must be <= dt_max ({self.dt_max})")


@dataclasses.dataclass
class SSMCache:
    """Decoding state of one SSM layer; `h_BCN` is None until the first forward fills it."""

    h_BCN: torch.Tensor | None = None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # the recurrence multiplies many decays; never run it below fp32
    return torch.promote_types(dtype, torch.float32)


def selective_scan_chunked(
    u_BTC: torch.Tensor,
    dt_BTC: torch.Tensor,
    A_C: torch.Tensor,
    B_BTN: torch.Tensor,
    C_BTN: torch.Tensor,
    D_C: torch.Tensor,
    h0_BCN: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring over all T steps, chunk by chunk.

    Within a chunk, h_t = exp(S_t) h_0 + sum_{s<=t} exp(S_t - S_s) dt_s B_s u_s with S the cumulative
    log-decay from the chunk start ("segsum"); exp(S_t - S_s) <= 1, so nothing overflows. The chunk's
    final state is carried into the next chunk. T need not be a multiple of `chunk_size`.

    Args: u, dt [B, T, C]; A [C] (positive, decay rate); B, C [B, T, N]; D [C]; h0 [B, C, N] or None.
    Returns: y [B, T, C] in u's dtype, and the final state h [B, C, N] in the compute dtype (>= fp32).
    """
    batch, seq_len, channels = u_BTC.shape
    dtype = _compute_dtype(u_BTC.dtype)
    u, dt, A = u_BTC.to(dtype), dt_BTC.to(dtype), A_C.to(dtype)
    Bm, Cm = B_BTN.to(dtype), C_BTN.to(dtype)
    h = h0_BCN.to(dtype) if h0_BCN is not None else u.new_zeros(batch, channels, Bm.shape[-1])
    log_a_BTC = -dt * A
    xbar_BTC = dt * u
    ys = []
    for start in range(0, seq_len, chunk_size):
        chunk = slice(start, start + chunk_size)
        y_BLC, h = _scan_one_chunk(log_a_BTC[:, chunk], xbar_BTC[:, chunk], Bm[:, chunk], Cm[:, chunk], h)
        ys.append(y_BLC)
    y = torch.cat(ys, dim=1) + u * D_C.to(dtype)
    return y.to(u_BTC.dtype), h


def _scan_one_chunk(
    log_a_BLC: torch.Tensor, xbar_BLC: torch.Tensor, B_BLN: torch.Tensor, C_BLN: torch.Tensor, h_BCN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the scan (without the D skip): returns y [B, L, C] and the state after the chunk."""
    length = log_a_BLC.shape[1]
    cum_BLC = torch.cumsum(log_a_BLC, dim=1)
    # decay from step s to step t (s <= t); the mask goes in before exp so the upper triangle is exactly 0
    seg_BLLC = cum_BLC[:, :, None, :] - cum_BLC[:, None, :, :]
    causal_LL = torch.ones(length, length, dtype=torch.bool, device=seg_BLLC.device).tril()
    decay_BLLC = torch.exp(seg_BLLC.masked_fill(~causal_LL[None, :, :, None], float("-inf")))
    gram_BLL = torch.einsum("btn,bsn->bts", C_BLN, B_BLN)  # C_t . B_s
    # an explicit product-sum: a 3-operand einsum here runs ~2x slower on CPU and saves nothing on memory
    y_intra = (decay_BLLC * gram_BLL[..., None] * xbar_BLC[:, None, :, :]).sum(2)
    y_state = torch.exp(cum_BLC) * torch.einsum("btn,bcn->btc", C_BLN, h_BCN)
    to_end_BLC = torch.exp(cum_BLC[:, -1:, :] - cum_BLC)  # decay from step s to the chunk's end
    h_next = torch.exp(cum_BLC[:, -1, :, None]) * h_BCN + torch.einsum("bsc,bsn->bcn", to_end_BLC * xbar_BLC, B_BLN)
    return y_intra + y_state, h_next


def selective_scan_step(
    u_BC: torch.Tensor,
    dt_BC: torch.Tensor,
    A_C: torch.Tensor,
    B_BN: torch.Tensor,
    C_BN: torch.Tensor,
    D_C: torch.Tensor,
    h_BCN: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the recurrence: returns y [B, C] (u's dtype) and the new state h [B, C, N]."""
    dtype = _compute_dtype(u_BC.dtype)
    u, dt, Bm, Cm = u_BC.to(dtype), dt_BC.to(dtype), B_BN.to(dtype), C_BN.to(dtype)
    if h_BCN is None:
        h_BCN = u.new_zeros(u.shape[0], u.shape[1], Bm.shape[-1])
    a_BC = torch.exp(-dt * A_C.to(dtype))
    h = a_BC[..., None] * h_BCN.to(dtype) + (dt * u)[..., None] * Bm[:, None, :]
    y = torch.einsum("bcn,bn->bc", h, Cm) + D_C.to(dtype) * u
    return y.to(u_BC.dtype), h


@MIXERS.register("ssm", config=SSMConfig)
class SSM(nn.Module):
    """x -> in_proj -> (u, gate); selective scan over u; w_out(y * silu(gate))."""

    def __init__(self, cfg: SSMConfig, d_model: int):
        super().__init__()
        self.cfg = cfg
        channels = cfg.expand * d_model
        self.dt_rank = cfg.dt_rank or math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * channels, bias=cfg.bias)
        # one projection yields the low-rank step input and the input-dependent B_t, C_t (Mamba's x_proj)
        self.x_proj = nn.Linear(channels, self.dt_rank + 2 * cfg.state_size, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, channels, bias=False)
        # a separate parameter, not a Linear bias: model-wide inits zero Linear biases, and this one sets the
        # initial step sizes
        self.dt_bias = nn.Parameter(torch.empty(channels))
        self.A_log = nn.Parameter(torch.empty(channels))
        self.D = nn.Parameter(torch.empty(channels))
        self.w_out = nn.Linear(channels, d_model, bias=cfg.bias)  # named like the other residual-branch outputs
        self.reset_ssm_parameters()

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """Projections Normal(0, std) like the model's linear layers (w_out, a residual output, std * out_scale);
        then the scan's own parameters."""
        for linear in (self.in_proj, self.x_proj, self.dt_proj, self.w_out):
            nn.init.normal_(linear.weight, std=std * out_scale if linear is self.w_out else std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba's init: steps log-uniform in [dt_min, dt_max] through softplus^-1, rates uniform in [1, a_max]."""
        cfg = self.cfg
        log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(cfg.dt_min), math.log(cfg.dt_max))
        dt = log_dt.exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, cfg.a_init_max).log())
        self.D.fill_(1.0)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> u, gate, dt [..., C] and B, C [..., N]."""
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        dt_in, B, C = self.x_proj(u).split([self.dt_rank, self.cfg.state_size, self.cfg.state_size], dim=-1)
        dt = F.softplus(self.dt_proj(dt_in).float() + self.dt_bias.float())
        return u, gate, dt, B, C

    def forward(self, x_BTD: torch.Tensor, cache: SSMCache | None = None) -> torch.Tensor:
        """Parallel (chunked) mode. With a cache, starts from its state and leaves the final state in it."""
        u, gate, dt, B, C = self._project(x_BTD)
        h0 = cache.h_BCN if cache is not None else None
        y, h = selective_scan_chunked(u, dt, self.A_log.exp(), B, C, self.D, h0, self.cfg.chunk_size)
        if cache is not None:
            cache.h_BCN = h.detach()
        return self.w_out(y * F.silu(gate))

    def step(self, x_BD: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent mode for generation: one token x [B, D] and state [B, C, N] (None = zeros)."""
        u, gate, dt, B, C = self._project(x_BD)
        y, h = selective_scan_step(u, dt, self.A_log.exp(), B, C, self.D, state)
        return self.w_out(y * F.silu(gate)), h

    def new_cache(self) -> SSMCache:
        return SSMCache()

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the scan itself (the projections are counted as parameters): per chunk
        position, the masked L x L decay-weighted mix over C channels, the C_t . B_s Gram row and the state
        terms, forward x 3 for forward + backward."""
        length, channels, n_state = min(self.cfg.chunk_size, seq_len), self.w_out.in_features, self.cfg.state_size
        return 3.0 * (3 * length * channels + 2 * length * n_state + 4 * channels * n_state)


__all__ = ["SSMConfig", "SSMCache", "SSM", "selective_scan_chunked", "selective_scan_step"]
