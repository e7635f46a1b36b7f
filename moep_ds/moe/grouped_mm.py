"""Grouped matmul: y[rows of expert e] = x[rows of expert e] @ w[e], for tokens grouped by expert.

# S tokens grouped by expert (counts[e] rows for expert e), E experts, D in dim, F out dim, C = S / E

Forward and backward write straight into preallocated buffers (`mm(..., out=slice)`): no concatenation of
per-expert outputs and, in backward, the weight gradient [E, D, F] is filled expert by expert instead of being
stacked from E separate gradients (what autograd does for `w.unbind(0)`) or summed from E full-size zero-padded
ones (what it does for `w[e]`).

Equal loads (expert choice) run as one bmm on accelerators. On CPU a loop of mm is used throughout: measured
with bench/moe_layer.py, CPU bmm is up to 2x slower than per-expert mm for the weight gradient x^T g.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def use_bmm(x: torch.Tensor, counts: tuple[int, ...]) -> bool:
    return x.device.type != "cpu" and len(set(counts)) == 1


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


__all__ = ["grouped_mm", "grouped_matmul", "grouped_weight_grad"]
