"""The chunked gated delta rule (moep_ds/layers/gated_deltanet.py) against transformers' torch_chunk_gated_delta_rule
(Qwen3-Next's torch path), forward + backward, by sequence length.

# T tokens, G key heads, H value heads, K head_k_dim, V head_v_dim

For each T: both functions on the same inputs (q, k [1, T, G, K], v [1, T, H, V], log decays, betas; chunk 64,
l2-normalised q and k, final state returned), the backward of a fixed random projection of the output, timed
interleaved round-robin in CPU time of this process (one thread), best of --repeats after a warm-up. `max |diff|`
is the largest difference of the two outputs. ms per 1k tokens of ours is flat in T when the work is linear in T.
Target: ours / transformers <= 1.00 at T 2048.

    python bench/gated_deltanet.py                                  # T 512-4096, G 2, H 4, K = V = 128 (Qwen3-Next's)
    python bench/gated_deltanet.py --lengths 64 128 --head_dim 16 --repeats 1    # toy size (the smoke test)
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Callable

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
from transformers.utils import logging as hf_logging

from moep_ds.distributed.commands import positive_int
from moep_ds.layers.gated_deltanet import chunk_gated_delta_rule

CHUNK = 64


def inputs(seq_len: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> list[torch.Tensor]:
    q = torch.randn(1, seq_len, num_k_heads, head_dim)
    k = torch.randn(1, seq_len, num_k_heads, head_dim)
    v = torch.randn(1, seq_len, num_v_heads, head_dim)
    g = -torch.rand(1, seq_len, num_v_heads) * 0.1  # log decays: exp in (0.9, 1]
    beta = torch.rand(1, seq_len, num_v_heads)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def ours(q, k, v, g, beta):  # noqa: ANN001, ANN201
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK)


def theirs(q, k, v, g, beta):  # noqa: ANN001, ANN201
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)


def step(fn: Callable, args: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for x in args:
            x.grad = None
        o, state = fn(*args)
        ((o * grad).sum() + state.sum()).backward()
        return o.detach()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--num_k_heads", type=positive_int, default=2)
    parser.add_argument("--num_v_heads", type=positive_int, default=4)
    parser.add_argument("--head_dim", type=positive_int, default=128, help="head_k_dim = head_v_dim")
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    hf_logging.set_verbosity_error()  # transformers' notice that it falls back to its torch path (the point here)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"chunked gated delta rule forward + backward, CPU, 1 thread, CPU time, best of {args.repeats}; "
          f"batch 1, G {args.num_k_heads}, H {args.num_v_heads}, K = V = {args.head_dim}, chunk {CHUNK}; "
          f"torch {torch.__version__}")
    print("| T | ours ms | transformers ms | ours / transformers | ours ms per 1k tokens | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    ratios = {}
    for seq_len in args.lengths:
        x = inputs(seq_len, args.num_k_heads, args.num_v_heads, args.head_dim)
        grad = torch.randn(1, seq_len, args.num_v_heads, args.head_dim)
        runs = {"ours": step(ours, x, grad), "theirs": step(theirs, x, grad)}
        outputs = {name: run() for name, run in runs.items()}  # warm-up
        best = {name: float("inf") for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.process_time()
                run()
                best[name] = min(best[name], time.process_time() - start)
        ratios[seq_len] = best["ours"] / best["theirs"]
        diff = (outputs["ours"] - outputs["theirs"]).abs().max().item()
        print(f"| {seq_len} | {best['ours'] * 1e3:.1f} | {best['theirs'] * 1e3:.1f} | {ratios[seq_len]:.2f} | "
              f"{best['ours'] * 1e6 / seq_len:.1f} | {diff:.1e} |")
    at = 2048 if 2048 in ratios else args.lengths[-1]
    print(f"T {at} ours / transformers: {ratios[at]:.2f}x")


if __name__ == "__main__":
    main()
