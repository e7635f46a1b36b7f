"""Metrics: `metrics.jsonl`, `expert_utilization.jsonl` and TensorBoard scalars through DeepSpeed's monitor.

DeepSpeed's engine logs only the learning rate by itself; everything else goes through
`Engine.write_events` (distributed/engine.py: DeepSpeed's monitor). Files are written by rank 0 only.

Routing statistics describe the whole data-parallel batch: on log steps (only) they are all-reduced over the
ranks, per-expert token counts summed and per-token means (dropped fraction, router entropy) averaged.
TensorBoard shows `moe/<layer>.tokens_per_expert/expert_<e>` as the share of that layer's routed tokens;
`expert_utilization.jsonl` keeps the summed counts (per micro-batch, averaged over gradient accumulation).
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def split_stats(stats: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Scalar statistics and per-expert vectors (e.g. `layers.3.tokens_per_expert`)."""
    scalars, vectors = {}, {}
    for key, value in stats.items():
        value = value.detach().float().cpu()
        if value.numel() == 1:
            scalars[key] = float(value)
        else:
            vectors[key] = value.flatten().tolist()
    return scalars, vectors


def is_count(key: str) -> bool:
    return key.endswith("tokens_per_expert")


def reduce_over_ranks(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Statistics of all data-parallel ranks together, in one all-reduce: counts summed, means averaged
    (every rank routes the same number of tokens). Every rank must call it with the same keys."""
    if not stats or not dist.is_initialized() or dist.get_world_size() == 1:
        return stats
    keys = sorted(stats)
    flat = torch.cat([stats[k].detach().float().flatten() for k in keys])
    dist.all_reduce(flat)
    out, offset = {}, 0
    for key in keys:
        n = stats[key].numel()
        value = flat[offset:offset + n].view(stats[key].shape)
        out[key] = value if is_count(key) else value / dist.get_world_size()
        offset += n
    return out


def tensorboard_events(metrics: dict[str, float], scalars: dict[str, float],
                       vectors: dict[str, list[float]]) -> dict[str, float]:
    """Tags and values: `train/<metric>`, `val/loss` (metric `val_loss`), `eval/<task>/<metric>` as they are
    (training/callbacks/downstream_eval.py), `moe/<stat>`,
    `moe/<layer>.tokens_per_expert/expert_<e>` as shares."""
    events = {"val/loss" if k == "val_loss" else k if k.startswith("eval/") else f"train/{k}": v
              for k, v in metrics.items()}
    events.update({f"moe/{k}": v for k, v in scalars.items()})
    for key, values in vectors.items():
        total = sum(values) if is_count(key) else 1.0
        events.update({f"moe/{key}/expert_{i}": v / total if total else 0.0 for i, v in enumerate(values)})
    return events


LOG_FILES = ("metrics.jsonl", "expert_utilization.jsonl")
TENSORBOARD_DIR = "tensorboard"  # DeepSpeed's job_name for the run's events (training/assemble.py)


def drop_rows_after(run_dir: pathlib.Path, step: int, aside: pathlib.Path | None = None) -> None:
    """Logs follow the checkpoint: rows of steps after a resumed `step` were trained again (or never will be). They
    are dropped, or, given `aside` (the folder of an abandoned branch, training/run_dir.py), appended to the file of
    the same name there; TensorBoard's events alike (split_events). A cut-off last line (the interrupted run's
    unfinished write) goes too, so that new rows start on a line of their own; a malformed line elsewhere is kept as
    it is (moep-analyze names it)."""
    for name in LOG_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        keep = [keep_row(line, step, path, i + 1, last=i == len(lines) - 1) for i, line in enumerate(lines)]
        kept = [line for line, k in zip(lines, keep) if k]
        if kept and not kept[-1].endswith("\n"):  # the next row must start a line of its own
            kept[-1] += "\n"
        if kept == lines:
            continue
        if aside is not None:  # first: a crash in between leaves the rows twice, never nowhere
            aside.mkdir(parents=True, exist_ok=True)
            with open(aside / name, "a") as f:
                f.write("".join(line if line.endswith("\n") else line + "\n" for line, k in zip(lines, keep) if not k))
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        log.info("%s %d rows after step %d from %s", "moved" if aside else "dropped", len(lines) - len(kept), step,
                 path)
    split_events(run_dir / TENSORBOARD_DIR, step, aside / TENSORBOARD_DIR if aside is not None else None)


def split_events(tb_dir: pathlib.Path, step: int, aside: pathlib.Path | None) -> None:
    """TensorBoard event files under `tb_dir` without their events after `step`: those go into a file of the same
    name under `aside` (after the file's header record), or are dropped. A file with nothing after `step`, such as
    the one this run's writer has just opened, is left as it is."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(tb_dir.rglob("events.out.tfevents.*")) if tb_dir.is_dir() else []:
        raws = list(RawEventFileLoader(str(path)).Load())
        events = [Event.FromString(raw) for raw in raws]
        header = [raw for raw, event in zip(raws, events) if event.HasField("file_version")]
        later = [event.step > step and not event.HasField("file_version") for event in events]
        if not any(later):
            continue
        if aside is not None:  # first: a crash in between leaves the events twice, never nowhere
            write_records(aside / path.relative_to(tb_dir), header + [r for r, x in zip(raws, later) if x])
        tmp = path.with_name(f".{path.name}.tmp")
        write_records(tmp, [raw for raw, x in zip(raws, later) if not x])
        tmp.replace(path)
        log.info("%s %d TensorBoard events after step %d from %s", "moved" if aside else "dropped", sum(later), step,
                 path)


def write_records(path: pathlib.Path, raws: list[bytes]) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        writer = RecordWriter(f)
        for raw in raws:
            writer.write(raw)


def keep_row(line: str, step: int, path: pathlib.Path, number: int, last: bool) -> bool:
    if not line.strip():
        return True
    try:
        row = json.loads(line)
    except ValueError:
        if last and not line.endswith("\n"):
            log.warning("%s, line %d: dropping the cut-off last line an interrupted run left", path, number)
            return False
        log.warning("%s, line %d: not valid JSON; kept as it is", path, number)
        return True
    return not isinstance(row, dict) or not isinstance(row.get("step", 0), int) or row.get("step", 0) <= step


def json_line(row: dict[str, Any]) -> str:
    """`row` as one line of strict JSON: a non-finite number (the NaN loss that stops a run, the inf gradient norm of
    a step the fp16 loss scaler skipped) is written as null, as JSON has no NaN or Infinity (Python's json module
    writes bare NaN / Infinity, which strict readers refuse). TensorBoard keeps the values themselves."""
    return json.dumps(finite_or_null(row), allow_nan=False) + "\n"


def finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


class Monitor:
    def __init__(self, run_dir: pathlib.Path, engine, enabled: bool):
        self.enabled = enabled
        self.engine = engine
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = open(run_dir / LOG_FILES[0], "a", buffering=1)
            self.utilization = open(run_dir / LOG_FILES[1], "a", buffering=1)

    def write_events(self, step: int, scalars: dict[str, float]) -> None:
        """TensorBoard scalars, keyed by their full tag (`train/loss`, `moe/layers.3.entropy`, ...)."""
        self.engine.write_events([(tag, v, step) for tag, v in scalars.items()])

    def log_step(self, step: int, metrics: dict[str, float], stats: dict[str, torch.Tensor]) -> None:
        """Called by every rank on log steps (the statistics are reduced over ranks); rank 0 writes."""
        stats = reduce_over_ranks(stats)
        if not self.enabled:
            return
        scalars, vectors = split_stats(stats)
        self.metrics.write(json_line({"step": step, **metrics}))
        self.write_events(step, tensorboard_events(metrics, scalars, vectors))
        if vectors or scalars:
            self.utilization.write(json_line({"step": step, **scalars, **vectors}))

    def log_events(self, step: int, events: list[dict[str, Any]]) -> None:
        """Discrete events (lifecycle replacements, loss-scale overflows): JSON lines and a TensorBoard counter."""
        if not self.enabled or not events:
            return
        for event in events:
            self.utilization.write(json_line({"step": step, "event": event}))
        self.write_events(step, {"lifecycle/events": float(len(events))})

    def close(self) -> None:
        if self.enabled:
            self.metrics.close()
            self.utilization.close()
            self.engine.flush_events()
