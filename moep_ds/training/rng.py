"""This rank's random-number streams as a checkpoint stores them (training/checkpoint.py restores them)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Tensors, tuples and numbers only (torch.load(weights_only=True) reads them back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out
