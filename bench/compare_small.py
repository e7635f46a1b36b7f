"""Small-model comparison on CPU: dense GPT-2 / Llama baselines against MoEP paths, MoEP-MSIT, Nova-style
FFN-MoE, MoE-Stream and a DeepSeek-style FFN-MoE (fine-grained experts + shared expert, sigmoid group-limited
routing, loss-free balancing) at the same total parameter count, trained on the same tokens with the same seed and
schedule through our Trainer (1 process, DeepSpeed ZeRO-0 fp32).

# V vocabulary, T sequence length, D model dim, B micro-batch, S optimizer steps

Every model family has one width knob (an FFN / expert hidden size or MSIT's d_thin), solved on the meta
device so that its total parameter count is the closest to the GPT-2 baseline's (printed with the table).
Reported per model:
  val loss     mean next-token cross-entropy over --val_windows windows spread evenly over the validation
               split (routers in their evaluation mode), and its perplexity
  BLiMP        accuracy on a fixed subset of BabyLM's filtered BLiMP: the first --blimp_pairs pairs of each of
               the 67 phenomena; a pair counts as right when the grammatical sentence has the higher total
               log-likelihood (each sentence scored after an end-of-text token)
  tokens/s     median of the Trainer's per-step tokens_per_s
and a PNG of the training-loss curves (smoothed) with the final validation losses.

    python bench/compare_small.py --budget_minutes 60          # steps chosen so the whole run fits
    python bench/compare_small.py --steps 300 --models gpt2 moep_gpt2
    python bench/compare_small.py --size toy --source builtin --steps 3 --blimp_pairs 2   # smoke test, seconds

Data: the corpus is `shared:corpus` ($MOEP_DATA_DIR, default <repo>/../shared/data), prepared once with
moep_ds.data.prepare (byte-level BPE, vocabulary --vocab); the script exits with a message when it is absent.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import pathlib
import shlex
import statistics
import sys
import time
from typing import Any, Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/compare_small.py` from a checkout, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from moep_ds.distributed.commands import positive_int  # noqa: E402

log = logging.getLogger("compare_small")

SIZES = {  # V vocabulary, T sequence, D model dim, L depth, H heads, B micro-batch
    "small": {"V": 4096, "T": 128, "D": 256, "L": 6, "H": 4, "B": 16},
    "toy": {"V": 512, "T": 32, "D": 32, "L": 3, "H": 2, "B": 4},
}
TOP2 = {"type": "topk", "k": 2, "load_balancing_weight": 0.01, "capacity_factor": None}
NOVA_ROUTER = {"type": "expert_choice", "capacity_factor": 1.25, "rounding": "ceil", "score": "softmax_tokens",
               "scope": "batch", "eval_mode": "threshold"}
MSIT_ROUTER = {"type": "expert_choice", "capacity_factor": 2.0, "score": "softmax_experts", "rounding": "nearest",
               "scope": "batch", "eval_mode": "threshold"}


def base(s: dict, flavour: str | None, layers: list[dict], **extra: Any) -> dict:
    return {"flavour": flavour, "vocab_size": s["V"], "d_model": s["D"], "max_seq_len": s["T"], "layers": layers,
            **extra}


def dense(s: dict, flavour: str, hidden: int) -> dict:
    return base(s, flavour, [{"type": "dense", "repeat": s["L"], "attention": {"num_heads": s["H"]},
                              "ffn": {"hidden_size": hidden}}])


def paths(s: dict, flavour: str, ffn: dict, hidden: int) -> dict:
    """configs/moep_{gpt2,llama}.yaml at this size: full layer, 4 paths of depth L-2 at D/2, full layer."""
    return base(s, flavour, [{
        "type": "paths", "attention": {"num_heads": s["H"]}, "d_path": s["D"] // 2, "num_paths": 4,
        "path_depth": s["L"] - 2, "path_ffn": {**ffn, "hidden_size": hidden}, "path_router": TOP2,
        "num_projection_experts": 4, "projection_router": TOP2}])


def msit(s: dict, knob: int) -> dict:
    """configs/msit_babylm.yaml with L/2 blocks (its experts alone exceed this budget at L blocks); d_thin is
    2 x heads x knob."""
    heads = 4 if s["D"] >= 128 else 2
    return base(s, None, [{
        "type": "msit", "repeat": max(1, s["L"] // 2), "attention": {"num_heads": s["H"]}, "ffn": {"type": "swiglu"},
        "norm": {"type": "layernorm"}, "router": MSIT_ROUTER,
        "experts": {"d_thin": 2 * heads * knob, "num_heads": heads, "windows": [64, 16, 8, 4],
                    "ffn": {"type": "swiglu"}}}], tie_embeddings=True, final_norm={"type": "layernorm"})


def nova(s: dict, hidden: int) -> dict:
    """configs/nova_moe.yaml at this size: dense and 8-expert expert-choice FFN-MoE layers alternating."""
    return base(s, "llama", [{"type": "group", "repeat": s["L"] // 2, "layers": [
        {"type": "dense", "attention": {"num_heads": s["H"]}},
        {"type": "ffn_moe", "attention": {"num_heads": s["H"]},
         "moe": {"num_experts": 8, "expert": {"type": "swiglu", "hidden_size": hidden}, "router": NOVA_ROUTER}}]}])


def moe_stream(s: dict, hidden: int) -> dict:
    """configs/moe_stream.yaml at this size: SSM blocks, top-2 of 8 GELU experts under the lifecycle manager."""
    router = {"type": "topk", "k": 2, "load_balancing_weight": 0.01,
              "lifecycle": {"min_tokens": 5000, "check_interval": 100, "birth_boost": 0.35, "bias_decay": 0.99}}
    return base(s, None, [{
        "type": "ssm_moe", "repeat": s["L"], "norm": {"type": "layernorm"},
        "mixer": {"type": "ssm", "expand": 2, "state_size": 16, "chunk_size": 16},
        "moe": {"num_experts": 8, "expert": {"type": "gelu", "hidden_size": hidden}, "router": router}}],
        final_norm={"type": "layernorm"})


def deepseek(s: dict, hidden: int) -> dict:
    """configs/deepseek_tiny.yaml at this size: one dense layer, then FFN-MoE layers of 32 fine-grained SwiGLU
    experts (sigmoid top-4 within the top 2 of 4 groups, loss-free balancing) and one shared expert of their width."""
    router = {"type": "topk", "k": 4, "score": "sigmoid", "renormalize": True, "scaling_factor": 2.5,
              "bias_update_rate": 0.001, "num_groups": 4, "group_topk": 2, "load_balancing_weight": 0.0001,
              "load_balancing_scope": "sequence", "capacity_factor": None}
    return base(s, "llama", [
        {"type": "dense", "attention": {"num_heads": s["H"]}},
        {"type": "ffn_moe", "repeat": s["L"] - 1, "attention": {"num_heads": s["H"]},
         "moe": {"num_experts": 32, "expert": {"type": "swiglu", "hidden_size": hidden},
                 "shared_expert": {"hidden_size": hidden, "gate": "none"}, "router": router}}])


# name -> model section for an integer width knob (hidden sizes are 8 x knob); larger knob, more parameters
MODELS: dict[str, Callable[[dict, int], dict]] = {
    "gpt2": lambda s, k: dense(s, "gpt2", 8 * k),
    "llama": lambda s, k: dense(s, "llama", 8 * k),
    "moep_gpt2": lambda s, k: paths(s, "gpt2", {"type": "gelu", "bias": True}, 8 * k),
    "moep_llama": lambda s, k: paths(s, "llama", {"type": "swiglu"}, 8 * k),
    "msit": msit,
    "nova_moe": lambda s, k: nova(s, 8 * k),
    "moe_stream": lambda s, k: moe_stream(s, 8 * k),
    "deepseek": lambda s, k: deepseek(s, k),  # 33 experts x (L-1) layers: a unit of hidden keeps within 2%
}
REFERENCE = "gpt2"  # at GPT-2's own MLP width 4 D (knob D / 2): its total is every model's budget


def model_config(section: dict):
    from moep_ds.config import config_from_dict

    return config_from_dict({"model": copy.deepcopy(section)}).model


def total_params(section: dict) -> int:
    from moep_ds.models.accounting import meta_param_report

    return meta_param_report(model_config(section)).params_total


def solve_knob(name: str, s: dict, target: int) -> int:
    """The knob whose model's total parameter count is closest to `target`."""
    count: dict[int, int] = {}

    def params(k: int) -> int:
        if k not in count:
            count[k] = total_params(MODELS[name](s, k))
        return count[k]

    lo, hi = 1, 8 * s["D"]
    while lo < hi:  # the smallest knob reaching the target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if params(mid) < target else (lo, mid)
    return min((k for k in (lo - 1, lo) if k >= 1), key=lambda k: abs(params(k) - target))


