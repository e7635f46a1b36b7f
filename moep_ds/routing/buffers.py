"""Router state that keeps its own dtypes when the model is cast."""
from typing import Callable

import torch
from torch import nn


class KeepBufferDtypes(nn.Module):
    """A module whose buffers keep their dtypes through model.half()/.bfloat16() (DeepSpeed casts the model):
    counts, biases and EMAs rounded to 16 bits would lose the small steps they accumulate."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        dtypes = {name: buf.dtype for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
        return self
