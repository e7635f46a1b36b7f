"""MoE layer, forward + backward on CPU: ours against an ideal dense bound and three other implementations.

# N tokens, D model dim, F expert hidden dim, E experts, c expert-choice capacity factor

All rows of one table share the input, the upstream gradient and the expert/router weights, and are timed in
one process, interleaved round-robin, as CPU time of this process (best of --repeats after one warm-up), so that
load from other processes on a shared machine distorts the rows as little and as evenly as possible. Rows:
  expert choice (Nova-MoE routing: c=1.25, ceil, softmax over tokens, scope batch; D=512, F=2048, E=8)
    ideal        one dense SwiGLU FFN of one expert's size on the c N tokens (E ceil(c N / E)) that the experts
                 process: their matmul FLOPs with no routing, gather or scatter, and one expert's weights only
  top-2 of E (Mixtral routing: renormalised, dropless; D=256, F=896, E=8 as configs/mixtral_tiny.yaml)
    ours_top2    our MoE layer, kernel chosen as in training (uneven loads: torch's F.grouped_mm)
    ours_top2_loop  the same layer with the per-expert loop kernel (moe/expert_loop.py), for comparison
    ideal        one dense SwiGLU FFN of one expert's size on the 2N routed tokens: the FLOP-proportional bound
    hf_eager     transformers' MixtralSparseMoeBlock, experts_implementation="eager" (the block's own loop)
    hf_grouped   the same block with experts_implementation="grouped_mm" (what a Mixtral model selects)
    deepspeed    deepspeed.moe.layer.MoE(k=2), defaults (capacity_factor 1.0: overflow dropped, padded
                 capacity slots computed) but without its random 2nd-expert sampling and random token
                 selection, so the routing is comparable
    deepspeed_dropless  the same with drop_tokens=False (capacity = the largest expert load): ours' semantics
    naive_loop   a Python loop over experts: torch.where per expert, indexed stacked weights, index_add
    ours_top2_unfused, ideal_unfused  ours and the bound with the gated activation unfused (layers/glu.py off):
                 what its fused kernel is worth (ours and ideal use it, as training does, from 512K elements)
  DeepSeek-V3 routing (sigmoid top-4 of E=16 within the top 2 of 4 groups, selection bias, weights renormalised
  x 2.5, one shared expert; D=256, F=256) and Qwen2-MoE routing (softmax top-4 of 16, sigmoid-gated shared expert of
  4F; D=256, F=256):
    ours_deepseek / ours_qwen   our MoE layer with those options (routing/topk.py, moe/shared.py)
    ideal        one dense SwiGLU FFN of one expert's size on the rows the experts process: K N routed rows plus
                 the shared expert's N rows (x its width in units of F): the FLOP-proportional bound
    hf_eager, hf_grouped  transformers' DeepseekV3MoE / Qwen2MoeSparseMoeBlock with the same weights (and bias),
                 experts_implementation "eager" / "grouped_mm"
    gemm_floor   only the matrix products of a step, on the same routing: the routed experts' nine F.grouped_mm
                 calls (three forward, six backward) and the shared expert's nine mm, on inputs already grouped, with
                 no routing, gather, activation or combine (nor the router's and Qwen's gate's small [N, D] x [D, E]
                 and [N, D] x [D, 1] products). Every row issues these products (transformers' grouped_mm block the
                 same multiply-adds, its gate and up fused; tests/bench/test_moe_layer_floor.py counts them), so
                 hf_grouped / gemm_floor is the largest speed-up over that block any implementation of the same
                 products can show on this machine
Ratios: ours / ideal (targets: expert choice <= 1.10, top-2, DeepSeek and Qwen <= 1.15); for the others
other / ours (speed-up; target >= 1.10 for every library implementation).

    python bench/moe_layer.py                        # defaults above, N = 4096 tokens, 1 thread
    python bench/moe_layer.py --tokens 512 --repeats 3   # quick check
    python bench/moe_layer.py --tables deepseek qwen     # only the DeepSeek-V3 and Qwen2-MoE tables
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.distributed.commands import positive_int
from moep_ds.layers import glu
from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.experts import expert_ffn
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.topk import TopKConfig

Step = Callable[[], None]
TABLES = ("expert_choice", "top2", "deepseek", "qwen")


def moe_layer(router, d_model: int, hidden: int, experts: int) -> MoELayer:
    cfg = MoEConfig(num_experts=experts, expert=FFNConfig(type="swiglu", hidden_size=hidden), router=router)
    return MoELayer(cfg, d_model=d_model)


def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor, params) -> Step:
    """One training step's worth of MoE work: y = fn(x); backward of <y, g> into x and all parameters."""
    params = list(params)

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        (fn(x) * g).sum().backward()

    return step


