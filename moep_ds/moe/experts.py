"""Grouped FFN experts with stacked weights: GELU MLP, SwiGLU, GeGLU.

# E experts (local to this rank), S tokens grouped by expert, C tokens per expert when all are equal,
# D model dim, F expert hidden dim

    gelu:   y = W2 gelu(W1 x + b1) + b2             gelu_tanh: the same with tanh-approximated GELU (GPT-2, Pythia)
    swiglu: y = W2 (silu(W1 x) * W3 x)          geglu: the same with tanh-approximated GELU (Gemma)
    clamped_swiglu (gpt-oss): y = W2 ((clamp(W3 x + b3, -l, l) + 1) g sigmoid(alpha g)) + b2, g = min(W1 x + b1, l)
    (the gated product act(.) * . runs as one fused kernel per direction where it pays: layers/glu.py)

Each expert is initialised and computed exactly like the dense FFN of the same kind (moep_ds.layers.ffn).
Weights are stacked (w1_EDF, w3_EDF, w2_EFD) and applied to one expert-sorted token buffer. Kernels
(`GroupedExperts.kernel`; None picks by device and load, as measured with bench/moe_layer.py):
  "library"  uneven loads: each stage is one torch.nn.functional.grouped_mm over all experts (CUDA bf16:
             grouped GEMM; CPU fp32: measured faster than the loops below for top-2 loads)
  "grouped"  each stage a grouped matmul (moe/grouped_mm.py): one batched matmul when every expert has the
             same load, as in expert choice (accelerators), per-expert slices otherwise
  "loop"     the experts one after another through their whole FFN with a hand-written backward
             (moe/expert_loop.py), which keeps each expert's intermediates in cache (CPU, equal loads)
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from moep_ds.deferred_init import init_at_construction
from moep_ds.layers.ffn import GATED, FFNConfig, ffn_hidden_size, gate_kind
from moep_ds.layers.glu import GateKind, gated_activation
from moep_ds.moe.activations import EXPERT_ACTIVATIONS, EXPERT_TYPES
from moep_ds.moe.expert_loop import expert_loop_ffn
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.moe.shard import mark_expert_rows, normal_
from moep_ds.moe.stacked import keep_expert_slice_
from moep_ds.moe.grouped_mm import expert_offsets, grouped_mm, library_grouped_mm, library_supports
from moep_ds.routing.plan import counts_on

KERNELS = ("library", "grouped", "loop")


def expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    b3: torch.Tensor | None,
    kind: GateKind,
) -> torch.Tensor:
    """One expert: [C, D] tokens, its [D, F] / [F, D] weights (the definition; see grouped_expert_ffn)."""
    h = x @ w1 if b1 is None else x @ w1 + b1
    if w3 is None:
        h = EXPERT_ACTIVATIONS[kind](h)
    else:
        h = gated_activation(kind, h, x @ w3 if b3 is None else x @ w3 + b3, consume=True)
    y = h @ w2
    return y if b2 is None else y + b2


def grouped_expert_ffn(
    x_SD: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    w3_EDF: torch.Tensor | None,
    b1_EF: torch.Tensor | None,
    b2_ED: torch.Tensor | None,
    b3_EF: torch.Tensor | None,
    kind: GateKind,
    *,
    library: bool = False,
) -> torch.Tensor:
    """All experts at once on tokens grouped by expert: expert_ffn with grouped matmuls (`library`: torch's
    F.grouped_mm, which also takes the counts as a device tensor, no copy to the host; else moe/grouped_mm.py,
    which takes Python ints)."""

    def per_token(b_EX: torch.Tensor) -> torch.Tensor:  # [E, X] -> [S, X], each token its expert's bias
        repeats = counts_on(counts, b_EX.device)
        return b_EX.repeat_interleave(repeats, dim=0, output_size=x_SD.shape[0])

    if library:
        offs_E = expert_offsets(counts, x_SD.device)
        mm = lambda x, w: library_grouped_mm(x, w, offs_E)  # noqa: E731
    else:
        mm = lambda x, w: grouped_mm(x, w, counts)  # noqa: E731
    h_SF = mm(x_SD, w1_EDF)
    h_SF = h_SF if b1_EF is None else h_SF + per_token(b1_EF)
    if w3_EDF is None:
        h_SF = EXPERT_ACTIVATIONS[kind](h_SF)
    else:
        up_SF = mm(x_SD, w3_EDF)
        h_SF = gated_activation(kind, h_SF, up_SF if b3_EF is None else up_SF + per_token(b3_EF), consume=True)
    y_SD = mm(h_SF, w2_EFD)
    return y_SD if b2_ED is None else y_SD + per_token(b2_ED)


def choose_kernel(x_SD: torch.Tensor, w_EDF: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> str:
    """Uneven loads (and counts only the device has: a data-dependent load): F.grouped_mm where it takes the
    operands; equal loads: one bmm per stage on accelerators, the expert loop on CPU (where CPU bmm is slower)."""
    uneven = isinstance(counts, torch.Tensor) or len(set(counts)) > 1
    if uneven and library_supports(x_SD, w_EDF):
        return "library"
    return "loop" if x_SD.device.type == "cpu" else "grouped"


class GroupedExperts(nn.Module):
    """E experts of one FFN kind; holds only expert parameters (the trainer shards and marks all of them).

    `forward(x_SD, counts)` takes tokens grouped by expert, counts[e] tokens for local expert e: Python ints,
    or an [E] tensor on x's device, which the library kernel uses without a copy to the host (the other
    kernels copy it).
    """

    def __init__(self, cfg: FFNConfig, *, d_model: int, num_experts: int, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        if cfg.type not in EXPERT_TYPES:
            raise ValueError(f"expert type ({cfg.type!r}) must be one of {', '.join(EXPERT_TYPES)}")
        hidden = ffn_hidden_size(cfg, d_model)
        self.kind: GateKind = gate_kind(cfg) if cfg.type in GATED else cfg.type
        held = plan.held(num_experts)  # all of them on one process
        self.num_local_experts = len(held)
        self.kernel: str | None = None  # one of KERNELS; None: chosen per call (`choose_kernel`)
        E, D, Fh = len(held), d_model, hidden
        self.w1_EDF = nn.Parameter(torch.empty(E, D, Fh))
        self.w3_EDF = nn.Parameter(torch.empty(E, D, Fh)) if cfg.type in GATED else None
        self.w2_EFD = nn.Parameter(torch.empty(E, Fh, D))
        self.b1_EF = nn.Parameter(torch.empty(E, Fh)) if cfg.bias else None
        self.b3_EF = nn.Parameter(torch.empty(E, Fh)) if cfg.bias and cfg.type in GATED else None
        self.b2_ED = nn.Parameter(torch.empty(E, D)) if cfg.bias else None
        for p in self.parameters():
            mark_expert_rows(p, held.start, num_experts)
        if not self.w1_EDF.is_meta and init_at_construction():
            self.init_weights(std=0.02)

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """Normal(0, std) like the model's linear layers; the output projection w2 gets std * out_scale."""
        for name, p in self.named_parameters():
            if name.startswith("b"):
                nn.init.zeros_(p)
            else:
                normal_(p, std=std * out_scale if name.startswith("w2") else std)

    def params_per_expert(self) -> int:
        return sum(p[0].numel() for p in self.parameters())

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        return self.w1_EDF, self.w2_EFD, self.w3_EDF, self.b1_EF, self.b2_ED, self.b3_EF

    def forward(self, x_SD: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if len(counts) != self.num_local_experts:
            raise ValueError(f"got token counts for {len(counts)} experts, this module holds {self.num_local_experts}")
        # The custom autograd functions run outside autocast: compute in the weights' dtype.
        x = x_SD.to(self.w1_EDF.dtype)
        kernel = self.kernel or choose_kernel(x, self.w1_EDF, counts)
        if isinstance(counts, torch.Tensor) and kernel != "library":
            counts = counts.tolist()  # the other kernels loop over experts in Python
        if kernel == "loop":
            return expert_loop_ffn(x, counts, *self.weights(), self.kind).to(x_SD.dtype)
        library = kernel == "library"
        return grouped_expert_ffn(x, counts, *self.weights(), self.kind, library=library).to(x_SD.dtype)

    def keep_experts_(self, start: int, count: int) -> None:
        """Keep experts [start, start + count) only (expert parallelism: this rank's shard)."""
        keep_expert_slice_(self, start, count, self.num_local_experts)
        self.num_local_experts = count

    def extra_repr(self) -> str:
        return f"kind={self.kind}, num_local_experts={self.num_local_experts}, hidden={self.w1_EDF.shape[-1]}"


__all__ = ["EXPERT_ACTIVATIONS", "EXPERT_TYPES", "KERNELS", "GroupedExperts", "choose_kernel", "expert_ffn",
           "grouped_expert_ffn"]