def model_sections(names: list[str], s: dict) -> dict[str, dict]:
    """Each model at the knob matching the reference's total parameters (the reference at its own width)."""
    reference_knob = s["D"] // 2
    target = total_params(MODELS[REFERENCE](s, reference_knob))
    knobs = {name: reference_knob if name == REFERENCE else solve_knob(name, s, target) for name in names}
    return {name: MODELS[name](s, k) for name, k in knobs.items()}


# ---- training and evaluation ----------------------------------------------------------------------------


def recipe(section: dict, s: dict, args: argparse.Namespace, run_dir: pathlib.Path, steps: int) -> dict:
    """The same data, seed, batch, optimizer and schedule for every model."""
    return {
        "model": copy.deepcopy(section),
        "data": {"source": args.source, "tokenizer": {"kind": "bpe", "vocab_size": s["V"]}, "seq_len": s["T"]},
        "train": {"output_dir": str(run_dir), "seed": args.seed, "max_steps": steps, "log_every": 1,
                  "eval_every": None, "micro_batch_size": s["B"],  # validation: once, at the end, below
                  "checkpoint": {"every_steps": None, "at_end": False},
                  "optimizer": {"lr": args.lr, "weight_decay": 0.1},
                  "schedule": {"kind": "cosine", "warmup_steps": max(1, steps // 10), "min_lr_ratio": 0.1}},
    }


def step_seconds(section: dict, s: dict) -> float:
    """Seconds of one training step of this model (random tokens, plain loop): sizes --budget_minutes runs."""
    from moep_ds.models.causal_lm import build_model

    model = build_model(model_config(section)).train()
    optimizer = torch.optim.AdamW(model.parameters())
    ids_BT = torch.randint(s["V"], (s["B"], s["T"]), generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        model(ids_BT, labels=ids_BT).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


def plan_steps(sections: dict[str, dict], s: dict, budget_s: float, val_windows: int) -> int:
    """Optimizer steps per model such that training plus evaluation of all models fits in `budget_s`."""
    per_step = sum(step_seconds(section, s) for section in sections.values())
    # Trainer bookkeeping ~15% of training, plus the final validation windows at about a third of a training
    # step per micro-batch
    eval_s = per_step * val_windows / s["B"] / 3
    steps = int((budget_s - eval_s) / (1.15 * per_step))
    log.info("calibration: %.2f s per step of all %d models; %d steps fit in %.0f s", per_step, len(sections),
             steps, budget_s)
    return max(steps, 2)


@torch.no_grad()
def validation_loss(model, val_bin: pathlib.Path, seq_len: int, windows: int, batch: int) -> float:
    """Mean cross-entropy over `windows` windows spread evenly over the validation split (the split keeps the
    corpus' source order, so its first windows would all come from one source)."""
    from moep_ds.data.dataset import PackedDataset

    dataset = PackedDataset(val_bin, seq_len)
    picks = np.unique(np.linspace(0, len(dataset) - 1, min(windows, len(dataset))).round().astype(np.int64))
    total = 0.0
    for start in range(0, len(picks), batch):
        windows_BT1 = dataset.get_batch(picks[start:start + batch])
        total += float(model(windows_BT1[:, :-1], labels=windows_BT1[:, 1:]).ce_loss) * len(windows_BT1)
    return total / len(picks)


def blimp_pairs(data_dir: pathlib.Path, per_file: int) -> list[tuple[str, str]]:
    """(good, bad) sentences: the first `per_file` pairs of every phenomenon, files in name order."""
    pairs = []
    for path in sorted((data_dir / "babylm_eval" / "blimp_filtered").glob("*.jsonl")):
        with open(path) as f:
            for line, _ in zip(f, range(per_file)):
                record = json.loads(line)
                pairs.append((record["sentence_good"], record["sentence_bad"]))
    return pairs


@torch.no_grad()
def sentence_logprobs(model, rows: list[list[int]], batch: int) -> list[float]:
    """Total log-likelihood of each row's tokens after its first one. Rows are right-padded in batches: the
    models are causal at evaluation (routers in eval mode), so padding after a row never changes its score."""
    scores = []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        width = max(len(r) for r in chunk)
        ids_BT = torch.tensor([r + [r[0]] * (width - len(r)) for r in chunk])
        logp_BTV = F.log_softmax(model(ids_BT).logits.double(), dim=-1)  # sums of many small terms
        target_logp_BT = logp_BTV[:, :-1].gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
        valid_BT = torch.arange(width - 1)[None] < torch.tensor([len(r) - 1 for r in chunk])[:, None]
        scores += (target_logp_BT * valid_BT).sum(dim=1).tolist()
    return scores


def blimp_accuracy(model, tokenizer, pairs: list[tuple[str, str]], max_len: int, batch: int = 32) -> float:
    """Share of pairs whose good sentence scores higher, each sentence after an end-of-text token."""
    rows = [[tokenizer.eot_id] + tokenizer.encode(text)[:max_len - 1] for pair in pairs for text in pair]
    scores = sentence_logprobs(model, rows, batch)
    return sum(good > bad for good, bad in zip(scores[0::2], scores[1::2])) / len(pairs)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_and_evaluate(name: str, cfg, args: argparse.Namespace, prepared: pathlib.Path, pairs) -> dict:
    from moep_ds.data.tokenizer import load_tokenizer
    from moep_ds.training.ds_config import read_ds_config
    from moep_ds.training.trainer import build_trainer

    ds = read_ds_config(str(REPO / "ds_configs" / "zero0_fp32.json"))
    ds["tensorboard"] = {"enabled": False}
    trainer = build_trainer(cfg, ds, None)
    start = time.perf_counter()
    trainer.fit()
    train_s = time.perf_counter() - start
    model, report = trainer.module.model.eval(), trainer.module.report
    seq = cfg.data.seq_len
    result = {"params_total": report.params_total, "params_non_embedding": report.params_non_embedding,
              "params_active": report.params_active, "steps": trainer.step,
              "tokens": trainer.step * trainer.module.tokens_per_step, "train_s": train_s,
              "val_loss": validation_loss(model, prepared / "val.bin", seq, args.val_windows,
                                          cfg.train.micro_batch_size),
              "blimp": blimp_accuracy(model, load_tokenizer(prepared), pairs, seq) if pairs else None}
    metrics = read_metrics(pathlib.Path(cfg.train.output_dir))
    rates = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    result["tokens_per_s"] = statistics.median(rates[min(3, len(rates) - 1):])
    result["curve"] = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    log.info("%s: val loss %.4f, BLiMP %s, %.0f tok/s", name, result["val_loss"], result["blimp"],
             result["tokens_per_s"])
    del trainer, model
    return result


# ---- report ---------------------------------------------------------------------------------------------


def table(results: dict[str, dict]) -> list[str]:
    reference = results.get(REFERENCE)
    lines = ["| model | params total | non-embedding | active | val loss | val ppl | BLiMP acc | tok/s | "
             "tok/s vs gpt2 | train min |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        blimp = f"{100 * r['blimp']:.1f}%" if r["blimp"] is not None else "-"
        speed = f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}x" if reference else "-"
        lines.append(f"| {name} | {r['params_total']:,} | {r['params_non_embedding']:,} | {r['params_active']:,} | "
                     f"{r['val_loss']:.4f} | {math.exp(min(r['val_loss'], 50)):.1f} | {blimp} | "
                     f"{r['tokens_per_s']:.0f} | {speed} | {r['train_s'] / 60:.1f} |")
    return lines


def plot_curves(results: dict[str, dict], tokens_per_step: int, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        steps, losses = zip(*r["curve"])
        smooth, ema = [], losses[0]
        for loss in losses:  # exponential moving average, so that the curves can be told apart
            ema = 0.9 * ema + 0.1 * loss
            smooth.append(ema)
        line, = ax.plot([s * tokens_per_step for s in steps], smooth, label=f"{name} (train, EMA)")
        ax.plot([steps[-1] * tokens_per_step], [r["val_loss"]], "o", color=line.get_color())
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (dots: final validation loss)")
    ax.set_title("compare_small: same tokens, seed and schedule")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per model (overrides the budget)")
    p.add_argument("--budget_minutes", type=float, default=60.0, help="whole run, preparation included")
    p.add_argument("--source", default="shared:corpus", help="data.source of every recipe")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val_windows", type=int, default=128)
    p.add_argument("--blimp_pairs", type=int, default=20, help="first pairs of each BLiMP phenomenon; 0: skip")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)))
    p.add_argument("--out_dir", default=str(REPO / "runs" / "compare_small"))
    return p


def data_missing(source: str) -> str | None:
    from moep_ds.data.sources import shared_data_dir

    if source.startswith("shared:") and not (shared_data_dir() / source[len("shared:"):]).exists():
        return (f"compare_small: skipped, {source} not found in {shared_data_dir()} (set MOEP_DATA_DIR to the "
                f"folder holding it, or pass --source)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    if (missing := data_missing(args.source)) is not None:
        print(missing)
        return 0
    from moep_ds.config import config_from_dict
    from moep_ds.data.prepare import prepare
    from moep_ds.data.sources import shared_data_dir

    start, s, out = time.perf_counter(), SIZES[args.size], pathlib.Path(args.out_dir)
    sections = model_sections(args.models, s)
    prepared = prepare(config_from_dict(recipe(sections[args.models[0]], s, args, out, 1)).data)
    steps = args.steps or plan_steps(sections, s, 60 * args.budget_minutes - (time.perf_counter() - start),
                                     args.val_windows)
    blimp_dir = shared_data_dir() / "babylm_eval" / "blimp_filtered"
    pairs = blimp_pairs(shared_data_dir(), args.blimp_pairs) if args.blimp_pairs and blimp_dir.is_dir() else []
    if args.blimp_pairs and not pairs:
        log.warning("BLiMP data not found in %s: the BLiMP column stays empty", blimp_dir)
    results = {}
    for name, section in sections.items():
        run_dir = out / name
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # the Trainer appends
        cfg = config_from_dict(recipe(section, s, args, run_dir, steps))
        results[name] = train_and_evaluate(name, cfg, args, prepared, pairs)
    tokens = steps * s["B"] * s["T"]
    lines = [f"# compare_small: `python bench/compare_small.py {shlex.join(sys.argv[1:] if argv is None else argv)}`",
             f"# {args.source} (BPE {s['V']}), T {s['T']}, batch {s['B']}, {steps} steps = {tokens:,} tokens per "
             f"model, lr {args.lr} cosine, seed {args.seed}, {args.threads} thread(s), {len(pairs)} BLiMP pairs, "
             f"{args.val_windows} validation windows; total {(time.perf_counter() - start) / 60:.1f} min",
             *table(results)]
    print("\n".join(lines))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_curves(results, s["B"] * s["T"], out / "loss_curves.png")
    log.info("wrote %s, %s, %s", out / "table.md", out / "results.json", out / "loss_curves.png")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown of DeepSpeed/process-group state
