"""Autoregressive generation with the per-layer decoding cache, and the `moep-generate` command.

# B batch, T prompt tokens, V vocabulary

Every block type decodes through `model.new_cache()`: attention keeps keys/values, MSIT experts keep the
keys/values of the tokens they selected, SSM blocks carry their recurrent state (step mode). Routing at
decoding time is the routers' eval mode: expert-choice routers must use `eval_mode: threshold` (a token's
experts then depend on that token alone); top-k expert choice over a growing sequence is not causal.

Under a launcher (`torchrun --nproc_per_node N -m moep_ds.evaluation.generate ...`) the model is split over the
ranks (evaluation/partitioned.py): every rank decodes the same rows with rank 0's tokens, rank 0 prints.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.distributed.commands import ArgumentParser, run_command
from moep_ds.errors import SharedUserError, UserError
from moep_ds.evaluation.partitioned import (
    load_eval_model, model_device, run_split, split_over_ranks,
)

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


# ---- moep-generate -----------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moep-generate", description="Sample text from a moep_ds checkpoint.")
    p.add_argument("checkpoint", help="model directory, or run directory (newest complete checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue (the prompt starts a new document)")
    p.add_argument("--max_new_tokens", type=int, default=64,
                   help="may exceed the model's context: the window then slides (the newest max_seq_len / 2 tokens "
                        "are kept)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--no_cache", action="store_true", help="recompute the whole sequence at every step")
    p.add_argument("--device", help="default: cuda when there is a GPU, else cpu (one process; under a launcher "
                   "each rank uses its own)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--expert_parallel", action="store_true",
                   help="under a launcher: shard the experts over the ranks instead of ZeRO-3")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. model.layers[1].router.eval_mode=threshold")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def check_sampling_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise SharedUserError(f"--max_new_tokens ({args.max_new_tokens}) must be >= 1")
    if not 0 <= args.temperature < math.inf:  # also nan, which would sample from nan probabilities
        raise SharedUserError(f"--temperature ({args.temperature}) must be a finite number >= 0")
    if args.top_k is not None and args.top_k < 1:
        raise SharedUserError(f"--top_k ({args.top_k}) must be >= 1")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise SharedUserError(f"--top_p ({args.top_p}) must be in (0, 1]")
    if args.num_samples < 1:
        raise SharedUserError(f"--num_samples ({args.num_samples}) must be >= 1")


def check_prompt(prompt: str) -> None:
    """Python decodes argv bytes that are not UTF-8 to lone surrogates (surrogateescape), which the tokenizer
    cannot encode: the error shows the bytes as they were given."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        try:
            shown = repr(prompt.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # a surrogate that no argv byte produced (a Python caller's string)
            shown = ascii(prompt)
        raise SharedUserError(f"--prompt ({shown}) is not UTF-8 text") from None


def _main(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    check_prompt(args.prompt)
    if args.device is not None:
        parse_device(args.device)
    # a split model's engine (ZeRO-3) gathers the parameters while the model runs: keep it
    model, cfg, tokenizer, _, engine = load_eval_model(args.checkpoint, args.set, args.dtype, args.expert_parallel)
    device = place_model(model, args.device, args.dtype)
    if tokenizer is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json; moep-generate needs one to read the prompt")
    max_len = cfg.model.max_seq_len
    ids = [tokenizer.eot_id] + tokenizer.encode(args.prompt)
    shown = args.prompt
    if len(ids) >= max_len:  # what the continuation sees of the prompt is what is printed of it
        seen = ids[-max(1, max_len // 2):]
        log.warning("prompt of %d tokens is longer than the model's context (max_seq_len %d): continuing its last %d "
                    "tokens, printed after '...'", len(ids), max_len, len(seen))
        ids, shown = seen, "..." + tokenizer.decode(seen)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    prompt_BT = torch.tensor([ids] * args.num_samples, device=device)
    out_BT = generate_sliding(model, prompt_BT, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, generator=generator, eos_id=tokenizer.eot_id,
                              use_cache=not args.no_cache)
    if dist.is_initialized() and dist.get_rank() > 0:  # a split model's other ranks: rank 0 prints
        return 0
    for row in out_BT.tolist():
        new = row[len(ids):]
        if tokenizer.eot_id in new:
            new = new[: new.index(tokenizer.eot_id)]
        print(shown + tokenizer.decode(new))  # the generated text is this command's product
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_split(run_command, _main, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
