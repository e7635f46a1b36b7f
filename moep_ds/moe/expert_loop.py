"""Experts run one after another, each through its whole FFN, with a hand-written backward (the CPU path).

# S tokens grouped by expert (counts[e] rows for expert e), E experts, D model dim, F expert hidden dim

    forward, per expert e:   h1 = x W1[e] + b1,  h3 = x W3[e] + b3,  a = act(h1) * h3,  y = a W2[e] + b2
                             (act(h1) * h3 and its backward: one fused kernel each where it pays, layers/glu.py)
    backward, per expert e:  dW2 = a^T dy,  da = dy W2^T,  dh3 = da * act(h1),  dh1 = act'(h1) * da * h3,
                             dW1 = x^T dh1,  dW3 = x^T dh3,  dx = dh1 W1^T + dh3 W3^T   (biases: column sums)

Why: on CPU, taking one expert's [n_e, F] intermediates through activation and down-projection while they
are still in cache beats running each stage over the whole [S, F] buffer (measured with bench/moe_layer.py).
Only x and the pre-activations h1, h3 are saved; a is recomputed in backward. Every result is written into
one preallocated buffer (y [S, D]; dx [S, D]; dW [E, ...]), so nothing is concatenated or stacked.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.autograd.function import once_differentiable

from moep_ds.layers.glu import GateKind, gated_activation, gated_activation_backward
from moep_ds.moe.activations import ACTIVATION_GRADS, EXPERT_ACTIVATIONS


def expert_slices(counts: tuple[int, ...]) -> Iterator[tuple[int, slice]]:
    start = 0
    for e, n in enumerate(counts):
        yield e, slice(start, start + n)
        start += n


def _empty_if(t: torch.Tensor | None, needed: bool) -> torch.Tensor | None:
    return torch.empty_like(t) if t is not None and needed else None


class ExpertLoopFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, counts, kind, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, b3_EF):  # noqa: ANN001, ANN205
        S, F = x_SD.shape[0], w1_EDF.shape[2]
        y_SD = x_SD.new_empty(S, w2_EFD.shape[2])
        h1_SF = x_SD.new_empty(S, F)
        h3_SF = x_SD.new_empty(S, F) if w3_EDF is not None else None
        for e, rows in expert_slices(counts):
            x = x_SD[rows]
            h1 = torch.mm(x, w1_EDF[e], out=h1_SF[rows])
            if b1_EF is not None:
                h1.add_(b1_EF[e])
            if w3_EDF is None:
                a = EXPERT_ACTIVATIONS[kind](h1)
            else:
                h3 = torch.mm(x, w3_EDF[e], out=h3_SF[rows])
                if b3_EF is not None:
                    h3.add_(b3_EF[e])
                a = gated_activation(kind, h1, h3)
            y = torch.mm(a, w2_EFD[e], out=y_SD[rows])
            if b2_ED is not None:
                y.add_(b2_ED[e])
        ctx.save_for_backward(x_SD, h1_SF, h3_SF, w1_EDF, w2_EFD, w3_EDF)
        ctx.counts, ctx.kind = counts, kind
        ctx.biases = (b1_EF is not None, b2_ED is not None, b3_EF is not None)
        return y_SD

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_SD):  # noqa: ANN001, ANN205
        x_SD, h1_SF, h3_SF, w1_EDF, w2_EFD, w3_EDF = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy_SD = dy_SD.contiguous()
        dx_SD = torch.empty_like(x_SD) if need[0] else None
        # written expert by expert (mm out=); only an expert without tokens is zeroed, not the whole buffer
        dw1, dw2, dw3 = (_empty_if(w, need[i]) for i, w in zip((3, 4, 5), (w1_EDF, w2_EFD, w3_EDF)))
        E = w1_EDF.shape[0]
        has_b1, has_b2, has_b3 = ctx.biases
        db1 = x_SD.new_zeros(E, w1_EDF.shape[2]) if has_b1 and need[6] else None
        db2 = x_SD.new_zeros(E, w2_EFD.shape[2]) if has_b2 and need[7] else None
        db3 = x_SD.new_zeros(E, w1_EDF.shape[2]) if has_b3 and need[8] else None
        for e, rows in expert_slices(ctx.counts):
            if rows.start == rows.stop:  # no tokens: zero weight gradients (bias buffers start at zero)
                for dw in (dw1, dw2, dw3):
                    if dw is not None:
                        dw[e].zero_()
                continue
            x, h1, dy = x_SD[rows], h1_SF[rows], dy_SD[rows]
            h3 = h3_SF[rows] if h3_SF is not None else None
            if dw2 is not None:
                a = EXPERT_ACTIVATIONS[ctx.kind](h1) if h3 is None else gated_activation(ctx.kind, h1, h3)
                torch.mm(a.t(), dy, out=dw2[e])
            if db2 is not None:
                torch.sum(dy, 0, out=db2[e])
            da = dy @ w2_EFD[e].t()
            if h3 is None:
                dh1, dh3 = ACTIVATION_GRADS[ctx.kind](da, h1), None
            else:
                dh1, dh3 = gated_activation_backward(ctx.kind, da, h1, h3)
            for dw, db, dh in ((dw1, db1, dh1), (dw3, db3, dh3)):
                if dh is not None and dw is not None:
                    torch.mm(x.t(), dh, out=dw[e])
                if dh is not None and db is not None:
                    torch.sum(dh, 0, out=db[e])
            if dx_SD is not None:
                dx = torch.mm(dh1, w1_EDF[e].t(), out=dx_SD[rows])
                if dh3 is not None:
                    dx.addmm_(dh3, w3_EDF[e].t())
        return dx_SD, None, None, dw1, dw2, dw3, db1, db2, db3


def expert_loop_ffn(
    x_SD: torch.Tensor,
    counts: list[int],
    w1_EDF: torch.Tensor,
    w2_EFD: torch.Tensor,
    w3_EDF: torch.Tensor | None,
    b1_EF: torch.Tensor | None,
    b2_ED: torch.Tensor | None,
    b3_EF: torch.Tensor | None,
    kind: GateKind,
) -> torch.Tensor:
    """All experts on tokens grouped by expert, one expert at a time (same result as grouped_expert_ffn)."""
    if sum(counts) != x_SD.shape[0]:
        raise ValueError(f"counts {list(counts)} do not sum to the {x_SD.shape[0]} rows given")
    return ExpertLoopFFN.apply(x_SD.contiguous(), tuple(counts), kind, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, b3_EF)


__all__ = ["ExpertLoopFFN", "expert_loop_ffn", "expert_slices"]
