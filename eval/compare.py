"""Compare evaluated runs with each other and with published reference numbers, also at equal training tokens.

    python eval/compare.py runs/dense/eval/results.json runs/moe/eval/results.json --out reports/dense_vs_moe
    python eval/compare.py A.json B.json --baseline dense --reference eval/reference/pythia-1b.json

Reads the results.json files `moep-eval` writes, eval/reference/pythia-1b.json (final checkpoints) and
eval/reference/pythia-1b-curve.json (Pythia-1B and Pythia-1B-deduped at all 27 published checkpoints); writes
report.md (runs and references side by side: parameters total/active, tokens trained, training FLOPs, routing
eval mode, scores; then each run against the baseline run, e.g. MoE against its dense baseline at matched
parameters) and report.png (accuracies as grouped bars).

Equal tokens: for every number of training tokens a run records (a run branched from Pythia's step N records its
true count, (N + k) steps x 2,097,152 after k steps of its own), each curve model gets a row at that many tokens:
its published scores when the tokens are a published step's (step x 2,097,152); else the two nearest published
checkpoints, each as published, and between them a row interpolated linearly in log(tokens) (linearly in tokens
between steps 0 and 1, where log(0) has no value); each row's name says which. Runs beyond the last checkpoint get
no such row; the final-checkpoint rows of pythia-1b.json stay in any case. A reference row with no score in any of
the report's columns (e.g. Pythia beside a BLiMP-only run) is left out. Compare a branched MoE with its dense
control by naming the control `--baseline`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`, like pretrain.py

from moep_ds.checkpointing import layout  # noqa: E402
from moep_ds.distributed.commands import run_guarded  # noqa: E402
from moep_ds.errors import UserError  # noqa: E402
from moep_ds.evaluation.report import (  # noqa: E402
    check, comparison_chart, comparison_markdown, is_number, load_records, load_reference, model_list,
    read_json_object, scores_problem, show,
)

REFERENCE = REPO / "eval" / "reference" / "pythia-1b.json"
CURVE = REPO / "eval" / "reference" / "pythia-1b-curve.json"


def interpolate(points: list[dict[str, Any]], tokens: float) -> tuple[dict[str, dict[str, float]], str] | None:
    """(scores, how) of a curve at `tokens`: the published point, or its two neighbours interpolated linearly in
    log(tokens) (linearly in tokens below the first step, where log(0) has no value); None past the last point."""
    found = neighbours(points, tokens)
    if found is None:
        return None
    lo, hi = found
    if lo is hi:
        return lo["scores"], f"step {lo['step']}"
    if lo["tokens"] > 0:
        w = (math.log(tokens) - math.log(lo["tokens"])) / (math.log(hi["tokens"]) - math.log(lo["tokens"]))
        how = "interpolated in log-tokens"
    else:
        w = tokens / hi["tokens"]
        how = "interpolated linearly in tokens"
    scores = {task: {m: lo["scores"][task][m] + w * (hi["scores"][task][m] - lo["scores"][task][m])
                     for m in lo["scores"][task] if m in hi["scores"].get(task, {})}
              for task in lo["scores"] if task in hi["scores"]}
    return scores, f"{how} between steps {lo['step']} and {hi['step']}"


def neighbours(points: list[dict[str, Any]], tokens: float) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The published points at and around `tokens`: (p, p) at a published step, (below, above) between two, None
    before the first or past the last."""
    for p in points:
        if p["tokens"] == tokens:
            return p, p
    after = next((i for i, p in enumerate(points) if p["tokens"] > tokens), None)
    if after is None or after == 0:
        return None
    return points[after - 1], points[after]


def load_curve(path: str | Path) -> list[dict[str, Any]]:
    """The curve file's models, checked: every point has a step, its tokens and numeric scores (interpolated),
    in increasing order of tokens (interpolate() looks for the first point past a run's tokens)."""
    models = model_list(read_json_object(path, "--curve"), "--curve", path)
    for i, model in enumerate(models):
        check(curve_model_problem(model, f"models[{i}]"), "--curve", path)
    return models


def curve_model_problem(model: Any, where: str) -> str | None:
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        return f"{where} ({show(model)}) must be an object with a name"
    points = model.get("points")
    if not isinstance(points, list):
        return f"{where}.points ({show(points)}) must be a list"
    for j, point in enumerate(points):
        at = f"{where}.points[{j}]"
        if not isinstance(point, dict):
            return f"{at} ({show(point)}) must be an object"
        for key in ("step", "tokens"):
            if not (is_number(point.get(key)) and point[key] >= 0):
                return f"{at}.{key} ({show(point.get(key))}) must be a number >= 0"
        if j and point["tokens"] <= points[j - 1]["tokens"]:
            return f"{at}.tokens ({point['tokens']}) must exceed the previous point's ({points[j - 1]['tokens']})"
        problem = scores_problem(point.get("scores"), f"{at}.scores", nullable=False)  # null cannot be interpolated
        if problem:
            return problem
    return None


