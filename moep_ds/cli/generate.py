"""`moep-generate CHECKPOINT --prompt TEXT`: the command line of moep_ds/evaluation/generate.py.

Under a launcher (`torchrun --nproc_per_node N -m moep_ds.cli.generate ...`) the model is split over the ranks
(evaluation/partitioned.py): every rank decodes the same rows with rank 0's tokens, rank 0 prints.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
import torch.distributed as dist

from moep_ds.distributed.commands import ArgumentParser, run_command
from moep_ds.errors import SharedUserError, UserError
from moep_ds.evaluation.generate import DTYPES, generate_sliding, parse_device, place_model
from moep_ds.distributed.commands import run_split
from moep_ds.evaluation.partitioned import load_eval_model

log = logging.getLogger(__name__)

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
