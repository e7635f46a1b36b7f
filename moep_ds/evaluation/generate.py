"""Autoregressive generation with the per-layer decoding cache (the `moep-generate` command is moep_ds/cli/generate.py).

# B batch, T prompt tokens, V vocabulary

Every block type decodes through `model.new_cache()`: attention keeps keys/values, MSIT experts keep the
keys/values of the tokens they selected, SSM blocks carry their recurrent state (step mode). Routing at
decoding time is the routers' eval mode: expert-choice routers must use `eval_mode: threshold` (a token's
experts then depend on that token alone); top-k expert choice over a growing sequence is not causal.

Under a launcher (`torchrun --nproc_per_node N -m moep_ds.cli.generate ...`) the model is split over the
ranks (evaluation/partitioned.py): every rank decodes the same rows with rank 0's tokens, rank 0 prints.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.errors import SharedUserError
from moep_ds.evaluation.partitioned import model_device, split_over_ranks

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")  # the precisions a model is evaluated or sampled in


def parse_device(device: str) -> torch.device:
    """`device` as a torch.device; the commands call it before loading anything, since the model would otherwise
    be loaded before torch rejects a malformed string."""
    try:
        return torch.device(device)
    except RuntimeError:  # torch's own text does not name the option
        raise SharedUserError(f"--device ({device!r}) is not a torch device (e.g. cpu, cuda, cuda:1)") from None


def pick_device(device: str | None) -> torch.device:
    """The requested device, by default cuda when there is a GPU; lm-eval's CLI asks for cuda by default, which
    falls back to cpu without a GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = parse_device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available: evaluating on cpu", device)
        return torch.device("cpu")
    return where


def place_model(model: nn.Module, device: str | None, dtype: str) -> torch.device:
    """The device `model` runs on: a model split over the ranks stays on its rank's device, in the precision it
    was loaded in; a whole model is moved to `device` (`pick_device`) and `dtype`."""
    if split_over_ranks(model):
        return model_device(model)
    where = pick_device(device)
    model.to(where, getattr(torch, dtype))
    return where


def filter_top_k(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, -inf elsewhere (ties at the k-th value are kept)."""
    if k >= logits_BV.shape[-1]:
        return logits_BV
    kth_B1 = logits_BV.topk(k, dim=-1).values[:, -1:]
    return logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))


def filter_top_p(logits_BV: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020): keep the smallest set of most likely tokens whose probability
    mass reaches p; the most likely token always stays."""
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    cum_BV = sorted_BV.softmax(-1).cumsum(-1)
    drop_sorted_BV = (cum_BV - sorted_BV.softmax(-1)) >= p  # mass before this token already reaches p
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def sample_next(
    logits_BV: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B]: argmax at temperature 0, else a draw from softmax(logits / temperature) after the
    top-k and top-p filters."""
    logits_BV = logits_BV.float()
    if temperature <= 0.0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        logits_BV = filter_top_k(logits_BV, top_k)
    if top_p is not None and top_p < 1.0:
        logits_BV = filter_top_p(logits_BV, top_p)
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=generator).squeeze(-1)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Routers switch to their eval mode (thresholds) for decoding; the previous mode comes back after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def decode_steps(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row [B], one step at a time, until the sequence fills max_seq_len.

    With `use_cache` each step feeds only the newest token (the blocks' decoding caches hold the rest);
    without it each step recomputes the whole sequence (the reference the cache is tested against).
    Call it inside `torch.no_grad()` and `eval_mode(model)`.
    """
    seq_BT = input_ids_BT
    cache = model.new_cache() if use_cache else None
    split = split_over_ranks(model) and dist.get_world_size() > 1
    logits_BV = model(seq_BT, cache=cache).logits[:, -1]
    for _ in range(model.cfg.max_seq_len - input_ids_BT.shape[1]):
        next_B = sample_next(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if split:  # every rank of a split model runs each step: all continue with rank 0's tokens, stop together
            dist.broadcast(next_B, src=0)
        yield next_B
        seq_BT = torch.cat([seq_BT, next_B[:, None]], dim=1)
        if seq_BT.shape[1] < model.cfg.max_seq_len:
            logits_BV = model(next_B[:, None] if use_cache else seq_BT, cache=cache).logits[:, -1]


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    **sampling,
) -> torch.Tensor:
    """Extend each prompt row by up to `max_new_tokens` tokens; returns [B, T + n] (n <= max_new_tokens).

    `sampling`: temperature (0 = greedy), top_k, top_p, generator, use_cache (see `decode_steps`).
    Rows that produced `eos_id` keep emitting it until every row has; then generation stops.
    """
    B, T = input_ids_BT.shape
    max_len = model.cfg.max_seq_len
    if T + max_new_tokens > max_len:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len ({max_len})")
    new = []
    done_B = torch.zeros(B, dtype=torch.bool, device=input_ids_BT.device)
    with eval_mode(model):
        for next_B in decode_steps(model, input_ids_BT, **sampling):
            if eos_id is not None:
                next_B = next_B.masked_fill(done_B, eos_id)
                done_B |= next_B == eos_id
            new.append(next_B)
            if len(new) == max_new_tokens or bool(done_B.all()):
                break
    return torch.cat([input_ids_BT, torch.stack(new, dim=1)], dim=1)


@torch.no_grad()
def generate_sliding(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    **sampling,
) -> torch.Tensor:
    """`generate` past the model's context (as the exported Hugging Face model does): while prompt and new tokens fit
    in max_seq_len this is `generate`; once they fill it, decoding starts again (a new cache) from the last
    max_seq_len // 2 tokens, so every token is drawn given at least half a context of the tokens before it. A
    prompt as long as the context is continued from its last max_seq_len // 2 tokens. Returns [B, T + n]."""
    max_len = model.cfg.max_seq_len
    keep = max(1, max_len // 2)
    out_BT = input_ids_BT
    done_B = torch.zeros(out_BT.shape[0], dtype=torch.bool, device=out_BT.device)
    produced = 0
    while produced < max_new_tokens:
        context_BT = out_BT if out_BT.shape[1] < max_len else out_BT[:, -keep:]
        n = min(max_new_tokens - produced, max_len - context_BT.shape[1])
        new_BN = generate(model, context_BT, n, eos_id=eos_id, **sampling)[:, context_BT.shape[1]:]
        if eos_id is not None:  # rows that ended in an earlier window go on emitting eos
            new_BN = new_BN.masked_fill(done_B[:, None], eos_id)
            done_B |= (new_BN == eos_id).any(1)
        out_BT = torch.cat([out_BT, new_BN], dim=1)
        produced += new_BN.shape[1]
        if new_BN.shape[1] < n or bool(done_B.all()):  # generate stopped at eos in every row
            break
    return out_BT
