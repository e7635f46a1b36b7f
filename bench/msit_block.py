"""MSIT expert stage, forward + backward: routed-subset attention vs two baselines, measured in one run.

# B batch, T tokens, D model dim, F thin dim, E experts, K tokens per expert (round(c B T / E)),
# H heads, Dh head dim

The expert stage of one MSIT block (eqs. 4-6): W_down, E branches (windows [64, 16, 8, 4]: pre-LN
sliding-window attention, pre-LN SwiGLU, post-LN) on their K expert-choice tokens, gated scatter, W_up.
Three ways to compute it:
  routed        moep_ds (MSITExperts): each branch runs on its K tokens sorted by (sequence, position),
                attention O(K x window) over original positions
  dense_masked  each branch runs on all B*T tokens; attention is T x T per sequence with the mask (both
                selected, causal, window); unselected tokens get weight 0: O(B T^2), the reference semantics
  score_order   the public MSIT code: each branch runs on its K tokens in top-k score order as one (1, K)
                sequence with a causal mask over that order, O(K^2) (other semantics: sequences mix,
                original positions are ignored)
"attention" rows time the attention kernel alone (q, k, v of the K tokens given; dense_masked scatters them
to [B, T]); "expert stage" rows time the whole stage.

    python bench/msit_block.py                        # B=16, T=512 on CUDA if available, else CPU
    python bench/msit_block.py --batch 2 --iters 3    # quick check
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from moep_ds.blocks.msit import MSITBlockConfig, MSITExpertConfig, MSITExperts
from moep_ds.distributed.commands import positive_int
from moep_ds.layers.norm import NormConfig
from moep_ds.layers.routed_attention import routed_attention
from moep_ds.registry import ROUTERS
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.plan import RoutingPlan


def expert_slices(plan: RoutingPlan) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per expert: its token indices and combine weights."""
    counts = plan.counts()
    return plan.token_idx_S.split(counts), plan.weight_S.split(counts)


def dense_mask(sel_BT: torch.Tensor, window: int) -> torch.Tensor:
    """[B, 1, T, T]: both selected, causal, in window; plus the diagonal so unselected rows stay finite."""
    T = sel_BT.shape[1]
    t = torch.arange(T, device=sel_BT.device)
    delta_TT = t[:, None] - t[None, :]
    mask_BTT = sel_BT[:, :, None] & sel_BT[:, None, :] & (delta_TT >= 0) & (delta_TT < window)
    return (mask_BTT | torch.eye(T, dtype=torch.bool, device=sel_BT.device))[:, None]


def dense_masked_attention(q_NHd, k_NHd, v_NHd, flat_N, B, T, window):
    """Scatter the routed tokens to [B, T], attend T x T with the routed mask, gather them back."""
    N, H, Dh = q_NHd.shape

    def to_dense(x_NHd):
        return x_NHd.new_zeros(B * T, H, Dh).index_copy(0, flat_N, x_NHd).view(B, T, H, Dh).transpose(1, 2)

    sel_BT = torch.zeros(B * T, dtype=torch.bool, device=q_NHd.device).index_fill(0, flat_N, True).view(B, T)
    q_BHTd, k_BHTd, v_BHTd = to_dense(q_NHd), to_dense(k_NHd), to_dense(v_NHd)
    out_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, attn_mask=dense_mask(sel_BT, window))
    return out_BHTd.transpose(1, 2).reshape(B * T, H, Dh)[flat_N]


