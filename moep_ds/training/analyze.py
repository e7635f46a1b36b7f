"""`moep-analyze RUN_DIR`: expert-utilisation summary and plots from a run's JSON-lines logs.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/expert_utilization.jsonl; writes RUN_DIR/analysis/summary.json,
summary.md, loss.png and one expert-load heatmap per routed layer (expert_load_<layer>.png).

Every line of both logs is checked before anything is written: a line that is not JSON, or a row of the wrong
shape or type, is a UserError naming the file, the line and what is wrong, and analysis/ is left as it was. Only a
cut-off last line (no newline at its end), what a run killed in the middle of a write leaves, is skipped with a
warning.

# E experts, N logged steps
"""
from __future__ import annotations

import io
import json
import logging
import math
import pathlib
import re
from collections import defaultdict
from typing import Any

import numpy as np

from moep_ds.errors import UserError, is_number, json_error_reason

log = logging.getLogger(__name__)

DEAD_SHARE = 0.1  # an expert is dead when its recent load is below 10% of a uniform share
LOSS_KEYS = ("loss", "ce_loss", "val_loss")
STAT_KEY = re.compile(r"([\w.-]+)\.(\w+)")  # <layer>.<statistic>; the layer names a plot file, so no '/'


def show(value: Any, limit: int = 60) -> str:
    """A parsed value as JSON text, or a line's bytes quoted (they may hold control characters), cut to `limit`
    characters so that an error stays one short line."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value)
    text = text if len(text) <= limit else text[:limit] + "..."
    return repr(text) if isinstance(value, bytes) else text


def parse_lines(path: pathlib.Path) -> list[tuple[int, Any]]:
    """(1-based line number, parsed JSON value) of each non-blank line; a missing file has none."""
    if not path.exists():
        return []
    if not path.is_file():
        raise UserError(f"{path} is not a file")
    lines = path.read_bytes().split(b"\n")
    parsed = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            parsed.append((number, json.loads(raw)))
        except (ValueError, RecursionError) as err:  # also UnicodeDecodeError, and RecursionError when nested deep
            if number < len(lines):
                why = json_error_reason(err, line=False)  # the line is named already
                raise UserError(f"{path}, line {number}: not valid JSON ({why}): {show(raw)}") from None
            # no newline after it: the writer was killed mid-line; the rows before it are whole
            log.warning("%s, line %d: skipped a cut-off last line (no newline at its end): %s", path, number, show(raw))
    return parsed


def row_problem(row: Any) -> str | None:
    """What is wrong with a row of either log: each is a JSON object with its step."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {show(row)}"
    step = row.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return f"step ({show(step)}) must be a non-negative integer" if "step" in row else "no 'step'"
    return None


def metrics_problem(row: Any) -> str | None:
    """metrics.jsonl: {"step": N, "loss": ..., ...}; the losses that the summary and the plot read are numbers, or
    null: a non-finite value (the step that stopped a run: training/monitor.py json_line)."""
    problem = row_problem(row)
    if problem is not None:
        return problem
    for key in LOSS_KEYS:
        if key in row and row[key] is not None and not is_number(row[key]):
            return f"{key} ({show(row[key])}) must be a number"
    return None


def as_counts(value: Any) -> list[float] | None:
    """Tokens per expert as a list, None if not non-negative finite numbers (a 1-expert count is a bare number,
    as monitor.split_stats writes a one-element statistic)."""
    counts = value if isinstance(value, list) else [value]
    ok = counts and all(is_number(c) and math.isfinite(c) and c >= 0 for c in counts)
    return counts if ok else None


def stat_problem(key: str, value: Any, num_experts: dict[str, int]) -> str | None:
    """A `<layer>.<statistic>` entry; `num_experts` holds each layer's expert count on the lines before."""
    match = STAT_KEY.fullmatch(key)
    if match is None:
        return f"key {key!r} is neither 'event' nor '<layer>.<statistic>'"
    layer, stat = match.groups()
    if stat == "tokens_per_expert":
        counts = as_counts(value)
        if counts is None:
            return f"{key} ({show(value)}) must be a list of non-negative token counts"
        if num_experts.setdefault(layer, len(counts)) != len(counts):
            return f"{key} has {len(counts)} experts where the lines before have {num_experts[layer]}"
        return None
    if stat == "dropped_fraction":  # one number, which the summary reads
        return None if is_number(value) else f"{key} ({show(value)}) must be a number"
    # the others may be per-expert vectors too, and null where not finite (the entropy of nan logits)
    values = value if isinstance(value, list) else [value]
    return None if all(v is None or is_number(v) for v in values) else f"{key} ({show(value)}) must be a number"


