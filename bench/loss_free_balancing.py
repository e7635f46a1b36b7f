"""Does loss-free balancing balance? configs/deepseek_tiny.yaml trained twice on the quick start's data, without
any auxiliary loss (load_balancing_weight 0), once with the recipe's bias update rate u and once with u = 0 (the
bias exists but never moves); same seed, data and schedule, 1 process through our Trainer (DeepSpeed ZeRO-2 fp32,
ds_configs/quickstart.json).

# E experts of a layer, S optimizer steps

Reported per MoE layer: max_i c_i / min_i c_i, c_i = tokens routed to expert i summed over the run's last --last
steps (inf when an expert got none), and the final training loss. Target: every layer's ratio lower with
balancing on than with u = 0.

    python bench/loss_free_balancing.py                         # 300 steps per arm, ~3-5 min on 2 cores
    python bench/loss_free_balancing.py --steps 3 --last 2      # smoke test, seconds
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("loss_free_balancing")
RECIPE = REPO / "configs" / "deepseek_tiny.yaml"
MOE_LAYER = 1  # model.layers[1]: the recipe's FFN-MoE entry (repeated)


def train(run_dir: pathlib.Path, rate: float | None, args: argparse.Namespace) -> None:
    router = f"model.layers[{MOE_LAYER}].moe.router"
    sets = [f"train.output_dir={run_dir}", f"train.max_steps={args.steps}", "train.log_every=1",
            "train.eval_every=null", "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false",
            f"train.seed={args.seed}", f"{router}.load_balancing_weight=0.0"]
    if rate is not None:
        sets.append(f"{router}.bias_update_rate={rate}")
    cmd = [sys.executable, str(REPO / "pretrain.py"), "--config", str(RECIPE),
           "--ds_config", str(REPO / "ds_configs" / "quickstart.json"), "--set", *sets]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def load_ratios(run_dir: pathlib.Path, last: int) -> dict[str, float]:
    """Per layer: max / min of the tokens per expert summed over the last `last` logged steps."""
    return {layer: (max(c) / min(c) if min(c) > 0 else math.inf) for layer, c in expert_loads(run_dir, last).items()}


def idle_experts(run_dir: pathlib.Path, last: int) -> dict[str, int]:
    """Per layer: experts that got no token in the last `last` logged steps."""
    return {layer: sum(1 for n in c if n == 0) for layer, c in expert_loads(run_dir, last).items()}


def expert_loads(run_dir: pathlib.Path, last: int) -> dict[str, list[float]]:
    """Per layer: tokens per expert summed over the last `last` logged steps."""
    rows = [json.loads(line) for line in (run_dir / "expert_utilization.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    steps = sorted({r["step"] for r in rows})[-last:]
    totals: dict[str, list[float]] = {}
    for row in rows:
        if row["step"] not in steps:
            continue
        for key, value in row.items():
            if key.endswith(".tokens_per_expert"):
                layer = key[: -len(".tokens_per_expert")]
                totals[layer] = [a + b for a, b in zip(totals[layer], value)] if layer in totals else list(value)
    return dict(sorted(totals.items()))


def final_loss(run_dir: pathlib.Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r][-1]


def table(results: dict[str, tuple[dict[str, float], float, dict[str, int]]], rate: float) -> str:
    on, off = results["on"], results["off"]
    lines = [f"| layer | max/min load, u = {rate:g} | max/min load, u = 0 | lower with balancing | idle experts, "
             f"u = {rate:g} / 0 |", "|---|---|---|---|---|"]
    for layer in on[0]:
        a, b = on[0][layer], off[0][layer]
        lines.append(f"| {layer} | {a:.2f} | {b:.2f} | {'yes' if a < b else 'NO'} | {on[2][layer]} / {off[2][layer]} |")
    lines.append(f"| final loss | {on[1]:.4f} | {off[1]:.4f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--last", type=int, default=20, help="steps at the end over which loads are summed")
    parser.add_argument("--rate", type=float, default=None, help="u of the balanced arm (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the two runs (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from moep_ds.config import load_config

    rate = args.rate if args.rate is not None else load_config(RECIPE).model.layers[MOE_LAYER].moe.router.bias_update_rate
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or pathlib.Path(tmp)
        results = {}
        for arm, arm_rate in (("on", rate), ("off", 0.0)):
            log.info("training deepseek_tiny, bias update rate %g, %d steps", arm_rate, args.steps)
            train(root / arm, arm_rate, args)
            results[arm] = (load_ratios(root / arm, args.last), final_loss(root / arm), idle_experts(root / arm, args.last))
    print(f"\nloss-free balancing, deepseek_tiny, no auxiliary loss, {args.steps} steps, loads over the last "
          f"{args.last}:\n")
    print(table(results, rate))
    if args.json:
        args.json.write_text(json.dumps({"rate": rate, "steps": args.steps, "last": args.last,
                                         "on": results["on"][0], "off": results["off"][0],
                                         "loss_on": results["on"][1], "loss_off": results["off"][1]}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