def score_order_attention(q_NHd, k_NHd, v_NHd):
    """The public code's view: all K tokens as one sequence in score order, causal over that order."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q_NHd, k_NHd, v_NHd))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)


def attention_kernel(method: str, q, k, v, flat_N, B, T, window):
    """Attention of one expert; q/k/v are in `flat_N` order (sorted for routed/dense, score order otherwise)."""
    if method == "routed":
        return routed_attention(q, k, v, flat_N // T, flat_N % T, window)
    if method == "dense_masked":
        return dense_masked_attention(q, k, v, flat_N, B, T, window)
    return score_order_attention(q, k, v)


def branch_dense_masked(branch, window, u_BTF, sel_BT, pos_BT):
    """One MSIT branch over every token, attention masked to the selected ones."""
    attn = branch.attn
    q, k, v = (x.transpose(1, 2) for x in attn.project(branch.attn_norm(u_BTF), pos_BT))
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(sel_BT, window))
    b = u_BTF + attn.w_o(a.transpose(1, 2).flatten(-2))
    return branch.out_norm(b + branch.ffn(branch.ffn_norm(b)))


def branch_score_order(branch, u_KF, pos_K):
    attn = branch.attn
    q, k, v = attn.project(branch.attn_norm(u_KF), pos_K)
    b = u_KF + attn.w_o(score_order_attention(q, k, v).flatten(-2))
    return branch.out_norm(b + branch.ffn(branch.ffn_norm(b)))


def expert_stage(method: str, experts: MSITExperts, branches, g_BTD, plan: RoutingPlan, pos_BT):
    """Eqs. 4-6 with the chosen way of running the branches (the baselines on standalone copies of them)."""
    if method == "routed":
        return experts(g_BTD, plan, pos_BT)
    B, T, D = g_BTD.shape
    u_TF = experts.w_down(g_BTD.reshape(B * T, D))
    acc_TF = torch.zeros_like(u_TF)
    for branch, window, idx_K, weight_K in zip(branches, experts.windows, *expert_slices(plan)):
        weight_K = weight_K.to(u_TF.dtype)[:, None]
        if method == "dense_masked":
            sel_BT = torch.zeros(B * T, dtype=torch.bool, device=g_BTD.device).index_fill(0, idx_K, True).view(B, T)
            y_TF = branch_dense_masked(branch, window, u_TF.view(B, T, -1), sel_BT, pos_BT).reshape(B * T, -1)
            weight_T = torch.zeros_like(u_TF[:, :1]).index_copy(0, idx_K, weight_K)
            acc_TF = acc_TF + y_TF * weight_T
        else:
            y_KF = branch_score_order(branch, u_TF[idx_K], pos_BT.reshape(-1)[idx_K])
            acc_TF = acc_TF.index_add(0, idx_K, y_KF * weight_K)
    return experts.w_up(acc_TF).view(B, T, D)


def timed(fns: dict[str, Callable[[], None]], iters: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """Median wall and process-CPU milliseconds of each fn() after two warm-up rounds. Methods alternate
    within each round so that a change in machine load affects all of them alike; on a shared CPU the
    process time (all threads of this process) is the steadier measure."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for i in range(iters + 2):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times[name].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    return {name: tuple(statistics.median(col) for col in zip(*t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--d_thin", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--capacity", type=float, default=2.0)
    parser.add_argument("--windows", type=positive_int, nargs="+", default=[64, 16, 8, 4])
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, T, D, E = args.batch, args.seq_len, args.d_model, len(args.windows)
    torch.manual_seed(0)

    cfg = MSITBlockConfig(
        router=ExpertChoiceConfig(capacity_factor=args.capacity),
        experts=MSITExpertConfig(d_thin=args.d_thin, num_heads=args.heads, windows=args.windows),
    )
    router = ROUTERS.build(cfg.router, d_model=D, num_experts=E).to(device)
    with torch.no_grad():  # spread affinities: the selection of a trained router, not of a near-uniform one
        router.weight.normal_(std=1.0)
    experts = MSITExperts(cfg.experts, NormConfig(), D, active_experts_per_token=args.capacity).to(device, dtype)
    branches = [experts.branches.expert_module(i) for i in range(E)]
    g_BTD = torch.randn(B, T, D, device=device, dtype=dtype, requires_grad=True)
    pos_BT = torch.arange(T, device=device).expand(B, T)
    plan = router(g_BTD.detach())
    plan = RoutingPlan(plan.token_idx_S, plan.weight_S.detach(), plan.counts_E, plan.num_tokens)
    score_order_K, _ = expert_slices(plan)
    sorted_K = [idx.sort().values for idx in score_order_K]
    Dh = args.d_thin // args.heads
    qkv = [[torch.randn(len(idx), args.heads, Dh, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)] for idx in sorted_K]

    def run_attention(method):
        order = score_order_K if method == "score_order" else sorted_K
        outs = [attention_kernel(method, *qkv[i], order[i], B, T, w) for i, w in enumerate(args.windows)]
        torch.stack([o.float().square().mean() for o in outs]).sum().backward()

    def run_stage(method):
        expert_stage(method, experts, branches, g_BTD, plan, pos_BT).float().square().mean().backward()

    with torch.no_grad():  # the routed computation has the dense-masked semantics
        err = (expert_stage("routed", experts, branches, g_BTD, plan, pos_BT).float()
               - expert_stage("dense_masked", experts, branches, g_BTD, plan, pos_BT).float()).abs().max().item()

    print(f"MSIT expert stage fwd+bwd: B={B} T={T} d={D} d_thin={args.d_thin} heads={args.heads} E={E} "
          f"K={len(sorted_K[0])} per expert, windows={args.windows}, {device.type} {str(dtype).split('.')[-1]} "
          f"({torch.get_num_threads()} threads), median of {args.iters}; "
          f"max |routed - dense_masked| (expert stage) = {err:.2e}")
    print(f"{'stage':<13} {'method':<13} {'wall ms':>9} {'dense/this':>10} {'cpu ms':>9} {'dense/this':>10}")
    for stage, run in (("attention", run_attention), ("expert stage", run_stage)):
        methods = ("routed", "dense_masked", "score_order")
        ms = timed({m: (lambda m=m: run(m)) for m in methods}, args.iters, device)
        dense_wall, dense_cpu = ms["dense_masked"]
        for method, (wall, cpu) in ms.items():
            print(f"{stage:<13} {method:<13} {wall:9.2f} {dense_wall / wall:9.2f}x {cpu:9.2f} {dense_cpu / cpu:9.2f}x")


if __name__ == "__main__":
    main()
