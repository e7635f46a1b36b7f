"""Running statistics that a forward pass updates, and the activation-checkpoint recomputation that must not.

Activation checkpointing runs a block's forward a second time during backward to rebuild what it did not
keep. Anything a forward does besides computing tensors happens twice then: running statistics that a forward
updates (expert-choice thresholds, the lifecycle manager's token counts) would count the micro-batch twice.
Modules that keep such statistics register a recording flag (`add_recording_flag`: a 0-dim bool buffer, true)
and gate every update by it, `new = where(flag, updated, old)`; the checkpoint wrapper (training/blocks.py)
clears the flags of the block it recomputes for the recomputation (`recomputing(block)`, torch's
`checkpoint(..., context_fn=...)`).

A tensor rather than a Python flag: a compiled block runs the very same graph in its forward and in its
recomputation (torch's checkpoint requires the tensors saved for backward to match; a graph specialised to a
Python flag saves different ones, and a flag torch.compile cannot read splits the graph around every update).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

RECORDING = "recording_statistics"  # the flag's buffer name


def add_recording_flag(module: nn.Module) -> None:
    """Give `module` its recording flag (not saved in the state dict; true outside a recomputation)."""
    module.register_buffer(RECORDING, torch.ones((), dtype=torch.bool), persistent=False)


def recording_flags(root: nn.Module) -> list[torch.Tensor]:
    """The recording flags of `root` and every module under it."""
    return [buf for m in root.modules() for name, buf in m.named_buffers(recurse=False) if name == RECORDING]


@contextlib.contextmanager
def recomputing(root: nn.Module) -> Iterator[None]:
    """Run the forward inside as a recomputation: the statistics under `root` are not updated."""
    flags = recording_flags(root)
    for flag in flags:
        flag.fill_(False)
    try:
        yield
    finally:
        for flag in flags:
            flag.fill_(True)


__all__ = ["RECORDING", "add_recording_flag", "recomputing", "recording_flags"]
