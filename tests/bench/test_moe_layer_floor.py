"""bench/moe_layer.py's GEMM floor issues the matrix products of the layers it bounds: the same multiply-adds as our
DeepSeek / Qwen layers and transformers' grouped_mm blocks on the same routing (less their routers' and gates'
small products); and the DeepSeek / Qwen tables print its rows (values rounded to 0.1 ms)."""
import argparse
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchlib import load, run


class MatmulFlops(TorchDispatchMode):
    """Multiply-adds of every mm and grouped_mm (2d x 3d: rows x in x out; 2d x 2d: the product summed over groups)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            (m, k), (_, n) = args[0].shape, args[1].shape
            self.counts["mm"] += m * k * n
        elif func is torch.ops.aten._grouped_mm.default:
            a, b = args[0], args[1]
            if b.dim() == 3:  # [S, K] x [E, K, N]
                self.counts["grouped_mm"] += a.shape[0] * a.shape[1] * b.shape[2]
            else:  # [M, S] x [S, N] -> [E, M, N]
                self.counts["grouped_mm"] += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def flops(step) -> collections.Counter:
    with MatmulFlops() as mode:
        step()
    return mode.counts


@pytest.mark.parametrize("kind", ["deepseek", "qwen"])
def test_gemm_floor_issues_the_products_of_ours_and_of_transformers_grouped_block(kind):
    bench = load("moe_layer")
    args = argparse.Namespace(fine_hidden=32, fine_experts=8, groups=4, group_topk=2)
    torch.manual_seed(0)
    x = torch.randn(1, 96, 16, requires_grad=True)
    steps, _ = bench.published_rows(kind, args, x, torch.randn_like(x))
    floor, ours, hf = flops(steps["gemm_floor"]), flops(steps[f"ours_{kind}"]), flops(steps["hf_grouped"])
    # not in the floor: the router's logits (forward, input and weight gradients: [96, 16] x [16, 8]) and Qwen's
    # shared-expert gate ([96, 16] x [16, 1], likewise)
    routing = 3 * 96 * 16 * (8 + (kind == "qwen"))
    assert floor["grouped_mm"] == ours["grouped_mm"] == hf["grouped_mm"] > 0
    assert floor["mm"] == ours["mm"] - routing == hf["mm"] - routing > 0


def test_published_tables_print_the_floor_rows():
    proc = run("moe_layer.py", "--tables", "deepseek", "qwen", "--tokens", "64", "--repeats", "1", timeout=300)
    rows = {line[:46].strip(): line[46:].split() for line in proc.stdout.splitlines()[2:]}
    for kind in ("deepseek", "qwen"):
        ours, floor, ratio = map(float, rows[f"{kind}: ours / GEMM floor"])
        assert ours > 0 and floor > 0 and ratio == pytest.approx(ours / floor, rel=0.02)
        hf, floor_again, ceiling = map(float, rows[f"{kind}: hf_grouped / GEMM floor (ceiling)"])
        assert floor_again == floor and ceiling == pytest.approx(hf / floor, rel=0.02)