def equal_token_records(runs: list[dict[str, Any]], curve_path: str | Path,
                        reference_path: str | Path = REFERENCE) -> list[dict[str, Any]]:
    """One reference record per curve model and per distinct token count of the runs (see the module text)."""
    curve = load_curve(curve_path)
    sizes = read_json_object(reference_path, "reference file")["models"][0]  # Pythia-1B's (the shipped file)
    moep = {k: sizes.get(k) for k in ("params_total", "params_active", "flops_per_token")}
    out: dict[tuple[str, float], dict[str, Any]] = {}  # one row per (model, tokens), in order of tokens
    for tokens in sorted({r["moep"]["tokens"] for r in runs if r.get("moep", {}).get("tokens") is not None}):
        for model in curve:
            found = neighbours(model["points"], tokens)
            if found is None:
                continue
            lo, hi = found
            if lo is hi:
                rows = [(tokens, lo["scores"], f"step {lo['step']}")]
            else:  # the nearest published steps, and the interpolation between them
                rows = [(lo["tokens"], lo["scores"], f"step {lo['step']}, the nearest published below"),
                        (tokens, *interpolate(model["points"], tokens)),
                        (hi["tokens"], hi["scores"], f"step {hi['step']}, the nearest published above")]
            for at, scores, how in rows:
                out.setdefault((model["name"], at), {
                    "name": f"{model['name']} @ {at / 1e9:.3g}B tokens ({how})", "scores": scores,
                    "moep": {**moep, "tokens": at}, "reference": True})
    return sorted(out.values(), key=lambda r: r["moep"]["tokens"])


def check_run_names(paths: list[str], runs: list[dict[str, Any]]) -> None:
    """Runs are told apart by name (--baseline, the report's rows): two results files of one name are refused,
    else --baseline would pick the first of them and the rows could not be told apart."""
    real = [os.path.realpath(p) for p in paths]  # a.json and ./a.json are one file
    twice = [p for i, p in enumerate(paths) if real[i] in real[:i]]
    if twice:
        raise UserError(f"results file {twice[0]!r} is given twice")
    seen: dict[str, str] = {}
    for path, run in zip(paths, runs):
        earlier = seen.setdefault(run["name"], path)
        if earlier != path:
            raise UserError(f"results file {path!r}: name ({run['name']!r}) is also that of {earlier!r}; runs need "
                            "names of their own (moep-eval --name)")


def check_baseline(runs: list[dict[str, Any]], baseline: str | None) -> None:
    names = [r["name"] for r in runs]
    if baseline is not None and baseline not in names:
        raise UserError(f"--baseline ({baseline!r}) names no run; the runs are {', '.join(map(repr, names))}")


def write_report(out: Path, markdown: str, records: list[dict[str, Any]]) -> None:
    """report.md and report.png in `out`, each appearing whole (written aside, then renamed); on an error the
    folders made for `out` are removed again and the files already there are left as they were."""
    created = layout.first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out, prefix=".report.") as tmp:
            (Path(tmp) / "report.md").write_text(markdown, encoding="utf-8")
            comparison_chart(records, Path(tmp) / "report.png")
            for name in ("report.md", "report.png"):
                layout.apply_umask(Path(tmp) / name)
                os.replace(Path(tmp) / name, out / name)
    except BaseException as err:
        layout.remove_new_dir(out, created)
        if isinstance(err, OSError):
            raise UserError(f"--out ({str(out)!r}) cannot be written: {err.strerror or err}") from None
        raise


def compare(args: argparse.Namespace) -> int:
    missing = [f for f in args.results if not Path(f).is_file()]
    if missing:
        raise UserError(f"results file(s) not found: {', '.join(missing)}")
    runs = load_records(args.results)
    check_run_names(args.results, runs)
    check_baseline(runs, args.baseline)
    records = runs + (equal_token_records(runs, args.curve) if args.curve else [])
    records += load_reference(args.reference) if args.reference else []
    out = Path(args.out)
    layout.check_dir_target("--out", out)
    markdown = comparison_markdown(records, args.baseline)
    write_report(out, markdown, records)
    print(markdown)  # the report is this script's product
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results.json files written by moep-eval")
    p.add_argument("--reference", default=str(REFERENCE), help="published numbers ('' for none)")
    p.add_argument("--curve", default=str(CURVE), help="published checkpoints for equal-token rows ('' for none)")
    p.add_argument("--baseline", help="run name the others are compared against (default: the first)")
    p.add_argument("--out", default="report", help="output directory for report.md and report.png")
    return run_guarded(compare, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
