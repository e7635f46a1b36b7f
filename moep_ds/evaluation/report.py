"""Evaluation records and reports: one run's results JSON + markdown table, and the comparison of runs.

A record (what `moep-eval` writes as results.json):
    {"name", "moep": {model dir, step, tokens, params, FLOPs, routing eval mode, tasks, data dir, ...},
     "scores": {task: {metric: value}}, "lm_eval": lm-eval's results/groups/versions/n-shot/config,
     "evaluations": {task: the "moep" settings (and lm-eval's config) of the evaluation that produced its scores}}
A second `moep-eval` into the same folder merges into the record there (`merge_records`): per task the newest
evaluation wins, the other tasks keep their scores and what produced them.
`eval/compare.py` reads records and eval/reference/pythia-1b.json (same `scores` layout) and writes a
markdown report and a PNG bar chart.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moep_ds.errors import UserError, is_number, json_error_reason

# the score a table shows for a task, in this order of preference
PRIMARY_METRICS = ("acc", "perplexity", "acc_norm", "word_perplexity")
LOWER_IS_BETTER = {"perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"}


def flat_scores(lm_eval_results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's {"results": {task: {"acc,none": x, "acc_stderr,none": y, ...}}, "groups": ...} as
    {task: {"acc": x, "acc_stderr": y}} (filter suffixes dropped, non-numbers skipped)."""
    out: dict[str, dict[str, float]] = {}
    for section in ("results", "groups"):
        for task, metrics in (lm_eval_results.get(section) or {}).items():
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("sample_len",):
                    out.setdefault(task, {})[key.split(",")[0]] = float(value)
    return out


def primary_metric(metrics: dict[str, float]) -> str | None:
    return next((m for m in PRIMARY_METRICS if m in metrics), None)


def fmt(value: float | None, metric: str = "acc") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.2f}" if metric in LOWER_IS_BETTER else f"{100 * value:.2f}"