def time_rows(rows: dict[str, Step], repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    for step in rows.values():
        step()  # warm-up (allocator, lazy init)
    best = {name: float("inf") for name in rows}
    for _ in range(repeats):
        for name, step in rows.items():
            start = clock()
            step()
            best[name] = min(best[name], clock() - start)
    return best


# --- expert choice vs the ideal dense bound ---------------------------------------------------------------

def ideal_ffn(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, n: int) -> Step:
    """One dense SwiGLU FFN with one expert's weights on n tokens (the first of x, repeated as needed)."""
    ex = layer.experts
    reps = -(-n // x.shape[1])
    x_ideal = x[0].detach().repeat(reps, 1)[:n].clone().requires_grad_()
    g_ideal = g[0].repeat(reps, 1)[:n]
    w1, w2, w3 = (w[0].detach().clone().requires_grad_() for w in (ex.w1_EDF, ex.w2_EFD, ex.w3_EDF))
    return fwd_bwd(lambda x2: expert_ffn(x2, w1, w2, w3, None, None, None, "swiglu"), x_ideal, g_ideal, (w1, w2, w3))


def expert_choice_rows(args, x: torch.Tensor, g: torch.Tensor) -> dict[str, Step]:
    router = ExpertChoiceConfig(capacity_factor=args.capacity_factor, rounding="ceil", score="softmax_tokens")
    layer = moe_layer(router, x.shape[-1], args.ec_hidden, args.experts)
    # the E ceil(c N / E) ~ c N tokens expert choice processes
    return {
        "ours_expert_choice": fwd_bwd(lambda x_: layer(x_).y, x, g, layer.parameters()),
        "ideal": ideal_ffn(layer, x, g, sum(layer.router(x).counts())),
    }


# --- top-2 against the libraries --------------------------------------------------------------------------

def hf_block(layer: MoELayer, implementation: str) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    ex = layer.experts
    E, D, Fh = ex.w1_EDF.shape
    cfg = MixtralConfig(hidden_size=D, intermediate_size=Fh, num_local_experts=E, num_experts_per_tok=2)
    cfg._experts_implementation = implementation
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ex.w1_EDF, ex.w3_EDF], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(ex.w2_EFD.transpose(1, 2))
    return block


class SwiGLUExpert(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def deepspeed_block(layer: MoELayer, drop_tokens: bool) -> nn.Module:
    from deepspeed.moe.layer import MoE

    ex = layer.experts
    E, D, Fh = ex.w1_EDF.shape
    block = MoE(D, SwiGLUExpert(D, Fh), num_experts=E, k=2, use_rts=False, top2_2nd_expert_sampling=False,
                drop_tokens=drop_tokens)
    with torch.no_grad():
        block.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
        for e, expert in enumerate(block.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.weight.copy_(ex.w1_EDF[e].t())
            expert.w3.weight.copy_(ex.w3_EDF[e].t())
            expert.w2.weight.copy_(ex.w2_EFD[e].t())
    return block


def naive_loop(layer: MoELayer) -> Callable[[torch.Tensor], torch.Tensor]:
    ex = layer.experts

    def forward(x_BTD: torch.Tensor) -> torch.Tensor:
        x = x_BTD.reshape(-1, x_BTD.shape[-1])
        probs = torch.softmax(x.float() @ layer.router.weight.t(), dim=-1)
        top, experts = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(ex.num_local_experts):
            tok, slot = torch.where(experts == e)
            out = expert_ffn(x[tok], ex.w1_EDF[e], ex.w2_EFD[e], ex.w3_EDF[e], None, None, None, "swiglu")
            y = y.index_add(0, tok, out * top[tok, slot, None])
        return y.view_as(x_BTD)

    return forward


def unfused(step: Step) -> Step:
    """The step with layers/glu.py's fused gated activation switched off."""
    def run() -> None:
        fused_from = glu.FUSED_MIN_NUMEL
        glu.FUSED_MIN_NUMEL = 1 << 62
        try:
            step()
        finally:
            glu.FUSED_MIN_NUMEL = fused_from

    return run


def top2_rows(args, x: torch.Tensor, g: torch.Tensor) -> tuple[dict[str, Step], dict[str, float]]:
    router = TopKConfig(k=2, renormalize=True, load_balancing_weight=0.0)
    layer = moe_layer(router, x.shape[-1], args.top2_hidden, args.experts)
    loop_layer = moe_layer(router, x.shape[-1], args.top2_hidden, args.experts)
    loop_layer.load_state_dict(layer.state_dict())
    loop_layer.experts.kernel = "loop"
    blocks = {"hf_eager": hf_block(layer, "eager"), "hf_grouped": hf_block(layer, "grouped_mm")}
    ds = deepspeed_block(layer, drop_tokens=True)
    ds_dropless = deepspeed_block(layer, drop_tokens=False)
    ours = lambda x_: layer(x_).y  # noqa: E731
    fns = {
        "ours_top2": (ours, layer.parameters()),
        "ours_top2_loop": (lambda x_: loop_layer(x_).y, loop_layer.parameters()),
        "hf_eager": (blocks["hf_eager"], blocks["hf_eager"].parameters()),
        "hf_grouped": (blocks["hf_grouped"], blocks["hf_grouped"].parameters()),
        "deepspeed": (lambda x_: ds(x_)[0], ds.parameters()),
        "deepspeed_dropless": (lambda x_: ds_dropless(x_)[0], ds_dropless.parameters()),
        "naive_loop": (naive_loop(layer), layer.parameters()),
    }
    with torch.no_grad():  # same weights, same routing: the outputs agree (deepspeed: up to its dropped tokens)
        reference = ours(x)
        diffs = {name: (fn(x) - reference).abs().max().item() for name, (fn, _) in fns.items()}
    steps = {name: fwd_bwd(fn, x, g, params) for name, (fn, params) in fns.items()}
    steps["ideal"] = ideal_ffn(layer, x, g, 2 * x.shape[1])
    steps["ours_top2_unfused"], steps["ideal_unfused"] = unfused(steps["ours_top2"]), unfused(steps["ideal"])
    diffs["ours_top2_unfused"] = diffs["ideal_unfused"] = 0.0
    return steps, diffs


# --- DeepSeek-V3 and Qwen2-MoE routing against transformers' blocks -----------------------------------------

def published_block(kind: str, layer: MoELayer, args, implementation: str) -> nn.Module:
    """transformers' DeepseekV3MoE or Qwen2MoeSparseMoeBlock with `layer`'s weights (and selection bias)."""
    ex, k, shared = layer.experts, layer.router.cfg.k, layer.shared.ffn
    E, D, Fh = ex.w1_EDF.shape
    if kind == "deepseek":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=Fh, n_routed_experts=E, num_experts_per_tok=k,
                               n_group=args.groups, topk_group=args.group_topk, norm_topk_prob=True,
                               routed_scaling_factor=2.5, n_shared_experts=1)
        cfg._experts_implementation = implementation
        block = DeepseekV3MoE(cfg)
        mlp = block.shared_experts
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(layer.router.balancer.bias_E)
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        cfg = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=Fh, num_experts=E, num_experts_per_tok=k,
                             shared_expert_intermediate_size=shared.w1.out_features, norm_topk_prob=False)
        cfg._experts_implementation = implementation
        block = Qwen2MoeSparseMoeBlock(cfg)
        mlp = block.shared_expert
        with torch.no_grad():
            block.shared_expert_gate.weight.copy_(layer.shared.gate.weight)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ex.w1_EDF, ex.w3_EDF], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(ex.w2_EFD.transpose(1, 2))
        mlp.gate_proj.weight.copy_(shared.w1.weight)
        mlp.up_proj.weight.copy_(shared.w3.weight)
        mlp.down_proj.weight.copy_(shared.w2.weight)
    return block


