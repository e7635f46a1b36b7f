"""Derive eval/reference/pythia-1b-curve.json from EleutherAI's published per-checkpoint evaluations.

    python eval/reference/pythia_curve.py [--curve ../shared/data/reference/pythia/curve] [--out PATH]

Reads `pythia-v1__<model>__zero-shot__<name>_step<N>.json` (EleutherAI/pythia, evals/pythia-v1/<model>/
zero-shot/, commit a19eecb8; the `-5shot_` names at steps 128-1000 are EleutherAI's, their config says
num_fewshot 0) for pythia-1b-bf16 and pythia-1b-deduped and keeps the zero-shot scores of the reference table's
tasks at every step. One step is 1,024 sequences x 2,048 tokens = 2,097,152 tokens. lm-eval 2023 called
LAMBADA's perplexity `ppl`; it is stored as `perplexity` (today's name).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without `pip install -e .`, like eval/compare.py

from moep_ds.fsutil import apply_umask  # noqa: E402
from moep_ds.distributed.commands import run_guarded  # noqa: E402
from moep_ds.errors import UserError  # noqa: E402
from moep_ds.evaluation.report import is_number, read_json_object, show  # noqa: E402

CURVE = HERE.parents[2] / "shared" / "data" / "reference" / "pythia" / "curve"
OUT = HERE / "pythia-1b-curve.json"
TOKENS_PER_STEP = 1024 * 2048
TASKS = ("lambada_openai", "piqa", "winogrande", "arc_easy", "arc_challenge", "sciq", "logiqa", "wsc")
MODELS = {"pythia-1b-bf16": "Pythia-1B", "pythia-1b-deduped": "Pythia-1B-deduped"}
SOURCE = {"repository": "EleutherAI/pythia", "commit": "a19eecb807ec2c79a39ebf18108816e6ffffc1d5",
          "path": "evals/pythia-v1/{model}/zero-shot/", "local_copy": "shared/data/reference/pythia/curve/"}
_NAME = re.compile(r"pythia-v1__(?P<model>[^_]+)__zero-shot__.*_step(?P<step>\d+)\.json$")


def scores(results: dict, path: Path) -> dict[str, dict[str, float]]:
    out = {}
    for task in TASKS:
        metrics = results.get(task, {})
        if not isinstance(metrics, dict):
            raise UserError(f"--curve file {str(path)!r}: results.{task} ({show(metrics)}) must be an object")
        kept = {"acc": metrics["acc"]} if "acc" in metrics else {}
        if "ppl" in metrics:
            kept["perplexity"] = metrics["ppl"]
        for metric, value in kept.items():
            if not is_number(value):
                name = "ppl" if metric == "perplexity" else metric
                raise UserError(f"--curve file {str(path)!r}: results.{task}.{name} ({show(value)}) must be a number")
        if kept:
            out[task] = kept
    return out


def read_point(path: Path) -> dict[str, dict[str, float]]:
    """The zero-shot scores of one published result file; a UserError naming the file when it is not one."""
    data = read_json_object(path, "--curve file")
    for key in ("config", "results"):
        if key not in data:
            raise UserError(f"--curve file {str(path)!r}: no '{key}' (not an lm-eval results file)")
        if not isinstance(data[key], dict):
            raise UserError(f"--curve file {str(path)!r}: {key} ({show(data[key])}) must be an object")
    fewshot = data["config"].get("num_fewshot", 0)
    if fewshot != 0:
        raise UserError(f"--curve file {str(path)!r}: num_fewshot {show(fewshot)}, the curve is zero-shot")
    return scores(data["results"], path)


def derive(curve_dir: Path) -> dict:
    models: dict[str, dict[int, dict]] = {name: {} for name in MODELS}
    for path in sorted(curve_dir.glob("*.json")):
        match = _NAME.match(path.name)
        if not match or match["model"] not in MODELS:
            continue
        models[match["model"]][int(match["step"])] = {"file": path.name, "scores": read_point(path)}
    missing = [m for m in MODELS if not models[m]]
    if missing:  # an empty curve would give compare.py no equal-token rows, silently
        raise UserError(f"--curve ({str(curve_dir)!r}) has no result files of {', '.join(missing)} "
                        "(pythia-v1__<model>__zero-shot__<name>_step<N>.json)")
    return {
        "description": "Pythia-1B's published zero-shot evaluation at every released checkpoint, for comparisons "
                       "at equal training tokens (eval/compare.py). Scores are fractions, LAMBADA perplexity as "
                       "lm-eval reports it. Derived by eval/reference/pythia_curve.py; do not edit by hand.",
        "tokens_per_step": TOKENS_PER_STEP,
        "tokens_note": "one step = 1,024 sequences x 2,048 tokens",
        "source": SOURCE,
        "models": [{"name": MODELS[m], "run": m,
                    "points": [{"step": s, "tokens": s * TOKENS_PER_STEP, **models[m][s]} for s in sorted(models[m])]}
                   for m in MODELS],
    }


def check_out(out: Path) -> None:
    if out.is_dir():
        raise UserError(f"--out ({str(out)!r}) is a folder; name the JSON file to write")
    if not out.parent.is_dir():
        raise UserError(f"--out ({str(out)!r}) cannot be written: folder {str(out.parent)!r} does not exist")


def write_atomic(out: Path, text: str) -> None:
    """Write `out` aside and rename it in: a failure leaves the old file (the shipped curve, by default) whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        apply_umask(Path(tmp))  # mkstemp's file is private; the curve is read like any other file
        os.replace(tmp, out)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise UserError(f"--out ({str(out)!r}) cannot be written: {err.strerror or err}") from None
        raise


def run(args: argparse.Namespace) -> int:
    if not Path(args.curve).is_dir():
        problem = "is not a folder" if Path(args.curve).exists() else "does not exist"
        raise UserError(f"--curve ({args.curve!r}) {problem} (EleutherAI/pythia evals/pythia-v1/<model>/zero-shot/)")
    check_out(Path(args.out))
    write_atomic(Path(args.out), json.dumps(derive(Path(args.curve)), indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--curve", default=str(CURVE), help="folder of EleutherAI's per-checkpoint result JSONs")
    p.add_argument("--out", default=str(OUT))
    return run_guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
