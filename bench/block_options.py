"""The recipe's block options: peak memory, speed and losses of the Trainer with `train.activation_checkpointing`
or `train.compile` off / on.

# B micro-batch, T sequence length

Each row is a fresh process running `build_trainer(cfg, ds_configs/<--ds_config>.json).fit()` on one process (gloo)
on the embedded corpus (`data.source=builtin`). Defaults: activation checkpointing, `configs/nova_moe.yaml` at full
width, T=512, B=16, 3 optimizer steps, ZeRO-0 fp32. Per row:
  peak RSS       ru_maxrss of the training process (everything: libraries, weights, gradients, Adam state,
                 activations)
  peak above base  ru_maxrss minus the RSS just before the model is built (after imports, the process group
                 and a throwaway AdamW step, as in bench/train_throughput.py)
  tok/s          median of the Trainer's tokens_per_s after the first step (compilation happens there)
  losses         the metrics.jsonl loss of every step
With activation checkpointing on CPU the Trainer also makes freed host buffers of >= 1 MiB go back to the OS
(training/host_memory.py); a third row, "off + freed buffers returned", runs without checkpointing under that same
allocator setting, to show how much of the difference is the allocator's.
Targets (printed): activation checkpointing: peak RSS <= 0.50 x without (what switching it on gives), losses
identical; compile: losses within 1e-5 of eager.

    python bench/block_options.py                             # checkpointing, nova_moe, T 512, B 16, 3 steps
    python bench/block_options.py --option compile --config configs/quickstart.yaml --ds_config quickstart \
        --seq_len 64 --micro_batch 8 --steps 5                # compile on the quick start recipe
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from moep_ds.distributed.commands import positive_int  # noqa: E402
from train_throughput import current_rss, warm_up_lazy_init, worker_env  # noqa: E402

log = logging.getLogger("block_options")


def overrides(args: argparse.Namespace, out_dir: pathlib.Path, on: bool) -> list[str]:
    return [
        "data.source=builtin", f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}",
        f"train.output_dir={out_dir}", f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=null",
        "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false", "train.exit_at_step=null",
        f"train.micro_batch_size={args.micro_batch}", "train.global_batch_size=null",
        f"train.{args.option}={str(on).lower()}", *args.overrides,
    ]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.training.ds_config import read_ds_config
    from moep_ds.training.host_memory import return_freed_buffers_to_os
    from moep_ds.training.trainer import build_trainer

    init_distributed()
    if args.release and not return_freed_buffers_to_os():
        raise RuntimeError("--release: glibc's mmap threshold could not be set here")
    out_dir = pathlib.Path(args.work_dir) / f"{args.option}_{args.on}_{args.release}"
    cfg = load_config(REPO / args.config, overrides(args, out_dir, args.on))
    prepare(cfg.data)
    warm_up_lazy_init()
    baseline = current_rss()
    ds = read_ds_config(str(REPO / "ds_configs" / f"{args.ds_config}.json"))
    ds["tensorboard"] = {"enabled": False}
    build_trainer(cfg, ds, None).fit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    result = {"peak_rss": peak, "peak_above_base": peak - baseline, "losses": [m["loss"] for m in metrics],
              "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics[1:] or metrics)}
    pathlib.Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, on: bool, release: bool = False) -> dict:
    result = pathlib.Path(args.work_dir) / f"result_{on}_{release}.json"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--on", str(on), "--option", args.option,
           *(["--release"] if release else []),
           "--ds_config", args.ds_config,
           "--result", str(result), "--work_dir", args.work_dir, "--config", args.config, "--seq_len",
           str(args.seq_len), "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
           "--overrides", *args.overrides]
    proc = subprocess.run(cmd, env=worker_env(args.threads), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"train.{args.option}={on} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--option", default="activation_checkpointing", choices=["activation_checkpointing", "compile"])
    p.add_argument("--config", default="configs/nova_moe.yaml")
    p.add_argument("--ds_config", default="zero0_fp32", help="a file stem in ds_configs/")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--overrides", nargs="*", default=[], help="extra recipe overrides (a.b=v)")
    p.add_argument("--work_dir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--on", default="False", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--release", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.worker:
        args.on = args.on == "True"
        worker(args)
        os._exit(0)
    with tempfile.TemporaryDirectory(prefix="moep_block_options_") as tmp:
        args.work_dir = args.work_dir or tmp
        rows = {on: run(args, on) for on in (False, True)}
        released_off = run(args, False, release=True) if args.option == "activation_checkpointing" else None
    print(f"# block_options: train.{args.option} off / on; {args.config} {' '.join(args.overrides)}, T {args.seq_len}, "
          f"micro-batch {args.micro_batch}, {args.steps} steps, 1 process, ds_configs/{args.ds_config}.json, "
          f"{args.threads} thread(s)")
    print(f"| train.{args.option} | peak RSS MiB | peak above base MiB | tok/s | losses |")
    print("|---|---:|---:|---:|---|")
    named = [("off", rows[False]), ("on", rows[True])]
    if released_off is not None:
        named.insert(1, ("off + freed buffers returned", released_off))
    for name, r in named:
        losses = ", ".join(f"{v:.7f}" for v in r["losses"])
        print(f"| {name} | {r['peak_rss'] / 2**20:.0f} | {r['peak_above_base'] / 2**20:.0f} | "
              f"{r['tokens_per_s']:.0f} | {losses} |")
    off, on = rows[False], rows[True]
    diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))
    ratio = on["peak_rss"] / off["peak_rss"]
    if args.option == "activation_checkpointing":
        print(f"peak RSS on / off = {ratio:.2f} (target <= 0.50: {'met' if ratio <= 0.5 else 'MISSED'}); losses "
              f"{'identical' if on['losses'] == off['losses'] else 'DIFFER'} over {args.steps} steps")
        same = on["peak_rss"] / released_off["peak_rss"]
        print(f"peak RSS on / off under the same allocator setting = {same:.2f}; losses "
              f"{'identical' if released_off['losses'] == off['losses'] else 'DIFFER'}")
    else:
        speed = on["tokens_per_s"] / off["tokens_per_s"]
        print(f"max |loss on - loss off| over {args.steps} steps = {diff:.2e} (target <= 1e-5: "
              f"{'met' if diff <= 1e-5 else 'MISSED'}); tok/s on / off = {speed:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
