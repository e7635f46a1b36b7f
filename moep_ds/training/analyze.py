"""`moep-analyze RUN_DIR`: expert-utilisation summary and plots from a run's JSON-lines logs.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/expert_utilization.jsonl; writes RUN_DIR/analysis/summary.json,
summary.md, loss.png and one expert-load heatmap per routed layer (expert_load_<layer>.png).

# E experts, N logged steps
"""
from __future__ import annotations

import json
import logging
import pathlib
from collections import defaultdict
from typing import Any

import numpy as np

from moep_ds.errors import UserError

log = logging.getLogger(__name__)

DEAD_SHARE = 0.1  # an expert is dead when its recent load is below 10% of a uniform share


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def layer_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per routed layer: steps, tokens-per-expert fractions [N, E] and dropped fractions [N]."""
    series: dict[str, dict[str, Any]] = defaultdict(lambda: {"steps": [], "load": [], "dropped": []})
    for row in rows:
        if "event" in row:
            continue
        for key, value in row.items():
            if key.endswith(".tokens_per_expert"):
                layer = key[: -len(".tokens_per_expert")]
                counts = np.asarray(value, dtype=np.float64)
                s = series[layer]
                s["steps"].append(row["step"])
                s["load"].append(counts / max(counts.sum(), 1e-12))
                s["dropped"].append(float(row.get(f"{layer}.dropped_fraction", 0.0)))
    return {k: {**v, "load": np.stack(v["load"])} for k, v in series.items()}


def summarize_layer(s: dict[str, Any]) -> dict[str, Any]:
    load_NE, dropped = s["load"], np.asarray(s["dropped"])
    num_experts = load_NE.shape[1]
    recent = load_NE[-max(1, len(load_NE) // 10):].mean(0)
    return {
        "num_experts": num_experts,
        "drop_rate": {"average": float(dropped.mean()), "peak": float(dropped.max()), "final": float(dropped[-1])},
        "expert_load_mean": load_NE.mean(0).round(4).tolist(),
        "expert_load_recent": recent.round(4).tolist(),
        "dead_experts": [int(e) for e in np.flatnonzero(recent < DEAD_SHARE / num_experts)],
    }


def summarize(run_dir: pathlib.Path) -> dict[str, Any]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    utilization = read_jsonl(run_dir / "expert_utilization.jsonl")
    train = [m for m in metrics if "loss" in m]
    events = [row["event"] for row in utilization if "event" in row]
    return {
        "steps": train[-1]["step"] if train else 0,
        "loss": {"first": train[0]["loss"], "final": train[-1]["loss"]} if train else {},
        "val_loss_final": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),
        "layers": {name: summarize_layer(s) for name, s in sorted(layer_series(utilization).items())},
        "lifecycle_events": len(events),
    }


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"steps {summary['steps']}; loss {summary['loss'].get('first', float('nan')):.4f} -> "
             f"{summary['loss'].get('final', float('nan')):.4f}; lifecycle events {summary['lifecycle_events']}", "",
             "| layer | experts | drop avg | drop peak | drop final | recent load per expert | dead |",
             "|---|---|---|---|---|---|---|"]
    for name, s in summary["layers"].items():
        d = s["drop_rate"]
        load = " ".join(f"{v:.3f}" for v in s["expert_load_recent"])
        lines.append(f"| {name} | {s['num_experts']} | {d['average']:.3f} | {d['peak']:.3f} | {d['final']:.3f} | "
                     f"{load} | {s['dead_experts'] or '-'} |")
    return "\n".join(lines) + "\n"


def plot(run_dir: pathlib.Path, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "ce_loss", "val_loss"):
        pts = [(m["step"], m[key]) for m in metrics if key in m]
        if pts:
            ax.plot(*zip(*pts), label=key, marker="o" if key == "val_loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    written.append(out / "loss.png")
    for layer, s in layer_series(read_jsonl(run_dir / "expert_utilization.jsonl")).items():
        fig, ax = plt.subplots(figsize=(7, 3))
        image = ax.imshow(s["load"].T, aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(s["steps"][0], s["steps"][-1], s["load"].shape[1] - 0.5, -0.5))
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(f"{layer}: share of routed tokens")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        path = out / f"expert_load_{layer}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def analyze(run_dir: str | pathlib.Path, plots: bool = True) -> dict[str, Any]:
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"run directory {str(run_dir)!r} has no metrics.jsonl")
    out = run_dir / "analysis"
    out.mkdir(exist_ok=True)
    summary = summarize(run_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    if plots:
        plot(run_dir, out)
    return summary
