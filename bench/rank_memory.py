"""What a rank holds while the model is built and while a checkpoint is exported: whole vs sharded, side by side.

    python bench/rank_memory.py [--ranks 2] [--config configs/nova_moe.yaml] [--set model.d_model=256 ...]

Each row is measured in fresh processes (an allocator keeps what a process freed, so one process cannot
measure two ways), as the peak resident memory a step adds to a rank over its level before it (sampled every
5 ms; the largest over ranks), with glibc returning freed buffers of 1 MiB and more to the OS
(training/host_memory.py), so that the peak is what the step holds at once rather than what the heap kept:

  build, ZeRO-3              the whole model on every rank (`build_model`: the trainer before it built
                             partitioned) vs `build_rank_model` under ZeRO-3 (deepspeed.zero.Init): a rank's
                             partition plus, while one module is initialised, that module whole
  build, expert parallel     the whole model vs `build_rank_model` at expert_parallel_size = ranks (ZeRO-2):
                             each rank builds its experts only
  export, 1 process          a sharded checkpoint to a model directory: load the model, then save it
                             (`load_model_dir` + `save_model_dir`) vs `moep-export` (streamed, one tensor)
  evaluate, ZeRO-3           load a sharded checkpoint on every rank and score one sequence of 256 tokens:
                             the whole model on each rank (`load_model_dir`) vs `moep-eval` under a launcher
                             (evaluation/partitioned.py: each rank reads its partitions, modules gathered
                             one at a time while they run)
  evaluate, expert parallel  the same vs `moep-eval --expert_parallel`: each rank builds and reads 1/N of the
                             experts (all-to-all dispatch), the rest whole
  import, expert parallel    a Hugging Face MoE (--import_config / --import_set, default mixtral_tiny at d 512 with
                             experts of 1792: 98.9M parameters, 89% of them in experts; exported natively as
                             MixtralForCausalLM in shards with an index) read into the model on every rank, as
                             `model.init_from` reads it: the whole model on each rank vs each rank's own model at
                             expert_parallel_size = ranks (its experts' tensors only); also the bytes a rank holds
                             once imported, and its peak over them

Prints one markdown table with the model's fp32 size for scale; `--json` writes the rows; `--import_only` measures
the import row alone.

    python bench/rank_memory.py --train [--ranks 1 2] [--config configs/msit_babylm.yaml] [--set ...]

`--train` measures training instead, against moep-plan's prediction (moep_ds/planning/): for each number of ranks,
ZeRO stage 0-3 (fp32 on CPU), expert parallel 1 and the number of ranks (where DeepSpeed accepts it), activation
checkpointing off and on, the peak resident memory that building the trainer (engine, optimizer) and two steps add to
a rank (the largest over ranks; imports and the prepared corpus excluded), with seq_len 64 and micro-batch 2. The
prediction is the plan's peak per rank on the host's terms: a DeepSpeed bucket allocated whole counts only for the
elements written to it (untouched pages are not resident; the last column). Each row gives measured - predicted:
what the plan leaves out (bench/RESULTS.md says what it is), and how much of it one micro-batch holds in the CPU's own
kernels beyond the GPU kernels the plan traces (the same micro-batch traced on the CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from checkpoint_scale import PeakRSS  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
MiB = 1 << 20


def load_cfg(args):
    from moep_ds.config import load_config

    return load_config(args.config, ["data.source=builtin", *args.set])


def report_worst_and_exit(added: float, out: str) -> None:
    """A torchrun worker's end: rank 0 writes the largest peak over the ranks to `out`; every rank exits."""
    import torch
    import torch.distributed as dist

    worst = torch.tensor([added], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"added": float(worst)}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def build_worker(args) -> None:
    """One way of building, on each rank of a torchrun launch; rank 0 writes the largest peak."""
    import torch
    import torch.distributed as dist

    from moep_ds.models.causal_lm import build_model
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.distributed.expert_parallel import expert_parallel_plan, setup_expert_parallel
    from moep_ds.training.startup import build_rank_model

    import deepspeed.runtime.zero.partition_parameters  # noqa: F401 - imported before measuring, for every way

    from moep_ds.training.host_memory import return_freed_buffers_to_os

    return_freed_buffers_to_os()  # what a way holds, not what glibc keeps of what it freed
    init_distributed()
    cfg = load_cfg(args)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3 if args.way == "zero3" else 2}}
    plan = expert_parallel_plan(cfg.model, dist.get_world_size() if args.way == "ep" else 1)
    dist.barrier()
    with PeakRSS() as peak:
        if args.way == "whole":
            torch.manual_seed(0)
            model = build_model(cfg.model)
        else:
            model = build_rank_model(cfg.model, ds, 0, plan)
            setup_expert_parallel(model, plan)
    report_worst_and_exit(peak.added, args.out)


