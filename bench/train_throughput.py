"""Training throughput and memory: a plain PyTorch loop against our Trainer under DeepSpeed ZeRO 0-3.

# P processes (data-parallel ranks), B micro-batch per rank, T sequence length

For each model (the dense, Nova-MoE and MSIT recipes, shrunk by overrides to a CPU size) one run measures:
  plain      the same model, data and AdamW parameter groups in a hand-written loop: batch -> forward ->
             backward -> clip -> AdamW -> schedule, one process, no DeepSpeed (the reference, "(a)")
  zeroS xP   `moep_ds.training.trainer.build_trainer(...).fit()` with ZeRO stage S on P processes (torchrun, gloo)
Every row is its own fresh process (or process group), launched one after another with OMP_NUM_THREADS=1 per
process, so that peak memory is a clean per-process high-water mark. Per row:
  tok/s            all ranks together: median over the timed steps (after --warmup) of tokens per optimizer step /
                   step time (the Trainer's own `tokens_per_s` in metrics.jsonl; the plain loop times the same span)
  CPU tok/s/rank   tokens per optimizer step / median process CPU time of a step (the Trainer's `train_step`:
                   forward, backward and DeepSpeed's step; the plain loop: the same span), per rank. CPU time of
                   a one-thread process counts only its own work, so on a shared, loaded machine this column
                   compares the work each side does where wall-clock rows mostly measure the load;
                   "CPU vs plain" is its ratio (--clock cpu, the default, makes the targets use it).
  tok/s/rank       tok/s / P; "vs plain" is this over the plain loop's tok/s. Every rank of a 2-process row does
                   the plain loop's work per step (same micro-batch, weak scaling), so 1.00 means no overhead.
                   On a machine with fewer free cores than 2 x threads the ranks compete for CPU: read the
                   2-process column as what it is on that machine.
  peak mem/rank    CPU: ru_maxrss minus the RSS just before the model is built (the largest over ranks);
                   GPU: torch.cuda.max_memory_allocated
  opt state/rank   bytes of the tensors in the torch optimizer's state (Adam moments and step counters) inside
                   DeepSpeed's wrappers (`moep_ds.distributed.optimizer_state.inner_optimizer`), the largest over ranks
Targets (printed, not asserted): ZeRO-2 on 1 process >= 0.90 x plain; ZeRO-2 / ZeRO-0 optimizer state per rank
on 2 processes <= 0.55.

--paired (one process per model and stage) alternates the two sides step by step instead: a plain-loop step, a
Trainer step (`train_step`, ZeRO-S on this one process), the order swapped every pair, each timed in CPU time.
It prints the median over step pairs of plain step time / Trainer step time (= Trainer tok/s / plain tok/s) and
its interquartile range. A shared VM's speed drifts by 10-20% over the seconds a row takes, which moves the
per-row ratios above by as much; within a pair the drift cancels. Memory columns need a process per side, so
this mode prints none.

    python bench/train_throughput.py                                   # 3 models x (plain + ZeRO 0-3 x 1, 2 procs)
    python bench/train_throughput.py --models dense --stages 0 2 --nprocs 2 --size toy --steps 4   # seconds
    python bench/train_throughput.py --paired --stages 2 --steps 60 --repeats 2     # ZeRO-2 x1 vs plain, paired
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/train_throughput.py` from a checkout, installed or not
from moep_ds.distributed.commands import non_negative_int, positive_int  # noqa: E402
log = logging.getLogger("train_throughput")
RECIPES = {"dense": "configs/nova_dense.yaml", "nova_moe": "configs/nova_moe.yaml", "msit": "configs/msit_babylm.yaml"}
ZERO2_VS_PLAIN = 0.90  # target: ZeRO-2 on one process, tok/s over the plain loop's
SIZES = {  # d model dim, T sequence, L layers (pairs for nova), B micro-batch per rank, V vocabulary
    "toy": {"d": 32, "T": 32, "L": 1, "B": 4, "V": 512},
    "small": {"d": 128, "T": 128, "L": 2, "B": 8, "V": 512},
    # the recipes' tokens per micro-batch (16 x 512) at small width: DeepSpeed's per-step work grows with the
    # parameters, the model's with the tokens, so this is the ratio a recipe's step sees
    "recipe_batch": {"d": 128, "T": 512, "L": 2, "B": 16, "V": 512},
}


def model_overrides(model: str, s: dict) -> list[str]:
    """Shrink a recipe to size `s`, keeping its block types, routers and proportions."""
    d, L = s["d"], s["L"]
    common = [f"model.vocab_size={s['V']}", f"model.d_model={d}", f"model.max_seq_len={s['T']}"]
    if model == "dense":
        return common + [f"model.layers[0].repeat={2 * L}", f"model.layers[0].ffn.hidden_size={4 * d}"]
    if model == "nova_moe":
        return common + [f"model.layers[0].repeat={L}", f"model.layers[0].layers[0].ffn.hidden_size={4 * d}",
                         f"model.layers[0].layers[1].moe.expert.hidden_size={4 * d}"]
    if model == "msit":
        return common + [f"model.layers[0].repeat={L}", f"model.layers[0].experts.d_thin={3 * d // 2}",
                         "model.layers[0].experts.num_heads=2"]
    raise ValueError(f"unknown model {model!r}; known: {', '.join(RECIPES)}")


def recipe_overrides(model: str, size: str, out_dir: pathlib.Path, steps: int) -> list[str]:
    s = SIZES[size]
    return model_overrides(model, s) + [
        "data.source=builtin", f"data.tokenizer.vocab_size={s['V']}", f"data.seq_len={s['T']}",
        f"train.output_dir={out_dir}", f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=null",
        "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false",
        f"train.micro_batch_size={s['B']}", "train.global_batch_size=null", "train.exit_at_step=null",
    ]


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    mode: str  # "plain", "zero0" .. "zero3", or "paired0" .. "paired3" (--paired: plain and ZeRO-S alternating)
    nproc: int

    @property
    def name(self) -> str:
        if self.mode.startswith("paired"):
            return f"zero{self.mode[-1]} x1 / plain, paired"
        return "plain" if self.mode == "plain" else f"{self.mode} x{self.nproc}"


def ds_config(stage: int, precision: str) -> dict:
    from moep_ds.training.ds_config import read_ds_config

    ds = read_ds_config(str(REPO / "ds_configs" / f"zero{stage}_{precision}.json"))
    ds["tensorboard"] = {"enabled": False}  # not part of what is measured
    return ds


# ---- worker: one row, in this process (one rank of it) --------------------------------------------------


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def warm_up_lazy_init() -> None:
    """Pay one-time costs (AdamW's first step loads ~100 MB of torch code, SDPA and clipping initialise
    kernels; the Trainer's end-of-run utilisation report imports matplotlib) on a throwaway layer, so the
    memory baseline taken next leaves them out of every row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import torch
    import torch.nn.functional as F

    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(layer.parameters())
    q = torch.randn(1, 1, 4, 4)
    (layer(torch.randn(2, 4)).sum() + F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()).backward()
    torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    optimizer.step()


def peak_memory(baseline_rss: int, device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in a torch optimizer's per-parameter state."""
    import torch

    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def plain_loop(cfg, device, warmup: int) -> tuple[float, float, object]:
    """The reference loop; returns (median tokens/s over the steps after `warmup`, the same in CPU time, the
    optimizer)."""
    step, optimizer = plain_stepper(cfg, device)
    seconds, cpu_seconds = [], []
    for _ in range(cfg.train.max_steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    return tokens / statistics.median(seconds[warmup:]), tokens / statistics.median(cpu_seconds[warmup:]), optimizer


def plain_stepper(cfg, device):  # noqa: ANN201
    """(one step of the reference loop, its optimizer)."""
    import torch

    from moep_ds.data.dataset import PackedDataset
    from moep_ds.data.prepare import prepare
    from moep_ds.data.sampler import BatchLoader
    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.optim import build_optimizer, build_scheduler, param_groups

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device).train()
    optimizer = build_optimizer(param_groups(model, cfg.train.optimizer), cfg.train.optimizer)
    scheduler = build_scheduler(optimizer, cfg.train.schedule, cfg.train.max_steps)
    dataset = PackedDataset(prepare(cfg.data) / "train.bin", cfg.data.seq_len)
    loader = BatchLoader(dataset, micro_batch_size=cfg.train.micro_batch_size, grad_accum=1, dp_rank=0, dp_size=1,
                         seed=cfg.train.seed)
    clip = cfg.train.grad_clip or 1.0  # the Trainer's default clipping, so both sides do the same work

    def step() -> None:
        input_ids, labels = loader.next_micro_batch()
        out = model(input_ids.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        float(out.loss.detach())  # the Trainer reads its losses every step too (and synchronises a GPU)

    return step, optimizer


def paired_run(cfg, ds: dict, device, warmup: int) -> dict:
    """--paired: plain-loop and Trainer steps alternating in this process (order swapped every pair); the
    per-pair ratios plain CPU time / Trainer CPU time after `warmup` pairs, and each side's median step time."""
    from moep_ds.training.trainer import build_trainer

    plain_step, _ = plain_stepper(cfg, device)
    trainer = build_trainer(cfg, ds, None)
    trainer.module.engine.train()
    sides = {"plain": plain_step, "trainer": trainer.module.train_step}
    cpu = {name: [] for name in sides}
    for i in range(cfg.train.max_steps):
        for name in (("plain", "trainer") if i % 2 == 0 else ("trainer", "plain")):
            start = time.process_time()
            sides[name]()
            cpu[name].append(time.process_time() - start)
    pairs = list(zip(cpu["plain"], cpu["trainer"]))[warmup:]
    return {"ratios": [p / t for p, t in pairs], "plain_s": statistics.median(p for p, _ in pairs),
            "trainer_s": statistics.median(t for _, t in pairs)}


def trainer_run(cfg, ds: dict, warmup: int) -> tuple[float | None, float, object]:
    """Our Trainer; returns (median tokens/s of all ranks from rank 0's metrics.jsonl, or None elsewhere, this
    rank's median tokens/s in CPU time of `train_step`, engine)."""
    from moep_ds.training.trainer import build_trainer

    trainer = build_trainer(cfg, ds, None)
    module = trainer.module
    cpu_seconds, train_step = [], module.train_step

    def timed_train_step():
        start = time.process_time()
        out = train_step()
        cpu_seconds.append(time.process_time() - start)
        return out

    module.train_step = timed_train_step
    trainer.fit()
    cpu_rate = module.tokens_per_step / trainer.world / statistics.median(cpu_seconds[warmup:])
    if trainer.rank != 0:
        return None, cpu_rate, module.engine
    lines = (pathlib.Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()
    rates = [m["tokens_per_s"] for m in map(json.loads, lines) if "tokens_per_s" in m]
    return statistics.median(rates[warmup:]), cpu_rate, module.engine


def worker(row: Row, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import moep_ds.training.trainer  # noqa: F401 - imported before the memory baseline, like everything below
    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.distributed.optimizer_state import inner_optimizer

    device = init_distributed()  # both kinds of row pay for the process group before the baseline
    rank = dist.get_rank()
    out_dir = pathlib.Path(args.work_dir) / f"{row.model}_{row.mode}_x{row.nproc}"
    cfg = load_config(REPO / RECIPES[row.model], recipe_overrides(row.model, args.size, out_dir, args.steps))
    prepare(cfg.data)  # finds the driver's prepared corpus
    warm_up_lazy_init()
    baseline = current_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if row.mode.startswith("paired"):
        result = {"rank": rank, **paired_run(cfg, ds_config(int(row.mode[-1]), args.precision), device, args.warmup)}
        pathlib.Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        return
    if row.mode == "plain":
        tokens_per_s, cpu_rate, optimizer = plain_loop(cfg, device, args.warmup)
    else:
        tokens_per_s, cpu_rate, engine = trainer_run(cfg, ds_config(int(row.mode[-1]), args.precision), args.warmup)
        optimizer = inner_optimizer(engine.optimizer)
    result = {"rank": rank, "tokens_per_s": tokens_per_s, "cpu_tokens_per_s": cpu_rate,
              "peak_memory": peak_memory(baseline, device),
              "optimizer_state": state_bytes(optimizer)}
    pathlib.Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---- driver: launch rows, print the table ---------------------------------------------------------------


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(row: Row, args: argparse.Namespace, result: pathlib.Path) -> list[dict]:
    """Run one row in fresh process(es); returns the per-rank results."""
    shutil.rmtree(pathlib.Path(args.work_dir) / f"{row.model}_{row.mode}_x{row.nproc}", ignore_errors=True)
    worker_args = [str(pathlib.Path(__file__).resolve()), "--worker", json.dumps(dataclasses.asdict(row)),
                   "--result", str(result), "--size", args.size, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--precision", args.precision, "--work_dir", args.work_dir]
    if row.nproc == 1:
        cmd = [sys.executable, *worker_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.nproc}",
               *worker_args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=worker_env(args.threads), cwd=REPO, capture_output=True, text=True)
    log.info("%s %s: %.1f s", row.model, row.name, time.perf_counter() - start)
    if proc.returncode != 0:
        raise RuntimeError(f"{row.name} of {row.model} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(row.nproc)]


def summarize(row: Row, ranks: list[dict]) -> dict:
    total = next(r["tokens_per_s"] for r in ranks if r["tokens_per_s"] is not None)
    return {"tokens_per_s": total, "per_rank": total / row.nproc,
            "cpu_per_rank": min(r.get("cpu_tokens_per_s", math.nan) for r in ranks),
            "peak_memory": max(r["peak_memory"] for r in ranks),
            "optimizer_state": max(r["optimizer_state"] for r in ranks)}


def mib(n: float) -> str:
    return f"{n / 2**20:.3g}"


def table(rows: list[Row], results: dict[Row, dict]) -> list[str]:
    lines = ["| model | run | tok/s | tok/s/rank | vs plain | CPU tok/s/rank | CPU vs plain | peak mem/rank MiB | "
             "opt state/rank MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        r = results[row]
        plain = results.get(Row(row.model, "plain", 1))
        ratio = f"{r['per_rank'] / plain['tokens_per_s']:.2f}x" if plain else "-"
        cpu_ratio = f"{r['cpu_per_rank'] / plain['cpu_per_rank']:.2f}x" if plain else "-"
        lines.append(f"| {row.model} | {row.name} | {r['tokens_per_s']:.0f} | {r['per_rank']:.0f} | {ratio} | "
                     f"{r['cpu_per_rank']:.0f} | {cpu_ratio} | {mib(r['peak_memory'])} | {mib(r['optimizer_state'])} |")
    return lines


def targets(models: list[str], results: dict[Row, dict], clock: str = "cpu") -> list[str]:
    lines = []
    key = "cpu_per_rank" if clock == "cpu" else "per_rank"
    for model in models:
        plain, z2 = results.get(Row(model, "plain", 1)), results.get(Row(model, "zero2", 1))
        if plain and z2:
            ratio = z2[key] / plain[key]
            lines.append(f"{model}: ZeRO-2 x1 tok/s ({clock} time) / plain = {ratio:.2f} (target >= "
                         f"{ZERO2_VS_PLAIN:.2f}: {'met' if ratio >= ZERO2_VS_PLAIN else 'MISSED'})")
        z0, z2 = results.get(Row(model, "zero0", 2)), results.get(Row(model, "zero2", 2))
        if z0 and z2:
            ratio = z2["optimizer_state"] / z0["optimizer_state"]
            lines.append(f"{model}: optimizer state per rank x2, ZeRO-2 / ZeRO-0 = {mib(z2['optimizer_state'])} / "
                         f"{mib(z0['optimizer_state'])} MiB = {ratio:.2f} (target <= 0.55: "
                         f"{'met' if ratio <= 0.55 else 'MISSED'})")
    return lines


def pooled_ratios(runs: list[dict]) -> list[float]:
    """--paired: the step-pair ratios of every run (repeat) of one row."""
    return [r for run in runs for r in run["ratios"]]


def paired_table(rows: list[Row], results: dict[Row, list[dict]]) -> list[str]:
    """--paired: per model and stage, the median of all step-pair ratios over the repeats, with quartiles."""
    lines = ["| model | run | plain CPU ms/step | ZeRO CPU ms/step | ZeRO / plain (median of pairs) | quartiles |"
             " pairs |", "|---|---|---:|---:|---:|---|---:|"]
    for row in rows:
        runs = results[row]
        ratios = pooled_ratios(runs)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        plain_ms = 1e3 * statistics.median(run["plain_s"] for run in runs)
        zero_ms = 1e3 * statistics.median(run["trainer_s"] for run in runs)
        lines.append(f"| {row.model} | {row.name} | {plain_ms:.1f} | {zero_ms:.1f} | "
                     f"{statistics.median(ratios):.3f} | {q1:.3f}-{q3:.3f} | {len(ratios)} |")
    return lines


def paired_targets(rows: list[Row], results: dict[Row, list[dict]]) -> list[str]:
    lines = []
    for row in rows:
        if row.mode == "paired2":
            ratio = statistics.median(pooled_ratios(results[row]))
            lines.append(f"{row.model}: ZeRO-2 x1 / plain, CPU time, median of step pairs = {ratio:.3f} "
                         f"(target >= {ZERO2_VS_PLAIN:.2f}: {'met' if ratio >= ZERO2_VS_PLAIN else 'MISSED'})")
    return lines


def prepare_data(args: argparse.Namespace) -> None:
    """Prepare (or find) the corpus once, before rows start, so no row times a tokenizer."""
    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare

    for model in args.models:
        prepare(load_config(REPO / RECIPES[model], recipe_overrides(model, args.size, REPO, args.steps)).data)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--nprocs", nargs="+", type=int, default=[1, 2], help="process counts for the ZeRO rows")
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per row")
    p.add_argument("--warmup", type=non_negative_int, default=5, help="first steps left out of the median")
    p.add_argument("--repeats", type=positive_int, default=1, help="run every row this often, keep the fastest")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--clock", default="cpu", choices=["cpu", "wall"], help="which tok/s the targets use")
    p.add_argument("--paired", action="store_true",
                   help="one process per model and stage alternating plain and Trainer steps (module docstring)")
    p.add_argument("--work_dir", default=None, help="run directories (default: a temporary folder)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.steps <= args.warmup:
        parser().error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.worker is not None:
        worker(Row(**json.loads(args.worker)), args)
        os._exit(0)  # skip interpreter teardown of DeepSpeed/gloo state; results are on disk
    with tempfile.TemporaryDirectory(prefix="moep_throughput_") as tmp:
        args.work_dir = args.work_dir or tmp
        prepare_data(args)
        if args.paired:
            return paired_main(args, pathlib.Path(tmp))
        rows = [Row(m, "plain", 1) for m in args.models]
        rows += [Row(m, f"zero{s}", n) for m in args.models for n in sorted(args.nprocs) for s in args.stages]
        rows.sort(key=lambda r: list(RECIPES).index(r.model))
        results: dict[Row, dict] = {}
        for repeat in range(args.repeats):  # round-robin, so that load from elsewhere spreads over all rows
            for i, row in enumerate(rows):
                result = summarize(row, launch(row, args, pathlib.Path(tmp) / f"row{i}_{repeat}.json"))
                if row not in results:
                    results[row] = result
                else:  # the best of the repeats, per column
                    best = results[row]
                    for key in ("tokens_per_s", "per_rank", "cpu_per_rank"):
                        best[key] = max(best[key], result[key])
    print(f"# train_throughput: size {args.size} {SIZES[args.size]}, {args.steps} steps (median after "
          f"{args.warmup}, best of {args.repeats}), {args.precision}, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} CPUs")
    print("\n".join(table(rows, results)))
    print("\n".join(targets(args.models, results, args.clock)))
    return 0


def paired_main(args: argparse.Namespace, tmp: pathlib.Path) -> int:
    rows = [Row(m, f"paired{s}", 1) for m in args.models for s in args.stages]
    results: dict[Row, list[dict]] = {row: [] for row in rows}
    for repeat in range(args.repeats):
        for i, row in enumerate(rows):
            results[row] += launch(row, args, tmp / f"paired{i}_{repeat}.json")
    print(f"# train_throughput --paired: size {args.size} {SIZES[args.size]}, {args.steps} step pairs per run "
          f"(first {args.warmup} left out), {args.repeats} run(s), {args.precision}, {args.threads} thread(s), "
          f"{os.cpu_count()} CPUs")
    print("\n".join(paired_table(rows, results)))
    print("\n".join(paired_targets(rows, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