def published_rows(kind: str, args, x: torch.Tensor, g: torch.Tensor) -> tuple[dict[str, Step], dict[str, float]]:
    from moep_ds.moe.shared import SharedExpertConfig

    D, F_, E, K = x.shape[-1], args.fine_hidden, args.fine_experts, 4
    if kind == "deepseek":
        router = TopKConfig(k=K, score="sigmoid", renormalize=True, scaling_factor=2.5, bias_update_rate=0.001,
                            num_groups=args.groups, group_topk=args.group_topk, load_balancing_weight=0.0)
        shared, shared_units = SharedExpertConfig(hidden_size=F_, gate="none"), 1
    else:
        router = TopKConfig(k=K, load_balancing_weight=0.0)
        shared, shared_units = SharedExpertConfig(hidden_size=4 * F_, gate="sigmoid"), 4
    cfg = MoEConfig(num_experts=E, expert=FFNConfig(type="swiglu", hidden_size=F_), router=router,
                    shared_expert=shared)
    layer = MoELayer(cfg, d_model=D)
    if kind == "deepseek":
        with torch.no_grad():
            layer.router.balancer.bias_E.copy_(torch.randn(E) * 0.05)
    ours = lambda x_: layer(x_).y  # noqa: E731
    fns = {f"ours_{kind}": (ours, layer.parameters())}
    for impl, name in (("eager", "hf_eager"), ("grouped_mm", "hf_grouped")):
        block = published_block(kind, layer, args, impl)
        fns[name] = (block, block.parameters())
    with torch.no_grad():
        reference = ours(x)
        diffs = {name: (fn(x) - reference).abs().max().item() for name, (fn, _) in fns.items()}
    steps = {name: fwd_bwd(fn, x, g, params) for name, (fn, params) in fns.items()}
    steps["ideal"] = ideal_ffn(layer, x, g, (K + shared_units) * x.shape[1])
    steps["gemm_floor"] = gemm_floor(layer, x)
    return steps, diffs


