"""Tiny recipes for multi-process training tests, and helpers that train them on the ranks of one test
(tests/ranks.py; every run writes its results to files) or launch them (torchrun) where the launcher matters."""
from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DS_CONFIGS = REPO / "ds_configs"

ATTN = {"num_heads": 4}
EXPERT_CHOICE = {"type": "expert_choice", "capacity_factor": 1.25, "rounding": "ceil", "score": "softmax_tokens"}
TOP2 = {"type": "topk", "k": 2, "load_balancing_weight": 0.01}
LIFECYCLE = {**TOP2, "lifecycle": {"min_tokens": 64, "check_interval": 3, "threshold_ratio": 1.0}}

LAYERS = {
    "nova_moe": [{"type": "dense", "attention": ATTN},
                 {"type": "ffn_moe", "attention": ATTN,
                  "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 48}, "router": EXPERT_CHOICE}}],
    "top2": [{"type": "ffn_moe", "attention": ATTN,
              "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 48}, "router": TOP2}}],
    "msit": [{"type": "msit", "attention": ATTN,
              "experts": {"d_thin": 48, "num_heads": 2, "windows": [8, 4, 2, 1]}}],
    "ssm_moe": [{"type": "ssm_moe", "mixer": {"state_size": 4, "chunk_size": 8},
                 "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 48}, "router": LIFECYCLE}}],
    "paths": [{"type": "paths", "attention": ATTN, "d_path": 16, "num_paths": 4, "num_projection_experts": 4,
               "path_router": TOP2, "projection_router": TOP2}],
}
# the routing menu of DeepSeek-V3 / Qwen2-MoE / DeepSpeed's Residual-MoE (tests/training/test_routing_options.py)
DEEPSEEK = {"type": "topk", "k": 2, "score": "sigmoid", "renormalize": True, "scaling_factor": 2.5,
            "bias_update_rate": 0.01, "num_groups": 4, "group_topk": 2, "load_balancing_weight": 0.01,
            "load_balancing_scope": "sequence"}
LAYERS["deepseek"] = [
    {"type": "dense", "attention": ATTN},
    {"type": "ffn_moe", "attention": ATTN,
     "moe": {"num_experts": 8, "expert": {"type": "swiglu", "hidden_size": 16},
             "shared_expert": {"hidden_size": 16, "gate": "none"}, "router": DEEPSEEK}}]
LAYERS["qwen"] = [
    {"type": "ffn_moe", "attention": ATTN,
     "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 16},
             "shared_expert": {"hidden_size": 32, "gate": "sigmoid"},
             "router": {**TOP2, "load_balancing_scope": "global", "capacity_factor": 1.0, "drop_policy": "position"}}},
    {"type": "ffn_moe", "attention": ATTN,
     "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 16},
             "shared_expert": {"hidden_size": 16, "gate": "residual_mix"},
             "router": {**TOP2, "renormalize": True, "capacity_factor": 1.25, "bias_update_rate": 0.01}}},
    {"type": "ssm_moe", "mixer": {"state_size": 4, "chunk_size": 8},
     "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 16},
             "shared_expert": {"hidden_size": 16, "gate": "sigmoid"},
             "router": {**LIFECYCLE, "score": "sigmoid", "bias_update_rate": 0.01}}},
    {"type": "paths", "attention": ATTN, "d_path": 16, "num_paths": 4, "num_projection_experts": 4,
     "path_router": {**TOP2, "score": "sigmoid", "renormalize": True, "bias_update_rate": 0.01},
     "projection_router": {**TOP2, "load_balancing_scope": "sequence"}}]

# every routed block type in one stack
LAYERS["mixed"] = LAYERS["nova_moe"] + LAYERS["top2"] + LAYERS["msit"] + LAYERS["ssm_moe"] + LAYERS["paths"]


def recipe(layers: str, out: pathlib.Path, **train) -> dict:
    return {
        "model": {"flavour": "llama", "vocab_size": 512, "d_model": 32, "max_seq_len": 32,
                  "layers": copy.deepcopy(LAYERS[layers])},
        "data": {"source": "builtin", "tokenizer": {"kind": "bpe", "vocab_size": 512}, "seq_len": 32},
        "train": {"output_dir": str(out), "max_steps": 10, "log_every": 1, "micro_batch_size": 4,
                  "checkpoint": {"every_steps": None, "at_end": False},
                  "optimizer": {"lr": 1.0e-2, "weight_decay": 0.0}, "schedule": {"warmup_steps": 2}, **train},
    }


def write_recipe(path: pathlib.Path, layers: str, out: pathlib.Path, **train) -> pathlib.Path:
    path.write_text(yaml.safe_dump(recipe(layers, out, **train)))
    return path


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def launch(nproc: int, script: str | pathlib.Path, *args: str, timeout: int = 600, check: bool = True):
    """Run `script` on `nproc` CPU processes (torchrun, gloo); 1 process runs as a plain python process."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def refuse_constant(name: str):
    raise ValueError(f"{name} in a JSON line: JSON has no NaN or Infinity")


def metrics(run_dir: pathlib.Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, read strictly (a bare NaN or Infinity is an error, as in strict readers)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line, parse_constant=refuse_constant) for line in path.read_text().splitlines()]


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}


def train(jobs: list[dict], fp16: bool = False) -> None:
    """On one rank: train the jobs ({"recipe": path, "ds_config": path, "resume": None | "auto" | path,
    "overrides": [...]}) one after another in one process group (DeepSpeed keeps its groups for the process); fp16:
    with DeepSpeed's CPU accelerator allowing fp16 (faults.py)."""
    from moep_ds.config import load_config
    from moep_ds.training.trainer import build_trainer

    if fp16:
        import faults

        faults.allow_fp16_on_cpu()
    for job in jobs:
        build_trainer(load_config(job["recipe"], job.get("overrides", [])), job.get("ds_config"),
                      job.get("resume")).fit()


def probe(jobs: list[dict]) -> None:
    """On each rank: train the jobs (as `train`), recording for each what the trainer actually did: the window
    indices, input ids and whole windows (inputs and the last label) of every micro-batch it read, and the lr of
    every group at each optimizer step as the torch optimizer applied it (a step pre-hook). Writes job["probe"]
    (JSON; on several ranks each its own, job["probe"] + ".rank<N>")."""
    import torch.distributed as dist

    from moep_ds.config import load_config
    from moep_ds.distributed.optimizer_state import inner_optimizer
    from moep_ds.training.trainer import build_trainer

    for job in jobs:
        trainer = build_trainer(load_config(job["recipe"], job.get("overrides", [])), job.get("ds_config"),
                                job.get("resume"))
        record = {"start": trainer.step, "indices": [], "input_ids": [], "windows": [], "lrs": []}
        loader = trainer.module.loader
        read = loader.next_indices

        def next_indices():
            idx = read()
            windows = loader.dataset.get_batch(idx)
            record["indices"].append(idx.tolist())
            record["input_ids"].append(windows[:, :-1].tolist())
            record["windows"].append(windows.tolist())
            return idx

        loader.next_indices = next_indices
        inner_optimizer(trainer.module.engine.optimizer).register_step_pre_hook(
            lambda opt, args, kwargs: record["lrs"].append([g["lr"] for g in opt.param_groups]))
        trainer.fit()
        record["end"] = trainer.step
        rank = "" if dist.get_world_size() == 1 else f".rank{dist.get_rank()}"
        pathlib.Path(job["probe"] + rank).write_text(json.dumps(record))


def run_jobs(nproc: int, jobs: list[dict], **options):
    """`train(jobs)` on `nproc` ranks in this test (tests/ranks.py): one process per rank for all the jobs."""
    from ranks import run_ranks

    return run_ranks(nproc, train, jobs, **options)


def pretrain(argv: list[str], fault: str | None = None, step: int = 0, rank: int = 0, fp16: bool = False):
    """On one rank: `pretrain.py ARGV` (cli/pretrain.py main), its status as the rank's exit status; with a fault
    injected (faults.py) and DeepSpeed's CPU accelerator allowing fp16 where asked."""
    import faults
    from moep_ds.cli.pretrain import main

    if fp16:
        faults.allow_fp16_on_cpu()
    if fault is not None:
        faults.inject(fault, step, rank)
    raise SystemExit(main(argv))


def run_pretrain(nproc: int, *argv: str, check: bool = True, **options):
    """`pretrain.py ARGV` on `nproc` ranks in this test; options: fault, step, rank, fp16 (pretrain), env, timeout,
    grace (tests/ranks.py run_ranks)."""
    from ranks import run_ranks

    injected = {k: options.pop(k) for k in ("fault", "step", "rank", "fp16") if k in options}
    return run_ranks(nproc, pretrain, list(argv), check=check, **injected, **options)
