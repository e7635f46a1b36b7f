"""The fused gated activation (moep_ds/layers/glu.py) against the unfused expression, by buffer size.

# N rows (tokens), F hidden dim

For each [N, F] size: act(gate) * up forward and backward (autograd, an incoming gradient of ones' shape drawn
once), unfused and fused timed interleaved round-robin in CPU time of this process (one thread), best of
--repeats after a warm-up that also compiles the kernels. The ratio fused / unfused is what sets
`glu.FUSED_MIN_NUMEL` (fused below 1.0 pays).

    python bench/gated_activation.py                  # SwiGLU, fp32, sizes from 0.13M to 7.3M elements
    python bench/gated_activation.py --kind geglu --repeats 10
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from moep_ds.distributed.commands import positive_int
from moep_ds.layers import glu

SIZES = [(512, 256), (1024, 256), (1024, 512), (2048, 512), (4096, 512), (1024, 2048), (8192, 896)]


def step(kind: str, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, fused: bool):
    def run() -> None:
        gate.grad = up.grad = None
        glu.FUSED_MIN_NUMEL = 0 if fused else 1 << 62
        glu.gated_activation(kind, gate, up).backward(grad)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="swiglu", choices=sorted(glu.GATE_ACTIVATIONS))
    parser.add_argument("--repeats", type=positive_int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    threshold = glu.FUSED_MIN_NUMEL
    print(f"{args.kind} forward + backward, CPU, 1 thread, CPU time, best of {args.repeats}; torch {torch.__version__}; "
          f"FUSED_MIN_NUMEL = {threshold}")
    print("| elements (N x F) | unfused ms | fused ms | fused / unfused |")
    print("|---|---:|---:|---:|")
    for n, f in SIZES:
        gate, up = (torch.randn(n, f, requires_grad=True) for _ in range(2))
        grad = torch.randn(n, f)
        runs = {fused: step(args.kind, gate, up, grad, fused) for fused in (False, True)}
        for run in runs.values():
            run()  # warm-up (and compilation)
        best = {fused: float("inf") for fused in runs}
        for _ in range(args.repeats):
            for fused, run in runs.items():
                start = time.process_time()
                run()
                best[fused] = min(best[fused], time.process_time() - start)
        print(f"| {n * f / 1e6:.2f}M ({n} x {f}) | {best[False] * 1e3:.2f} | {best[True] * 1e3:.2f} | "
              f"{best[True] / best[False]:.2f} |")
    glu.FUSED_MIN_NUMEL = threshold


if __name__ == "__main__":
    main()