def gemm_floor(layer: MoELayer, x: torch.Tensor) -> Step:
    """The GEMMs of one forward+backward of `layer` on x's routing, alone (see the module docstring)."""
    x_TD = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad():
        offs = torch.cumsum(layer.router(x).counts_E, 0).to(torch.int32)
    S, ex, ffn = int(offs[-1]), layer.experts, layer.shared.ffn
    w1, w2, w3 = (w.detach() for w in (ex.w1_EDF, ex.w2_EFD, ex.w3_EDF))
    s1, s2, s3 = (lin.weight.detach() for lin in (ffn.w1, ffn.w2, ffn.w3))
    x_SD, g_SD, g_TD = torch.randn(S, x.shape[-1]), torch.randn(S, x.shape[-1]), torch.randn_like(x_TD)

    def step() -> None:
        gm = F.grouped_mm
        h1, h3 = gm(x_SD, w1, offs=offs), gm(x_SD, w3, offs=offs)  # forward (h1 stands in for the activation)
        gm(h1, w2, offs=offs)
        gm(h1.t(), g_SD, offs=offs)  # backward: dW2, da, dW1, dW3, dx (two products)
        da = gm(g_SD, w2.transpose(1, 2), offs=offs)
        gm(x_SD.t(), da, offs=offs), gm(x_SD.t(), h3, offs=offs)
        gm(da, w1.transpose(1, 2), offs=offs), gm(h3, w3.transpose(1, 2), offs=offs)
        a1, a3 = x_TD @ s1.t(), x_TD @ s3.t()  # the shared expert, forward and backward
        a1 @ s2.t()
        da = g_TD @ s2
        g_TD.t() @ a1, da.t() @ x_TD, a3.t() @ x_TD, da @ s1, a3 @ s3

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)  # a micro-batch of 8 x 512
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--ec_d_model", type=int, default=512)
    parser.add_argument("--ec_hidden", type=int, default=2048)
    parser.add_argument("--capacity_factor", type=float, default=1.25)
    parser.add_argument("--top2_d_model", type=int, default=256)
    parser.add_argument("--top2_hidden", type=int, default=896)
    parser.add_argument("--fine_experts", type=positive_int, default=16, help="E of the DeepSeek / Qwen rows")
    parser.add_argument("--fine_hidden", type=positive_int, default=256, help="F of the DeepSeek / Qwen rows")
    parser.add_argument("--groups", type=positive_int, default=4)
    parser.add_argument("--group_topk", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES),
                        help="which tables to run (default: all); the top-2 table needs expert_choice too")
    args = parser.parse_args()
    if "top2" in args.tables and "expert_choice" not in args.tables:
        parser.error("--tables: top2 is printed with the expert choice row; add expert_choice")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    # One thread: CPU time of this process (robust to other processes); several: wall-clock time.
    clock = time.process_time if args.threads == 1 else time.perf_counter
    x = torch.randn(1, args.tokens, args.ec_d_model, requires_grad=True)
    print_header(args)
    if "expert_choice" in args.tables:  # a subset of the tables draws other random weights than the full run
        ec = time_rows(expert_choice_rows(args, x, torch.randn_like(x)), args.repeats, clock)
    x = torch.randn(1, args.tokens, args.top2_d_model, requires_grad=True)
    if "top2" in args.tables:
        steps, diffs = top2_rows(args, x, torch.randn_like(x))
        print_table(args, ec, time_rows(steps, args.repeats, clock), diffs)
    elif "expert_choice" in args.tables:
        print_expert_choice(args, ec)
    for kind in ("deepseek", "qwen"):
        if kind not in args.tables:
            continue
        steps, diffs = published_rows(kind, args, x, torch.randn_like(x))
        print_published(kind, time_rows(steps, args.repeats, clock), diffs)


