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
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CURVE = HERE.parents[2] / "shared" / "data" / "reference" / "pythia" / "curve"
OUT = HERE / "pythia-1b-curve.json"
TOKENS_PER_STEP = 1024 * 2048
TASKS = ("lambada_openai", "piqa", "winogrande", "arc_easy", "arc_challenge", "sciq", "logiqa", "wsc")
MODELS = {"pythia-1b-bf16": "Pythia-1B", "pythia-1b-deduped": "Pythia-1B-deduped"}
SOURCE = {"repository": "EleutherAI/pythia", "commit": "a19eecb807ec2c79a39ebf18108816e6ffffc1d5",
          "path": "evals/pythia-v1/{model}/zero-shot/", "local_copy": "shared/data/reference/pythia/curve/"}
_NAME = re.compile(r"pythia-v1__(?P<model>[^_]+)__zero-shot__.*_step(?P<step>\d+)\.json$")


def scores(results: dict) -> dict[str, dict[str, float]]:
    out = {}
    for task in TASKS:
        metrics = results.get(task, {})
        kept = {"acc": metrics["acc"]} if "acc" in metrics else {}
        if "ppl" in metrics:
            kept["perplexity"] = metrics["ppl"]
        if kept:
            out[task] = kept
    return out


def derive(curve_dir: Path) -> dict:
    models: dict[str, dict[int, dict]] = {name: {} for name in MODELS}
    for path in sorted(curve_dir.glob("*.json")):
        match = _NAME.match(path.name)
        if not match or match["model"] not in MODELS:
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["config"].get("num_fewshot", 0) != 0:
            raise ValueError(f"{path}: num_fewshot {data['config']['num_fewshot']}, the curve is zero-shot")
        models[match["model"]][int(match["step"])] = {"file": path.name, "scores": scores(data["results"])}
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--curve", default=str(CURVE), help="folder of EleutherAI's per-checkpoint result JSONs")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if not Path(args.curve).is_dir():
        print(f"error: {args.curve} not found (EleutherAI/pythia evals/pythia-v1/<model>/zero-shot/)", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(derive(Path(args.curve)), indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