def checkpoint_worker(args) -> None:
    """A sharded checkpoint of the model (every tensor whole, as one process writes it) with its recipe."""
    import torch

    from moep_ds.checkpointing import model_state
    from moep_ds.checkpointing.model_dir import CONFIG_FILE
    from moep_ds.config import dump_config
    from moep_ds.models.causal_lm import build_model

    cfg = load_cfg(args)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    out = pathlib.Path(args.out)
    out.mkdir()
    model_state.save_module(model, out)
    (out / CONFIG_FILE).write_text(dump_config(cfg))
    params = sum(p.numel() for p in model.parameters())
    (out.parent / "size.json").write_text(json.dumps({"params": params}))


def export_worker(args) -> None:
    from moep_ds.checkpointing.model_dir import load_model_dir, save_model_dir
    from moep_ds.cli.export import main as export

    from moep_ds.training.host_memory import return_freed_buffers_to_os

    return_freed_buffers_to_os()
    src, dst = pathlib.Path(args.source), pathlib.Path(args.out)
    with PeakRSS() as peak:
        if args.way == "whole":
            model, cfg, _, meta = load_model_dir(src)
            save_model_dir(model, cfg, dst / "export", meta=meta)
        else:
            assert export([str(src), "--out", str(dst / "export")]) == 0
    (dst / "peak.json").write_text(json.dumps({"added": peak.added}))


def eval_worker(args) -> None:
    """One way of loading a checkpoint for evaluation and scoring one sequence, on each rank of a torchrun
    launch; rank 0 writes the largest peak."""
    import torch
    import torch.distributed as dist

    from moep_ds.checkpointing.model_dir import load_model_dir
    from moep_ds.evaluation.partitioned import load_partitioned_model_dir, model_device
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.training.host_memory import return_freed_buffers_to_os

    import deepspeed.runtime.zero.partition_parameters  # noqa: F401 - imported before measuring, for every way

    return_freed_buffers_to_os()
    init_distributed()
    dist.barrier()
    with PeakRSS() as peak:
        if args.way == "whole":
            model, cfg, _, _ = load_model_dir(args.source)
        else:  # the engine (ZeRO-3) lives while the model runs: its hooks gather the parameters
            model, cfg, _, _, engine = load_partitioned_model_dir(args.source, expert_parallel=args.way == "ep")
        with torch.no_grad():
            model(torch.zeros(1, min(256, cfg.model.max_seq_len), dtype=torch.long, device=model_device(model)))
    report_worst_and_exit(peak.added, args.out)


