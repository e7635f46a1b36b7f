"""Model FLOP utilisation on one GPU: the 1B recipes and msit_babylm trained in bf16 under DeepSpeed ZeRO-2.

# B micro-batch, T sequence length, N matmul size

For each recipe: build the model on the GPU, wrap it with `deepspeed.initialize` exactly as the Trainer does
(AdamW parameter groups from moep_ds.training.optim, ds_configs/zero2_bf16.json reconciled with the recipe),
run --warmup untimed steps, then --steps timed steps (forward, backward, optimizer step) on random token
batches. Each recipe runs in --variants: `eager`, `ckpt` (train.activation_checkpointing), `compile`
(train.compile), `ckpt+compile`, applied per block as the Trainer does (moep_ds.training.blocks); the default is
eager and ckpt+compile for the 1B recipes, eager for msit_babylm (compilation costs a minute or two per row).
Reported per recipe and variant:
  tokens/s   B x T x steps / wall time of the timed steps (synchronised before and after)
  TFLOP/s    tokens/s x flops_per_token (moep_ds.models.accounting: 6 x active matmul parameters + attention,
             i.e. model FLOPs; activation recomputation and routing overhead are not counted as useful work)
  MFU        TFLOP/s / the peak of a large bf16 matmul measured on the same GPU in the same run (and, for
             reference, / the vendor's nominal dense bf16 peak where the GPU is known)
  compiled graphs / breaks   compiled rows: distinct graphs torch.compile made and graph breaks it met (its
             own counters, reset per row); no breaks expected except in MoEP paths, whose per-path loop takes the
             counts to the host (a CPU dry run has more: its bf16 experts run the loop kernel, which does too)
Targets (printed, not asserted): pythia_1b_dense >= 45% MFU, the MoE variants >= 35%.

    bench/gpu_mfu.sh                          # one command, one GPU, under 8 minutes
    python bench/gpu_mfu.py --recipes pythia_1b_dense --steps 10
    python bench/gpu_mfu.py --dry_run         # CPU, toy sizes, 2 steps: checks the whole path in seconds
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/gpu_mfu.py` from a checkout, installed or not

import torch  # noqa: E402
from moep_ds.distributed.commands import non_negative_int, positive_int  # noqa: E402

log = logging.getLogger("gpu_mfu")

RECIPES = ["pythia_1b_dense", "pythia_1b_moep", "pythia_1b_ffn_moe", "msit_babylm"]
MICRO_BATCH = {"pythia_1b_dense": 8, "pythia_1b_moep": 8, "pythia_1b_ffn_moe": 8, "msit_babylm": 64}
TARGET_MFU = {"pythia_1b_dense": 0.45, "pythia_1b_moep": 0.35, "pythia_1b_ffn_moe": 0.35, "msit_babylm": 0.35}

VARIANTS = {"eager": (False, False), "ckpt": (True, False), "compile": (False, True), "ckpt+compile": (True, True)}
DEFAULT_VARIANTS = {"pythia_1b_dense": ["eager", "ckpt+compile"], "pythia_1b_moep": ["eager", "ckpt+compile"],
                    "pythia_1b_ffn_moe": ["eager", "ckpt+compile"], "msit_babylm": ["eager"]}
TOY = ["model.vocab_size=512", "model.d_model=64", "model.max_seq_len=64", "model.layers[0].repeat=2"]
DRY_RUN_OVERRIDES = {  # same block types and routers, toy dimensions
    "pythia_1b_dense": TOY,
    "pythia_1b_moep": TOY[:3] + ["model.layers[0].d_path=32", "model.layers[0].path_depth=2",
                                 "model.layers[0].path_ffn.hidden_size=128"],
    "pythia_1b_ffn_moe": TOY + ["model.layers[0].moe.expert.hidden_size=32"],
    "msit_babylm": TOY + ["model.layers[0].experts.d_thin=96", "model.layers[0].experts.num_heads=2",
                          "data.tokenizer.vocab_size=512"],
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, sizes: list[int], iters: int) -> tuple[float, int]:
    """Best bf16 TFLOP/s of an N x N x N matmul over `sizes`: the practical peak the MFU is measured against."""
    best, best_n = 0.0, sizes[0]
    for n in sizes:
        a_NN = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b_NN = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        out_NN = torch.empty_like(a_NN)
        for _ in range(3):
            torch.matmul(a_NN, b_NN, out=out_NN)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a_NN, b_NN, out=out_NN)
        synchronize(device)
        tflops = 2 * n**3 * iters / (time.perf_counter() - start) / 1e12
        if tflops > best:
            best, best_n = tflops, n
        del a_NN, b_NN, out_NN
    return best, best_n


def nominal_peak_tflops(device: torch.device) -> float | None:
    from moep_ds.training.startup import PEAK_TFLOPS_BF16

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)


def build_engine(cfg, device: torch.device, variant: str):
    """The Trainer's engine setup (model, block options, AdamW groups, ZeRO-2 bf16) on one rank, without the
    data pipeline."""
    import deepspeed

    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.blocks import apply_block_options
    from moep_ds.training.ds_config import read_ds_config, reconcile
    from moep_ds.training.optim import build_optimizer, param_groups

    ds = reconcile(read_ds_config(str(REPO / "ds_configs" / "zero2_bf16.json")), cfg.train, 1)
    ds["tensorboard"] = {"enabled": False}
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = build_model(cfg.model)
    ckpt, compile_ = VARIANTS[variant]
    apply_block_options(model, activation_checkpointing=ckpt, compile=compile_)
    optimizer = build_optimizer(param_groups(model, cfg.train.optimizer), cfg.train.optimizer)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, dist_init_required=False)
    return engine


def timed_steps(engine, batches_BT1: list[torch.Tensor], warmup: int, steps: int, device: torch.device) -> float:
    """Seconds for `steps` training steps after `warmup` untimed ones."""
    engine.train()
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        window_BT1 = batches_BT1[i % len(batches_BT1)]
        out = engine(window_BT1[:, :-1], labels=window_BT1[:, 1:])
        engine.backward(out.loss)
        engine.step()
    synchronize(device)
    return time.perf_counter() - start


def bench_recipe(name: str, variant: str, args: argparse.Namespace, device: torch.device, peak: float) -> dict:
    from moep_ds.config import load_config
    from moep_ds.models.accounting import meta_param_report

    batch = args.micro_batch or MICRO_BATCH[name]
    overrides = (DRY_RUN_OVERRIDES[name] if args.dry_run else []) + [
        f"train.micro_batch_size={batch}", "train.global_batch_size=null"]
    cfg = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    seq = cfg.data.seq_len
    report = meta_param_report(cfg.model, seq)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()  # the graph counts below are this row's
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine = build_engine(cfg, device, variant)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(cfg.model.vocab_size, (batch, seq + 1), generator=generator).to(device)
               for _ in range(4)]
    seconds = timed_steps(engine, batches, args.warmup, args.steps, device)
    tokens_per_s = batch * seq * args.steps / seconds
    tflops = tokens_per_s * report.flops_per_token / 1e12
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    compiled = VARIANTS[variant][1]
    graphs = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) if compiled else None
    engine.destroy()
    return {"variant": variant, "params": report.params_total, "active": report.params_active, "batch": batch,
            "seq": seq, "graphs": graphs,
            "tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": tflops / peak, "memory_gib": memory}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row(name: str, r: dict, nominal: float | None, dry_run: bool) -> str:
    mfu_nominal = f"{100 * r['tflops'] / nominal:.1f}%" if nominal else "-"
    memory = f"{r['memory_gib']:.1f}" if r["memory_gib"] is not None else "-"
    graphs = "-" if r["graphs"] is None else f"{r['graphs'][0]} / {r['graphs'][1]}"
    target = TARGET_MFU[name]
    verdict = "n/a (dry run)" if dry_run else "met" if r["mfu"] >= target else "MISSED"
    return (f"| {name} | {r['variant']} | {r['params'] / 1e6:.1f}M / {r['active'] / 1e6:.1f}M | "
            f"{r['batch']} x {r['seq']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {100 * r['mfu']:.1f}% | {mfu_nominal} | {memory} | "
            f"{graphs} | >= {100 * target:.0f}%: {verdict} |")


def header(device: torch.device, peak: float, peak_n: int, nominal: float | None,
           args: argparse.Namespace) -> list[str]:
    import deepspeed

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU dry run ({os.cpu_count()} CPUs)"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# gpu_mfu: {date} | {gpu} | torch {torch.__version__} | deepspeed {deepspeed.__version__}",
        f"# ZeRO-2 bf16, {args.steps} timed steps after {args.warmup} warm-up; measured bf16 matmul peak "
        f"{peak:.1f} TFLOP/s (N={peak_n}){f'; nominal {nominal:.0f} TFLOP/s' if nominal else ''}",
        "| recipe | variant | params total / active | B x T | tokens/s | TFLOP/s | MFU (measured peak) | "
        "MFU (nominal) | "
        "peak mem GiB | compiled graphs / breaks | target |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 20; 2 with --dry_run)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="untimed steps first (default 3; 1 with --dry_run)")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="block options per recipe (default: eager + ckpt+compile for the 1B recipes, eager for "
                        "msit_babylm; ckpt with --dry_run)")
    p.add_argument("--micro_batch", type=int, default=None, help="override every recipe's micro-batch")
    p.add_argument("--dry_run", action="store_true", help="CPU, toy sizes: check the path, not the numbers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args.steps = args.steps or (2 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    from moep_ds.distributed.process_group import init_distributed

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device here; use --dry_run to check the path on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine (before anything initialises CUDA)
    device = init_distributed()
    peak, peak_n = matmul_peak_tflops(device, [128, 256] if args.dry_run else [4096, 8192, 16384],
                                      iters=5 if args.dry_run else 30)
    nominal = nominal_peak_tflops(device)
    print("\n".join(header(device, peak, peak_n, nominal, args)), flush=True)
    failed = []
    for name in args.recipes:  # each row is printed as soon as it is measured: a killed run keeps its rows
        variants = args.variants or (["ckpt"] if args.dry_run else DEFAULT_VARIANTS[name])
        for variant in variants:
            start = time.perf_counter()
            try:
                print(row(name, bench_recipe(name, variant, args, device, peak), nominal, args.dry_run), flush=True)
            except Exception as err:  # one row failing (e.g. out of memory) must not lose the others' numbers
                log.exception("%s %s failed", name, variant)
                print(f"| {name} | {variant} | failed: {type(err).__name__}: {str(err).splitlines()[0][:120]} |",
                      flush=True)
                failed.append(name)
            log.info("%s %s: %.1f s", name, variant, time.perf_counter() - start)
            free_memory(device)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown of DeepSpeed/process-group state
