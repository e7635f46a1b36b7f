"""Expert activations by FFN kind, and the derivative of the ungated one (for the hand-written expert-loop backward).

gelu: exact GELU (the dense GELU MLP); gelu_tanh: its tanh approximation (GPT-2, Pythia); swiglu: SiLU gate; geglu:
tanh-approximated GELU gate (Gemma). The gated kinds' product act(gate) * up and its backward are layers/glu.py's
`gated_activation(_backward)`; clamped_swiglu (gpt-oss) is a gated kind with parameters (layers/ffn.py `gate_kind`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moep_ds.layers.glu import GATE_ACTIVATIONS, gelu_tanh

Activation = Callable[[torch.Tensor], torch.Tensor]

EXPERT_ACTIVATIONS: dict[str, Activation] = {"gelu": F.gelu, "gelu_tanh": gelu_tanh, **GATE_ACTIVATIONS}

# every FFN type an expert may have: the activations above, and gated kinds with parameters
EXPERT_TYPES: tuple[str, ...] = (*EXPERT_ACTIVATIONS, "clamped_swiglu")

# grad(g, h) = g * gelu'(h), the kernel autograd itself uses
ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gelu": lambda g, h: torch.ops.aten.gelu_backward(g, h),
    "gelu_tanh": lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
}

__all__ = ["ACTIVATION_GRADS", "EXPERT_ACTIVATIONS", "EXPERT_TYPES"]
