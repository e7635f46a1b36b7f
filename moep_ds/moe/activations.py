"""Expert activations by FFN kind, and their derivatives (for the hand-written expert-loop backward).

gelu: exact GELU (the dense GELU MLP); swiglu: SiLU gate; geglu: tanh-approximated GELU gate (Gemma).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moep_ds.layers.glu import gelu_tanh

Activation = Callable[[torch.Tensor], torch.Tensor]

EXPERT_ACTIVATIONS: dict[str, Activation] = {"gelu": F.gelu, "swiglu": F.silu, "geglu": gelu_tanh}

# grad(g, h) = g * act'(h), the kernels autograd itself uses for these activations
ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gelu": lambda g, h: torch.ops.aten.gelu_backward(g, h),
    "swiglu": lambda g, h: torch.ops.aten.silu_backward(g, h),
    "geglu": lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
}

__all__ = ["ACTIVATION_GRADS", "EXPERT_ACTIVATIONS"]
