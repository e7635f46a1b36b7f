"""Grouped matmul: y[rows of expert e] = x[rows of expert e] @ w[e], for tokens grouped by expert.

# S tokens grouped by expert (counts[e] rows for expert e), E experts, D in dim, F out dim, C = S / E

Forward and backward write straight into preallocated buffers (`mm(..., out=slice)`): no concatenation of
per-expert outputs and, in backward, the weight gradient [E, D, F] is filled expert by expert instead of being
stacked from E separate gradients (what autograd does for `w.unbind(0)`) or summed from E full-size zero-padded
ones (what it does for `w[e]`).

Equal loads (expert choice) run as one bmm on accelerators. On CPU a loop of mm is used throughout: measured
with bench/moe_layer.py, CPU bmm is up to 2x slower than per-expert mm for the weight gradient x^T g.

Uneven loads can instead run as torch's library kernel `torch.nn.functional.grouped_mm` (one call per matmul over
all experts, with its own backward; on CUDA a grouped GEMM, on CPU a loop in C++): `library_grouped_mm`. It
needs int32 offsets, 16-byte-aligned row strides and, in backward, a contiguous incoming gradient (ensured
here). The per-expert loop above stays the reference the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moep_ds.routing.plan import counts_on


def use_bmm(x: torch.Tensor, counts: tuple[int, ...]) -> bool:
    return x.device.type != "cpu" and len(set(counts)) == 1


def library_supports(x_SD: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these operands: float32 on CPU, bf16 on CUDA (its grouped GEMM needs
    compute capability 8.0+), rows of a multiple of 16 bytes."""
    if x_SD.dtype != w_EDF.dtype or x_SD.dim() != 2 or w_EDF.dim() != 3:
        return False
    if x_SD.device.type == "cuda":
        # get_device_properties, not get_device_capability: torch.compile folds the former to a constant (its
        # constant_fold_functions), the latter it does not
        ok_dtype = x_SD.dtype == torch.bfloat16 and torch.cuda.get_device_properties(x_SD.device).major >= 8
    else:
        ok_dtype = x_SD.device.type == "cpu" and x_SD.dtype == torch.float32
    size = x_SD.element_size()
    return ok_dtype and (x_SD.shape[1] * size) % 16 == 0 and (w_EDF.shape[2] * size) % 16 == 0


def expert_offsets(counts: tuple[int, ...] | list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """offs [E] int32: end row of each expert's group (a cumulative sum on the device for a counts tensor;
    a host-to-device copy for known counts; neither waits for the device)."""
    if isinstance(counts, torch.Tensor):
        return torch.cumsum(counts_on(counts, device), 0).to(torch.int32)
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (F.grouped_mm's backward requires it)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g.contiguous()


def library_grouped_mm(x_SD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[S, D] x [E, D, F] -> [S, F] with torch's grouped_mm; offs_E from `expert_offsets` (shared by the calls
    of one expert FFN)."""
    if x_SD.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return eager_grouped_mm(x_SD, w_EDF, offs_E)
    return ContiguousGrad.apply(F.grouped_mm(x_SD.contiguous(), w_EDF, offs=offs_E))


@torch.compiler.disable
def eager_grouped_mm(x_SD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """library_grouped_mm outside the compiled graph: torch's fake (meta) grouped_mm admits only bf16, so fp32
    (which the CPU kernel does take) cannot be traced."""
    return ContiguousGrad.apply(F.grouped_mm(x_SD.contiguous(), w_EDF, offs=offs_E))


def grouped_matmul(x_SD: torch.Tensor, w_EDF: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """[S, D] x [E, D, F] -> [S, F] (no autograd; see grouped_mm)."""
    E, _, F = w_EDF.shape
    out_SF = x_SD.new_empty(x_SD.shape[0], F)
    if use_bmm(x_SD, counts):
        torch.bmm(x_SD.view(E, counts[0], w_EDF.shape[1]), w_EDF, out=out_SF.view(E, counts[0], F))
        return out_SF
    start = 0
    for e, n in enumerate(counts):
        torch.mm(x_SD[start : start + n], w_EDF[e], out=out_SF[start : start + n])
        start += n
    return out_SF


def grouped_weight_grad(x_SD: torch.Tensor, g_SF: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """dL/dw [E, D, F] = x_e^T g_e per expert (zero for an expert without tokens)."""
    E, D, F = len(counts), x_SD.shape[1], g_SF.shape[1]
    grad_EDF = x_SD.new_empty(E, D, F)
    if use_bmm(x_SD, counts):
        C = counts[0]
        torch.bmm(x_SD.view(E, C, D).transpose(1, 2), g_SF.view(E, C, F), out=grad_EDF)
        return grad_EDF
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            grad_EDF[e].zero_()
        else:
            torch.mm(x_SD[start : start + n].t(), g_SF[start : start + n], out=grad_EDF[e])
        start += n
    return grad_EDF


class GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, w_EDF: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x_SD, w_EDF)
        ctx.counts = counts
        return grouped_matmul(x_SD, w_EDF, counts)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_SF: torch.Tensor):  # noqa: ANN001, ANN205
        x_SD, w_EDF = ctx.saved_tensors
        g_SF = g_SF.contiguous()
        grad_x = grouped_matmul(g_SF, w_EDF.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        grad_w = grouped_weight_grad(x_SD, g_SF, ctx.counts) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_mm(x_SD: torch.Tensor, w_EDF: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Differentiable grouped matmul: rows of expert e (counts[e] of them, in order) times w_EDF[e]."""
    if sum(counts) != x_SD.shape[0] or len(counts) != w_EDF.shape[0]:
        raise ValueError(f"counts {list(counts)} do not split {x_SD.shape[0]} rows over {w_EDF.shape[0]} experts")
    return GroupedMatmul.apply(x_SD.contiguous(), w_EDF, tuple(counts))


__all__ = ["expert_offsets", "grouped_matmul", "grouped_mm", "grouped_weight_grad", "library_grouped_mm",
           "library_supports"]
