"""Activation checkpointing: peak memory and losses of the Trainer with `train.activation_checkpointing` off / on.

# B micro-batch, T sequence length

Each row is a fresh process running `Trainer(cfg, ds_configs/zero0_fp32.json).fit()` on one process (gloo),
`configs/nova_moe.yaml` at full width by default on the embedded corpus (`data.source=builtin`), T=512, B=16,
3 optimizer steps. Per row:
  peak RSS       ru_maxrss of the training process (everything: libraries, weights, gradients, Adam state,
                 activations)
  peak above base  ru_maxrss minus the RSS just before the model is built (after imports, the process group
                 and a throwaway AdamW step, as in bench/train_throughput.py)
  losses         the metrics.jsonl loss of every step (must be identical with and without)
Targets (printed): peak RSS with checkpointing <= 0.50 x without; losses identical.

    python bench/activation_memory.py                         # nova_moe, T 512, B 16, 3 steps (~10 min on CPU)
    python bench/activation_memory.py --overrides model.d_model=64 --seq_len 64 --micro_batch 4   # seconds
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from train_throughput import current_rss, warm_up_lazy_init, worker_env  # noqa: E402

log = logging.getLogger("activation_memory")


def overrides(args: argparse.Namespace, out_dir: pathlib.Path, checkpointing: bool) -> list[str]:
    return [
        "data.source=builtin", f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}",
        f"train.output_dir={out_dir}", f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=null",
        "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false", "train.exit_at_step=null",
        f"train.micro_batch_size={args.micro_batch}", "train.global_batch_size=null",
        f"train.activation_checkpointing={str(checkpointing).lower()}", *args.overrides,
    ]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare
    from moep_ds.training.distributed import init_distributed
    from moep_ds.training.ds_config import read_ds_config
    from moep_ds.training.trainer import Trainer

    init_distributed()
    out_dir = pathlib.Path(args.work_dir) / f"ckpt_{args.checkpointing}"
    cfg = load_config(REPO / args.config, overrides(args, out_dir, args.checkpointing))
    prepare(cfg.data)
    warm_up_lazy_init()
    baseline = current_rss()
    ds = read_ds_config(str(REPO / "ds_configs" / "zero0_fp32.json"))
    ds["tensorboard"] = {"enabled": False}
    Trainer(cfg, ds, None).fit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"peak_rss": peak, "peak_above_base": peak - baseline, "losses": losses}
    pathlib.Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, checkpointing: bool) -> dict:
    result = pathlib.Path(args.work_dir) / f"result_{checkpointing}.json"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--checkpointing", str(checkpointing),
           "--result", str(result), "--work_dir", args.work_dir, "--config", args.config, "--seq_len",
           str(args.seq_len), "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
           "--overrides", *args.overrides]
    proc = subprocess.run(cmd, env=worker_env(args.threads), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"activation_checkpointing={checkpointing} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/nova_moe.yaml")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--overrides", nargs="*", default=[], help="extra recipe overrides (a.b=v)")
    p.add_argument("--work_dir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", default="False", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.worker:
        args.checkpointing = args.checkpointing == "True"
        worker(args)
        os._exit(0)
    with tempfile.TemporaryDirectory(prefix="moep_actmem_") as tmp:
        args.work_dir = args.work_dir or tmp
        rows = {ckpt: run(args, ckpt) for ckpt in (False, True)}
    print(f"# activation_memory: {args.config} {' '.join(args.overrides)}, T {args.seq_len}, micro-batch "
          f"{args.micro_batch}, {args.steps} steps, 1 process, ZeRO-0 fp32, {args.threads} thread(s)")
    print("| activation checkpointing | peak RSS MiB | peak above base MiB | losses |")
    print("|---|---:|---:|---|")
    for ckpt, r in rows.items():
        losses = ", ".join(f"{v:.6f}" for v in r["losses"])
        print(f"| {'on' if ckpt else 'off'} | {r['peak_rss'] / 2**20:.0f} | {r['peak_above_base'] / 2**20:.0f} | "
              f"{losses} |")
    off, on = rows[False], rows[True]
    ratio = on["peak_rss"] / off["peak_rss"]
    print(f"peak RSS on / off = {ratio:.2f} (target <= 0.50: {'met' if ratio <= 0.5 else 'MISSED'}); losses "
          f"{'identical' if on['losses'] == off['losses'] else 'DIFFER'} over {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