def utilization_problem(row: Any, num_experts: dict[str, int]) -> str | None:
    """expert_utilization.jsonl: {"step": N, "event": {...}} or {"step": N, "<layer>.<statistic>": value, ...}."""
    problem = row_problem(row)
    if problem is not None:
        return problem
    if "event" in row:
        return None if isinstance(row["event"], dict) else f"event ({show(row['event'])}) must be a JSON object"
    if len(row) == 1:
        return "no statistics and no event"
    for key, value in row.items():
        if key != "step" and (problem := stat_problem(key, value, num_experts)) is not None:
            return problem
    return None


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
    return checked_rows(path, metrics_problem)


def read_utilization(path: pathlib.Path) -> list[dict[str, Any]]:
    num_experts: dict[str, int] = {}
    return checked_rows(path, lambda row: utilization_problem(row, num_experts))


def checked_rows(path: pathlib.Path, problem_of) -> list[dict[str, Any]]:
    rows = []
    for number, row in parse_lines(path):
        problem = problem_of(row)
        if problem is not None:
            raise UserError(f"{path}, line {number}: {problem}")
        rows.append(row)
    return rows


def layer_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per routed layer: steps, tokens-per-expert fractions [N, E] and dropped fractions [N]."""
    series: dict[str, dict[str, Any]] = defaultdict(lambda: {"steps": [], "load": [], "dropped": []})
    for row in rows:
        if "event" in row:
            continue
        for key, value in row.items():
            if key.endswith(".tokens_per_expert"):
                layer = key[: -len(".tokens_per_expert")]
                counts = np.atleast_1d(np.asarray(value, dtype=np.float64))
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


def summarize(metrics: list[dict[str, Any]], utilization: list[dict[str, Any]],
              series: dict[str, dict[str, Any]]) -> dict[str, Any]:
    train = [m for m in metrics if "loss" in m]
    finite = [m for m in train if m["loss"] is not None]  # null: the non-finite step that stopped the run
    events = [row["event"] for row in utilization if "event" in row]
    return {
        "steps": train[-1]["step"] if train else 0,
        "loss": {"first": finite[0]["loss"], "final": finite[-1]["loss"]} if finite else {},
        "val_loss_final": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),
        "layers": {name: summarize_layer(s) for name, s in sorted(series.items())},
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


def png(fig) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def plot(metrics: list[dict[str, Any]], series: dict[str, dict[str, Any]]) -> dict[str, bytes]:
    """loss.png and expert_load_<layer>.png, rendered in memory: analyze() writes them with the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in LOSS_KEYS:
        pts = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=key, marker="o" if key == "val_loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    images = {"loss.png": png(fig)}
    for layer, s in series.items():
        fig, ax = plt.subplots(figsize=(7, 3))
        image = ax.imshow(s["load"].T, aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(s["steps"][0], s["steps"][-1], s["load"].shape[1] - 0.5, -0.5))
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(f"{layer}: share of routed tokens")
        fig.colorbar(image, ax=ax)
        images[f"expert_load_{layer}.png"] = png(fig)
    return images


def analyze(run_dir: str | pathlib.Path, plots: bool = True) -> dict[str, Any]:
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise UserError(f"run directory {str(run_dir)!r} has no metrics.jsonl")
    out = run_dir / "analysis"
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is not a directory")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    utilization = read_utilization(run_dir / "expert_utilization.jsonl")
    series = layer_series(utilization)
    summary = summarize(metrics, utilization, series)
    files = {"summary.json": json.dumps(summary, indent=1).encode(), "summary.md": markdown(summary).encode()}
    if plots:
        files.update(plot(metrics, series))
    # all reading and rendering is done before the first write: bad input leaves analysis/ as it was
    out.mkdir(exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return summary
