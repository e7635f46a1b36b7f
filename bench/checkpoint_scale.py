"""Checkpoint cost per rank: sharded DCP checkpoints, saved synchronously and asynchronously (the trainer's save).

    python bench/checkpoint_scale.py --ranks 1 2 4 --resume-on 2 [--stage 3] [--set model.d_model=128 ...]
    python bench/checkpoint_scale.py --ranks 4 --checksums xxh3_128 sha256 none --repeat 3

For each world size it launches torchrun with this file as the worker: the recipe (configs/nova_moe.yaml at
full width, data.source=builtin, micro-batch 1 x 32 tokens) trains one step, then, for each checksum algorithm of
the manifest (`--checksums`; `none`: no manifest, as before 2026-12-07), saves (sync, then async) and loads,
`--repeat` times each, interleaved (the median is reported). For each it reports the save stall (time until training could go
on), the time until the checkpoint is complete (for an async save: its write and manifest in the background), the
load time (the checksums verified in shares by the ranks, then masters and moments into the live engine), the peak
resident memory a save adds to a rank over its level after the step (sampled every 5 ms; the largest over ranks),
and the largest file's share of the checkpoint's bytes. Prints one markdown table; `--json` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Largest resident set size seen while the block runs, minus the level at entry."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.added = self.peak - self.base


def resume_worker(args, cfg) -> None:
    """Resume the largest run's sharded checkpoint at this (smaller) world size and train one step."""
    import torch.distributed as dist

    from moep_ds.training.trainer import build_trainer

    start = time.perf_counter()
    trainer = build_trainer(cfg, str(REPO / f"ds_configs/zero{args.stage}_fp32.json"), args.resume)
    seconds = time.perf_counter() - start
    trainer.module.engine.train()
    losses, _ = trainer.module.train_step()
    if dist.get_rank() == 0:
        row = {"ranks": dist.get_world_size(), "resumed_step": trainer.step, "init_and_load_s": seconds, **losses}
        (pathlib.Path(args.out) / "resume.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from moep_ds.checkpointing import sharded
    from moep_ds.config import load_config
    from moep_ds.training import checkpoint as ckpt_io
    from moep_ds.training.trainer import build_trainer

    out = pathlib.Path(args.out)
    cfg = load_config(REPO / "configs/nova_moe.yaml", [
        "data.source=builtin", "data.seq_len=32", "train.micro_batch_size=1", f"train.output_dir={out}",
        "train.max_steps=1", "train.log_every=1", *args.set])
    if args.resume:
        return resume_worker(args, cfg)
    trainer = build_trainer(cfg, str(REPO / f"ds_configs/zero{args.stage}_fp32.json"), None)
    module = trainer.module
    module.engine.train()
    module.train_step()
    trainer.step = 1
    rank = dist.get_rank()
    rows = {}

    def slowest(seconds: float) -> float:  # over the ranks: the save or load is done when the last rank is
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def measure_once(save, load, path):
        dist.barrier()
        with PeakRSS() as mem:
            start = time.perf_counter()
            save()
            stall = time.perf_counter() - start
            trainer.checkpointer.wait()
            done = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        load()
        load_s = time.perf_counter() - start
        return {"stall_s": slowest(stall), "done_s": slowest(done), "load_s": slowest(load_s),
                "peak_added_bytes": float(mem.added)}

    runs, files = {}, {}

    def measure(name, save, load, path):
        runs.setdefault(name, []).append(measure_once(save, load, path))
        files[name] = sharded.sizes_per_file(path)

    def summarise(name):
        peak = torch.tensor([max(r["peak_added_bytes"] for r in runs[name])])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        sizes = files[name]
        rows[name] = {**{k: statistics.median(r[k] for r in runs[name]) for k in ("stall_s", "done_s", "load_s")},
                      "peak_added_bytes": float(peak), "files": len(sizes), "total_bytes": sum(sizes.values()),
                      "largest_file_share": max(sizes.values()) / sum(sizes.values())}

    sharded_path = out / "checkpoints" / "step_00000001"

    def load_sharded(checksum):
        def load():
            if checksum != "none":  # as a resume checks it (training/checkpoint.py check_checkpoint)
                ckpt_io.check_together(sharded_path)
            ckpt_io.load_pieces(module.engine, module.model, sharded_path, module.plan)
        return load

    writers = {(mode, checksum): ckpt_io.CheckpointWriter(trainer.run_dir, keep_last=1, async_save=mode == "async",
                                                          checksum=None if checksum == "none" else checksum)
               for mode in ("sync", "async") for checksum in args.checksums}
    for _ in range(args.repeat):  # interleaved, so that a drift in the machine's load touches every row alike
        for (mode, checksum), writer in writers.items():
            trainer.checkpointer.writer = writer
            measure(f"sharded ({mode}, {checksum})", trainer.save, load_sharded(checksum), sharded_path)
    for name in runs:
        summarise(name)
    rows = {k: {**v, "rank_rss_after_step": rss()} for k, v in rows.items()}
    if rank == 0:
        (out / "rows.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_worker(ranks: int, stage: int, out: str, sets: list[str], *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           __file__, "--worker", "--out", out, "--stage", str(stage), *extra, "--set", *sets]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-4000:]}")


def launch(ranks: int, stage: int, sets: list[str], resume_on: int | None, options: list[str]) -> dict:
    """Rows of one world size; with `resume_on`, its sharded checkpoint also resumes at that world size."""
    with tempfile.TemporaryDirectory() as tmp:
        run_worker(ranks, stage, tmp, sets, *options)
        rows = json.loads((pathlib.Path(tmp) / "rows.json").read_text())
        if resume_on:
            out = pathlib.Path(tmp) / "resumed"
            out.mkdir()
            run_worker(resume_on, stage, str(out), sets, "--resume", f"{tmp}/checkpoints/step_00000001")
            rows["resume"] = json.loads((out / "resume.json").read_text())
        return rows


def table(results: dict[int, dict]) -> str:
    lines = ["| ranks | format, checksum | save stall s | saved s | load s | peak added / rank MiB | files | "
             "largest file share |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for ranks, rows in results.items():
        for name, r in rows.items():
            if name == "resume":
                continue
            lines.append(f"| {ranks} | {name} | {r['stall_s']:.2f} | {r['done_s']:.2f} | {r['load_s']:.2f} | "
                         f"{r['peak_added_bytes'] / 2**20:,.0f} | {r['files']} | {r['largest_file_share']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--resume-on", type=int, help="resume the largest run's checkpoint at this many ranks")
    p.add_argument("--checksums", nargs="+", default=["xxh3_128", "none"],
                   help="the manifest's algorithm per measurement (none: no manifest)")
    p.add_argument("--repeat", type=int, default=1, help="saves and loads per row (the median is reported)")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    p.add_argument("--resume", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    largest = max(args.ranks)
    options = ["--repeat", str(args.repeat), "--checksums", *args.checksums]
    results = {n: launch(n, args.stage, args.set, args.resume_on if n == largest else None, options)
               for n in args.ranks}
    print(table(results))
    if "resume" in results[largest]:
        r = results[largest]["resume"]
        print(f"\n{largest}-rank checkpoint resumed on {r['ranks']} ranks at step {r['resumed_step']}: "
              f"next loss {r['loss']:.4f}, build + load {r['init_and_load_s']:.1f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