def import_worker(args) -> None:
    """Fill this rank's model from the Hugging Face source, on each rank of a torchrun launch; rank 0 writes the
    largest peak and the largest bytes held."""
    import torch
    import torch.distributed as dist

    from moep_ds.checkpointing import model_state
    from moep_ds.distributed.expert_parallel import expert_parallel_plan, setup_expert_parallel
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.interop.sources import source_weights
    from moep_ds.interop.weights import fill_pieces
    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.host_memory import return_freed_buffers_to_os

    import deepspeed.runtime.zero.partition_parameters  # noqa: F401 - imported before measuring, for every way
    import safetensors.torch  # noqa: F401 - the readers' code, loaded before measuring what they hold
    import moep_ds.interop.hf_weights  # noqa: F401
    from moep_ds.interop.families import families

    families()  # every family's module

    return_freed_buffers_to_os()
    init_distributed()
    cfg = load_cfg(args)
    plan = expert_parallel_plan(cfg.model, dist.get_world_size() if args.way == "ep" else 1)
    dist.barrier()
    with PeakRSS() as peak:
        model = build_model(cfg.model, plan=plan, initialise=False)
        setup_expert_parallel(model, plan)  # marks the expert parameters, as the engine sees them
        weights, keep, _ = source_weights(args.source, cfg.model)
        fill_pieces(model_state.module_pieces(model, plan), weights, keep)
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    out = torch.tensor([peak.added, held], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        pathlib.Path(args.out).write_text(json.dumps({"added": float(out[0]), "held": float(out[1])}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def hf_source(args, tmp: pathlib.Path) -> pathlib.Path:
    """The import config's model, seeded, exported natively (sharded: --max_shard_size 16MB)."""
    ckpt = tmp / "import_ckpt"
    run([sys.executable, __file__, "--worker", "checkpoint", "--out", str(ckpt), *import_args(args)])
    run([sys.executable, "-m", "moep_ds.cli.export", str(ckpt), "--out", str(tmp / "import_hf"), "--hf", "--native",
         "--max_shard_size", "16MB"])
    return tmp / "import_hf"


def import_args(args) -> list[str]:
    return ["--config", str(args.import_config), "--set", *args.import_set]


def measure_import(args, way: str, tmp: pathlib.Path, source: pathlib.Path) -> dict[str, float]:
    out = tmp / f"import_{way}.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", __file__,
         "--worker", "import", "--way", way, "--out", str(out), "--source", str(source), *import_args(args)])
    return json.loads(out.read_text())


TRAIN_SETS = ["data.seq_len=64", "train.micro_batch_size=2", "train.max_steps=2", "train.log_every=1",
              "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false", "train.eval_every=null"]


def train_worker(args) -> None:
    """One layout trained for two steps on each rank of a launch; rank 0 writes the largest peak."""
    import deepspeed  # noqa: F401 - imported before measuring: not the run's memory

    from moep_ds.config import load_config
    from moep_ds.training.host_memory import return_freed_buffers_to_os
    from moep_ds.training.trainer import build_trainer

    return_freed_buffers_to_os()
    cfg = load_config(args.config, ["data.source=builtin", *TRAIN_SETS, *args.set])
    with PeakRSS() as peak:
        build_trainer(cfg, str(REPO / f"ds_configs/zero{args.way}_fp32.json"), None).fit()
    report_worst_and_exit(peak.added, args.out)


def host_view(run) -> tuple[float, float]:
    """(the plan's peak per rank as resident host memory, what that leaves out of the plan): each bucket DeepSpeed
    allocates whole counted for the elements that pass through it (the rank's gradients), not its capacity."""
    untouched = 0
    grads = run.inventory.local_params * run.layout.param_bytes
    for item in run.memory.items:
        if "bucket" in item.name and item.phase == "static":
            untouched += max(0, item.bytes - grads)
    return run.memory.peak - untouched, untouched


def cpu_kernel_bytes(cfg, checkpointing: bool) -> float:
    """What the CPU's own kernels (expert loop, chunked window attention, unfused activations) hold beyond the GPU
    kernels the plan traces: the activation peak of one micro-batch run on the CPU minus the one traced on meta."""
    import torch

    from moep_ds.planning.trace import trace_step

    shape = dict(micro_batch=2, seq_len=cfg.data.seq_len, dtype=torch.float32, checkpointing=checkpointing)
    return trace_step(cfg.model, device="cpu", **shape).peak - trace_step(cfg.model, **shape).peak


def measure_training(args) -> list[dict]:
    """Every layout of --train, measured in its own launch and predicted by moep-plan; one table row each."""
    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare
    from moep_ds.planning.hardware import assumptions, hardware
    from moep_ds.planning.layout import Cluster
    from moep_ds.planning.plan import plan_run
    from moep_ds.training.ds_config import read_ds_config

    base = load_config(args.config, ["data.source=builtin", *TRAIN_SETS, *args.set])
    prepare(base.data)  # tokenised once here, not inside a measured launch
    cpu_kernels = {ckpt: cpu_kernel_bytes(base, ckpt) for ckpt in (False, True)}
    print(f"# rank_memory --train: {args.config.name} {' '.join(args.set)}, seq_len 64, micro-batch 2, fp32")
    print("| ranks | ZeRO | expert parallel | act. ckpt | predicted MiB | measured MiB | predicted / measured | "
          "measured - predicted MiB | of which CPU kernels MiB | bucket pages never touched (left out) MiB |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for stage in args.zero:
                for ep in sorted({1, ranks}):
                    if ep > 1 and stage == 3:
                        continue  # DeepSpeed refuses expert parameters under ZeRO-3
                    for ckpt in (False, True):
                        sets = [f"train.expert_parallel_size={ep}", f"train.activation_checkpointing={ckpt}",
                                f"train.global_batch_size={2 * ranks}",
                                f"train.output_dir={tmp}/r{ranks}_z{stage}_ep{ep}_{int(ckpt)}"]
                        cfg = load_config(args.config, ["data.source=builtin", *TRAIN_SETS, *args.set, *sets])
                        ds = read_ds_config(REPO / f"ds_configs/zero{stage}_fp32.json")
                        plan = plan_run(cfg, ds, Cluster(ranks, ranks), hardware("h100"), assumptions())
                        predicted, untouched = host_view(plan)
                        out = pathlib.Path(tmp) / f"peak_{ranks}_{stage}_{ep}_{int(ckpt)}.json"
                        cmd = [__file__, "--worker", "train", "--way", str(stage), "--out", str(out),
                               "--config", str(args.config), "--set", *args.set, *sets]
                        launcher = ([sys.executable] if ranks == 1 else
                                    [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc_per_node={ranks}"])
                        run(launcher + cmd)
                        measured = json.loads(out.read_text())["added"]
                        rows.append({"ranks": ranks, "zero": stage, "ep": ep, "checkpointing": ckpt,
                                     "predicted": predicted, "measured": measured, "untouched": untouched,
                                     "cpu_kernels": cpu_kernels[ckpt]})
                        print(f"| {ranks} | {stage} | {ep} | {'on' if ckpt else 'off'} | {predicted / MiB:,.0f} | "
                              f"{measured / MiB:,.0f} | {predicted / measured:.2f} | "
                              f"{(measured - predicted) / MiB:+,.0f} | {cpu_kernels[ckpt] / MiB:+,.0f} | "
                              f"{untouched / MiB:,.0f} |", flush=True)
    return rows


def run(cmd: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-4000:]}")


def common(args) -> list[str]:
    return ["--config", str(args.config), "--set", *args.set]


def measure_on_ranks(args, worker: str, way: str, tmp: pathlib.Path, *extra: str) -> float:
    """The largest peak over the ranks of a torchrun launch of `worker` (`report_worst_and_exit`)."""
    out = tmp / f"{worker}_{way}.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", __file__,
         "--worker", worker, "--way", way, "--out", str(out), *extra, *common(args)])
    return json.loads(out.read_text())["added"]


def measure_build(args, way: str, tmp: pathlib.Path) -> float:
    return measure_on_ranks(args, "build", way, tmp)


def measure_export(args, way: str, tmp: pathlib.Path, source: pathlib.Path) -> float:
    out = tmp / f"export_{way}"
    out.mkdir()
    run([sys.executable, __file__, "--worker", "export", "--way", way, "--source", str(source), "--out", str(out),
         *common(args)])
    return json.loads((out / "peak.json").read_text())["added"]


def measure_eval(args, way: str, tmp: pathlib.Path, source: pathlib.Path) -> float:
    return measure_on_ranks(args, "eval", way, tmp, "--source", str(source))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--train", action="store_true", help="measure training against moep-plan's prediction")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], help="--train: the ZeRO stages")
    p.add_argument("--config", type=pathlib.Path, default=REPO / "configs/nova_moe.yaml")
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--import_config", type=pathlib.Path, default=REPO / "configs/mixtral_tiny.yaml")
    p.add_argument("--import_set", nargs="*", default=["model.d_model=512", "model.layers[0].moe.expert.hidden_size=1792"])
    p.add_argument("--import_only", action="store_true", help="measure the import row alone")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--worker", choices=["build", "checkpoint", "export", "eval", "import", "train"],
                   help=argparse.SUPPRESS)
    p.add_argument("--way", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        workers = {"build": build_worker, "checkpoint": checkpoint_worker, "export": export_worker,
                   "eval": eval_worker, "import": import_worker, "train": train_worker}
        return workers[args.worker](args)
    if args.train:
        rows = measure_training(args)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    args.ranks = args.ranks[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if args.import_only:
            rows, imported = import_rows(args, tmp)
            return print_rows(args, rows, imported)
        source = tmp / "ckpt"
        run([sys.executable, __file__, "--worker", "checkpoint", "--out", str(source), *common(args)])
        params = json.loads((tmp / "size.json").read_text())["params"]
        whole = measure_build(args, "whole", tmp)
        rows = [
            (f"build, ZeRO-3, {args.ranks} ranks", whole, measure_build(args, "zero3", tmp)),
            (f"build, expert parallel {args.ranks} (ZeRO-2)", whole, measure_build(args, "ep", tmp)),
            ("export, 1 process", measure_export(args, "whole", tmp, source),
             measure_export(args, "streamed", tmp, source)),
        ]
        whole = measure_eval(args, "whole", tmp, source)
        rows += [(f"evaluate, ZeRO-3, {args.ranks} ranks", whole, measure_eval(args, "partitioned", tmp, source)),
                 (f"evaluate, expert parallel {args.ranks}", whole, measure_eval(args, "ep", tmp, source))]
        import_row, imported = import_rows(args, tmp)
        rows += import_row
    print(f"# rank_memory: {args.config.name} {' '.join(args.set)}: {params:,} parameters, "
          f"{params * 4 / MiB:,.0f} MiB in fp32")
    print_rows(args, rows, imported)


def import_rows(args, tmp: pathlib.Path) -> tuple[list, dict]:
    hf = hf_source(args, tmp)
    imported = {way: measure_import(args, way, tmp, hf) for way in ("whole", "ep")}
    return [(f"import, expert parallel {args.ranks}", imported["whole"]["added"], imported["ep"]["added"])], imported


def print_rows(args, rows: list, imported: dict) -> None:
    print("| step | whole model MiB | sharded / streamed MiB | sharded / whole |")
    print("|---|---:|---:|---:|")
    for name, before, now in rows:
        print(f"| {name} | {before / MiB:,.0f} | {now / MiB:,.0f} | {now / before:.2f} |")
    held = imported["ep"]["held"]
    print(f"import ({args.import_config.name} {' '.join(args.import_set)}): a rank holds {held / MiB:,.1f} MiB once "
          f"imported at expert parallel {args.ranks}; its peak during the import is {imported['ep']['added'] / held:.2f} "
          f"x that (the whole model: {imported['whole']['held'] / MiB:,.1f} MiB)")
    if args.json:
        out = [{"step": n, "whole": b, "sharded": s} for n, b, s in rows]
        out[-1]["held"] = held
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