def fmt_count(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def fmt_flops(value: float | None) -> str:
    return "–" if value is None else f"{value:.2e}"


def results_markdown(record: dict[str, Any]) -> str:
    """One run's scores as a markdown table (accuracies in %, perplexities as they are)."""
    moep = record.get("moep", {})
    lines = [
        f"# {record.get('name', 'evaluation')}",
        "",
        f"- checkpoint: `{moep.get('model_dir')}` (step {moep.get('step')}, {fmt_count(moep.get('tokens'))} tokens)",
        f"- parameters: {fmt_count(moep.get('params_total'))} total, {fmt_count(moep.get('params_active'))} active; "
        f"training FLOPs {fmt_flops(train_flops(record))}",
        f"- routing eval mode: {moep.get('routing_eval_mode')}",
        f"- batch size {moep.get('batch_size')}, limit {moep.get('limit')}, data `{moep.get('data_dir')}`",
        "",
        "| task | metric | value | stderr |",
        "|---|---|---:|---:|",
    ]
    for task, metrics in sorted(record["scores"].items()):
        for metric, value in metrics.items():
            if metric.endswith("_stderr"):
                continue
            err = metrics.get(f"{metric}_stderr")
            stderr = fmt(err, metric) if err is not None else "–"
            lines.append(f"| {task} | {metric} | {fmt(value, metric)} | {stderr} |")
    return "\n".join(lines + provenance_markdown(record)) + "\n"


# ---- one record over several evaluations ----------------------------------------------------------------

# lm-eval's sections keyed by task (the others, "config", are of the whole evaluation)
TASK_SECTIONS = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples")


def requested_tasks(record: dict[str, Any]) -> list[str]:
    """The tasks (or groups) an evaluation was asked for; a record without the list: every task it scored."""
    return list(record.get("moep", {}).get("tasks") or record["scores"])


def task_keys(record: dict[str, Any], task: str) -> set[str]:
    """The score keys of `task` in `record`: the task and its sub-tasks (lm-eval's group_subtasks, nested)."""
    subtasks = record.get("lm_eval", {}).get("group_subtasks") or {}
    keys, todo = set(), [task]
    while todo:
        t = todo.pop()
        if t not in keys:
            keys.add(t)
            todo += subtasks.get(t) or []
    return keys


def evaluation_of(record: dict[str, Any]) -> dict[str, Any]:
    """What produced a record's numbers: its settings (checkpoint, step, routing eval mode, limit, batch size, dtype,
    overrides, ...) and lm-eval's config."""
    out = {k: v for k, v in record.get("moep", {}).items() if k != "tasks"}
    if "config" in record.get("lm_eval", {}):
        out["lm_eval_config"] = record["lm_eval"]["config"]
    return out


def evaluations(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: what produced its scores}; a record written before merging existed: its one evaluation for all."""
    return record.get("evaluations") or {t: evaluation_of(record) for t in requested_tasks(record)}


def merge_records(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new` (an evaluation just run) over `old` (the record already in its output folder, or None). Per task the
    newest wins: `new`'s tasks replace their scores (a group's sub-tasks with it) and what produced them; `old`'s
    other tasks stay with their own. The top-level settings are `new`'s, with routing_eval_mode "mixed" where the
    tasks were scored under different ones."""
    fresh = {t: evaluation_of(new) for t in requested_tasks(new)}
    if old is None:
        return {**new, "evaluations": fresh}
    replaced = set(new["scores"]) | {k for t in fresh for k in task_keys(old, t)}
    before = evaluations(old)
    kept = [t for t in requested_tasks(old) if t not in fresh and not task_keys(old, t) <= replaced]
    produced = {**{t: before[t] for t in kept if t in before}, **fresh}
    lm_eval = {**old.get("lm_eval", {}), **new.get("lm_eval", {})}
    for section in TASK_SECTIONS:
        old_part, new_part = old.get("lm_eval", {}).get(section), new.get("lm_eval", {}).get(section)
        if isinstance(old_part, dict):
            lm_eval[section] = {**{k: v for k, v in old_part.items() if k not in replaced}, **(new_part or {})}
    moep = {**new.get("moep", {}), "tasks": kept + list(fresh)}
    if len({json.dumps(e.get("routing_eval_mode")) for e in produced.values()}) > 1:
        moep["routing_eval_mode"] = "mixed"
    scores = {**{k: v for k, v in old["scores"].items() if k not in replaced}, **new["scores"]}
    return {**new, "moep": moep, "scores": scores, "lm_eval": lm_eval, "evaluations": produced}


# what results.md shows of each evaluation when the tasks of a record come from more than one
PROVENANCE = ("step", "routing_eval_mode", "limit", "batch_size", "dtype", "num_fewshot", "overrides")


def provenance_markdown(record: dict[str, Any]) -> list[str]:
    produced = record.get("evaluations") or {}
    if len({json.dumps(e, sort_keys=True, default=str) for e in produced.values()}) < 2:
        return []
    lines = ["", "Tasks evaluated separately, each by:", "", "| task | " + " | ".join(PROVENANCE) + " |",
             "|---|" + "---|" * len(PROVENANCE)]
    for task, e in produced.items():
        lines.append(f"| {task} | " + " | ".join(str(e.get(k, "–")) for k in PROVENANCE) + " |")
    return lines


# ---- comparison of runs ------------------------------------------------------------------------------


def load_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    records = []
    for p in paths:
        record = read_json_object(p, "results file")
        check(record_problem(record), "results file", p)
        record.setdefault("name", Path(p).parent.name)
        records.append(record)
    return records


def load_reference(path: str | Path, option: str = "--reference") -> list[dict[str, Any]]:
    """Reference models in the record layout: {"name", "moep": {params..., tokens, train_flops}, "scores"}."""
    models = model_list(read_json_object(path, option), option, path)
    for i, m in enumerate(models):
        check(reference_problem(m, f"models[{i}]"), option, path)
    keys = ("params_total", "params_active", "tokens", "train_flops")
    return [{"name": m["name"], "moep": {k: m.get(k) for k in keys}, "scores": m["scores"], "reference": True}
            for m in models]


# ---- checks of the files read: one-line UserErrors naming the file and the field ------------------------------

# the numbers of a record's "moep" (a reference model's top level) that the report computes with
NUMERIC_FIELDS = ("params_total", "params_active", "tokens", "train_flops", "flops_per_token")


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`; a UserError naming `what` (an option, "results file") and the file otherwise."""
    p, text = Path(path), None
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} " + ("is a folder, not a JSON file" if p.is_dir() else "does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text)
    except (ValueError, RecursionError) as err:  # also UnicodeDecodeError, and RecursionError when nested deep
        empty = text is not None and not text.strip()
        problem = "is empty" if empty else f"is not valid JSON ({json_error_reason(err)})"
        raise UserError(f"{what} {str(p)!r} {problem}") from None
    except OSError as err:
        raise UserError(f"{what} {str(p)!r} cannot be read: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {str(p)!r} must hold a JSON object, not {show(data)}")
    return data


def model_list(data: dict[str, Any], what: str, path: str | Path) -> list[Any]:
    """The file's "models" list (a reference file and the curve file both hold one), not empty: an empty one
    would give a report without its rows and no word why."""
    if "models" not in data:
        raise UserError(f"{what} {str(path)!r}: no 'models' (a list of models with their scores)")
    models = data["models"]
    check(None if isinstance(models, list) else f"models ({show(models)}) must be a list", what, path)
    check(None if models else f"models ([]) lists no model ({what} '' leaves the file out)", what, path)
    return models


def check(problem: str | None, what: str, path: str | Path) -> None:
    if problem is not None:
        raise UserError(f"{what} {str(path)!r}: {problem}")


def show(value: Any) -> str:
    """A value as an error shows it: JSON, cut to 60 characters (a file's whole content can be huge)."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def scores_problem(scores: Any, where: str = "scores", nullable: bool = True) -> str | None:
    """What is wrong with {task: {metric: number}} (`nullable`: null stands for a score not reported, shown as –)."""
    if not isinstance(scores, dict):
        return f"{where} ({show(scores)}) must be an object {{task: {{metric: number}}}}"
    for task, metrics in scores.items():
        if not isinstance(metrics, dict):
            return f"{where}.{task} ({show(metrics)}) must be an object {{metric: number}}"
        for metric, value in metrics.items():
            if not (is_number(value) or (nullable and value is None)):
                return f"{where}.{task}.{metric} ({show(value)}) must be a number"
    return None


def numbers_problem(fields: dict[str, Any], where: str) -> str | None:
    for key in NUMERIC_FIELDS:
        if fields.get(key) is not None and not is_number(fields[key]):
            return f"{where}{key} ({show(fields[key])}) must be a number"
    return None


def record_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with a results record (moep-eval's results.json), in the fields the report reads."""
    if "scores" not in record:
        return "no 'scores' (moep-eval's results.json has {task: {metric: number}} there)"
    if "name" in record and not isinstance(record["name"], str):
        return f"name ({show(record['name'])}) must be a string"
    moep = record.get("moep", {})
    if not isinstance(moep, dict):
        return f"moep ({show(moep)}) must be an object"
    tasks = moep.get("tasks")
    if tasks is not None and not (isinstance(tasks, list) and all(isinstance(t, str) for t in tasks)):
        return f"moep.tasks ({show(tasks)}) must be a list of task names"
    return scores_problem(record["scores"]) or numbers_problem(moep, "moep.")


def reference_problem(model: Any, where: str) -> str | None:
    """What is wrong with one model of a reference file (eval/reference/pythia-1b.json's layout)."""
    if not isinstance(model, dict):
        return f"{where} ({show(model)}) must be an object"
    if not isinstance(model.get("name"), str):
        return f"{where}.name ({show(model.get('name'))}) must be a string"
    if "scores" not in model:
        return f"{where} has no 'scores'"
    return scores_problem(model["scores"], f"{where}.scores") or numbers_problem(model, f"{where}.")


def train_flops(record: dict[str, Any]) -> float | None:
    moep = record.get("moep", {})
    if moep.get("train_flops") is not None:
        return moep["train_flops"]
    if moep.get("flops_per_token") and moep.get("tokens"):
        return moep["flops_per_token"] * moep["tokens"]
    return None


def score_columns(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(task, metric) columns: the tasks each run asked for (groups, not their 67 sub-tasks), or every task
    it scored; references only fill in the columns."""
    runs = [r for r in records if not r.get("reference")] or records
    cols = []
    for r in runs:
        for task in r.get("moep", {}).get("tasks") or r["scores"]:
            metrics = r["scores"].get(task, {})
            metric = primary_metric(metrics)
            if metric and (task, metric) not in cols:
                cols.append((task, metric))
            if task == "lambada_openai" and "perplexity" in metrics and (task, "perplexity") not in cols:
                cols.append((task, "perplexity"))
    return sorted(cols)


def score(record: dict[str, Any], task: str, metric: str) -> float | None:
    return record["scores"].get(task, {}).get(metric)


def comparable(records: list[dict[str, Any]], cols: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The runs, and the references with a score in at least one of `cols`: a reference row of dashes only (Pythia
    beside a BLiMP-only run) compares nothing."""
    return [r for r in records if not r.get("reference") or any(score(r, t, m) is not None for t, m in cols)]


def comparison_markdown(records: list[dict[str, Any]], baseline: str | None = None) -> str:
    """Runs and references side by side, then each run against `baseline` (default: the first run)."""
    cols = score_columns(records)
    records = comparable(records, cols)
    head = ["model", "params total", "params active", "tokens", "train FLOPs", "routing"]
    head += [f"{t} {m}" + (" ↓" if m in LOWER_IS_BETTER else "") for t, m in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in records:
        moep = r.get("moep", {})
        cells = [r["name"] + (" (published)" if r.get("reference") else ""), fmt_count(moep.get("params_total")),
                 fmt_count(moep.get("params_active")), fmt_count(moep.get("tokens")), fmt_flops(train_flops(r)),
                 str(moep.get("routing_eval_mode", "–") if not r.get("reference") else "–")]
        cells += [fmt(score(r, t, m), m) for t, m in cols]
        lines.append("| " + " | ".join(cells) + " |")
    out = ["# Evaluation report", "", "Accuracies in %, perplexity as lm-eval reports it (↓ lower is better).", "",
           *lines]
    runs = [r for r in records if not r.get("reference")]
    base = next((r for r in runs if r["name"] == baseline), runs[0] if runs else None)
    if base is not None and len(runs) > 1:
        out += ["", f"## Against {base['name']}", "", "Differences in points (run minus baseline).", "",
                "| model | params total ratio | active ratio | " + " | ".join(f"{t} {m}" for t, m in cols) + " |",
                "|---|---:|---:|" + "---:|" * len(cols)]
        for r in runs:
            if r is base:
                continue
            cells = [r["name"], ratio(r, base, "params_total"), ratio(r, base, "params_active")]
            for t, m in cols:
                a, b = score(r, t, m), score(base, t, m)
                scale = 1 if m in LOWER_IS_BETTER else 100
                cells.append("–" if a is None or b is None else f"{scale * (a - b):+.2f}")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def ratio(r: dict[str, Any], base: dict[str, Any], key: str) -> str:
    a, b = r.get("moep", {}).get(key), base.get("moep", {}).get(key)
    return f"{a / b:.3f}" if a and b else "–"


def comparison_chart(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: one group per (task, accuracy-like metric), one bar per model (references hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [(t, m) for t, m in score_columns(records) if m not in LOWER_IS_BETTER]
    records = comparable(records, cols)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cols) + 2), 4.0))
    width = 0.8 / max(len(records), 1)
    for i, r in enumerate(records):
        values = [100 * v if (v := score(r, t, m)) is not None else float("nan") for t, m in cols]
        xs = [j + i * width for j in range(len(cols))]
        ax.bar(xs, values, width, label=r["name"], hatch="//" if r.get("reference") else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cols))])
    ax.set_xticklabels([t for t, _ in cols], rotation=30, ha="right")
    ax.set_ylabel("accuracy (%)")
    top = max((v for bar in ax.containers for v in bar.datavalues if not math.isnan(v)), default=100.0)
    ax.set_ylim(0, min(100.0, 10 * math.ceil(1.1 * top / 10)))  # room above the highest bar
    # beside the axes, not on them: inside, the legend covered the top of bars and the y axis
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the figure grows to hold the legend
    plt.close(fig)
    return Path(path)