def print_header(args) -> None:
    clock = "CPU time" if args.threads == 1 else "wall time"
    print(f"MoE layer forward+backward, CPU, {args.threads} thread(s), {clock}, best of {args.repeats}; "
          f"N={args.tokens} tokens, E={args.experts}; torch {torch.__version__}")
    print(f"{'row':<46} {'ours ms':>8} {'other ms':>9} {'ratio':>6}  {'target':<12} max|y-ours|")


def print_expert_choice(args, ec: dict[str, float]) -> None:
    ratio = ec["ours_expert_choice"] / ec["ideal"]
    verdict = "ok" if ratio <= 1.10 else "missed"
    print(f"{f'expert choice (c={args.capacity_factor:g}) / ideal dense bound':<46} "
          f"{ec['ours_expert_choice'] * 1e3:8.1f} {ec['ideal'] * 1e3:9.1f} {ratio:6.3f}  {'<= 1.10 ' + verdict:<12}")


def print_table(args, ec: dict[str, float], top2: dict[str, float], diffs: dict[str, float]) -> None:
    print_expert_choice(args, ec)
    ours = top2["ours_top2"]
    ratio = ours / top2["ideal"]
    print(f"{'top-2 / ideal dense bound (2N tokens)':<46} {ours * 1e3:8.1f} {top2['ideal'] * 1e3:9.1f} {ratio:6.3f}  "
          f"{'<= 1.15 ' + ('ok' if ratio <= 1.15 else 'missed'):<12}")
    for name in ("hf_eager", "hf_grouped", "deepspeed", "deepspeed_dropless", "ours_top2_loop", "naive_loop",
                 "ours_top2_unfused"):
        speedup = top2[name] / ours
        target = f">= 1.10 {'ok' if speedup >= 1.10 else 'missed'}" if name.startswith(("hf", "deepspeed")) else ""
        print(f"{f'top-2: {name} / ours (speed-up)':<46} {ours * 1e3:8.1f} {top2[name] * 1e3:9.1f} "
              f"{speedup:6.3f}  {target:<12} {diffs[name]:.1e}")
    print(f"{'top-2: ideal_unfused / ideal (speed-up)':<46} {top2['ideal'] * 1e3:8.1f} "
          f"{top2['ideal_unfused'] * 1e3:9.1f} {top2['ideal_unfused'] / top2['ideal']:6.3f}")


def print_published(kind: str, times: dict[str, float], diffs: dict[str, float]) -> None:
    ours = times[f"ours_{kind}"]
    ratio = ours / times["ideal"]
    print(f"{f'{kind} / ideal dense bound':<46} {ours * 1e3:8.1f} {times['ideal'] * 1e3:9.1f} {ratio:6.3f}  "
          f"{'<= 1.15 ' + ('ok' if ratio <= 1.15 else 'missed'):<12}")
    for name in ("hf_eager", "hf_grouped"):
        speedup = times[name] / ours
        print(f"{f'{kind}: {name} / ours (speed-up)':<46} {ours * 1e3:8.1f} {times[name] * 1e3:9.1f} "
              f"{speedup:6.3f}  {'>= 1.10 ' + ('ok' if speedup >= 1.10 else 'missed'):<12} {diffs[name]:.1e}")
    floor = times["gemm_floor"]
    print(f"{f'{kind}: ours / GEMM floor':<46} {ours * 1e3:8.1f} {floor * 1e3:9.1f} {ours / floor:6.3f}")
    print(f"{f'{kind}: hf_grouped / GEMM floor (ceiling)':<46} {times['hf_grouped'] * 1e3:8.1f} "
          f"{floor * 1e3:9.1f} {times['hf_grouped'] / floor:6.3f}")


if __name__ == "__main__":
    main()
