"""Per-block activation checkpointing and compilation, applied in place (parameter names do not change).

    train.activation_checkpointing: each block keeps only its input in forward and recomputes its activations
        in backward (torch's non-reentrant checkpoint: works with ZeRO-3, whose parameter fetches are module
        hooks that fire again in the recomputation, and with blocks that return tuples and dicts);
    train.compile: each block is compiled (`Module.compile()`, per block as torchtitan does).

Both replace what calling a block runs, not the block: `torch.compile(module)` and `checkpoint_wrapper` wrap
the module and rename every parameter (`_orig_mod.`, `_checkpoint_wrapped_module.`), which would change the
checkpoint format. Here the wrapper is an instance attribute `forward`, and compilation is the module's own
`compile()`. With both switches on, the checkpoint stays outside the compiled code and the block's forward is
compiled inside it (`torch.compile(block.forward)`): the recompute context below is not a TorchDispatchMode,
which torch's checkpoint requires of a `context_fn` inside a compiled region. The recomputation then runs the
same compiled graphs as the forward (the statistics updates are in them, gated by a tensor), so the tensors it
saves match the forward's, as checkpointing checks.

The recomputation runs each block's forward a second time: `moep_ds.recompute.recomputing(block)` clears the
block's recording flags for it, so that running statistics updated in forward (expert-choice thresholds,
lifecycle token counts) are not updated again.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moep_ds.recompute import recomputing


def recompute_contexts(module: nn.Module) -> tuple[contextlib.AbstractContextManager, ...]:
    """checkpoint's context_fn: nothing around the first forward; around the second, `module`'s running
    statistics switched off."""
    return contextlib.nullcontext(), recomputing(module)


def checkpointed(forward: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """`forward` recomputed in backward when it runs in training with gradients on; else called as it is."""
    contexts = functools.partial(recompute_contexts, module)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


def apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    """Checkpoint every block of `blocks` in place."""
    for block in blocks:
        block.forward = checkpointed(block.forward, block)


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Compile every block in place (`Module.compile()`): the state dict keeps its keys."""
    for block in blocks:
        block.compile()


def apply_block_options(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> None:
    """The recipe's train.activation_checkpointing / train.compile, on `model.blocks`."""
    blocks = getattr(model, "blocks", None)
    if not (activation_checkpointing or compile):
        return
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `blocks` list to checkpoint or compile")
    if activation_checkpointing and compile:
        # Blocks of one class share compiled graphs, specialised to shapes and then made dynamic (routed token
        # counts vary). Kept in last-use order, the recomputation can select a different one of them than the
        # forward did, which saves different tensors (torch's checkpoint refuses that; pytorch/pytorch#166926);
        # in insertion order the same inputs select the same graph. torch's own advice for this case.
        torch._C._dynamo.eval_frame._set_lru_cache(False)
        for block in blocks:
            block.forward = checkpointed(torch.compile(block.forward), block)
    elif activation_checkpointing:
        apply_activation_checkpointing(blocks)
    else:
        compile_blocks(blocks)


__all__ = ["apply_activation_checkpointing", "apply_block_options", "checkpointed", "compile_blocks",
           "recompute_contexts"]
