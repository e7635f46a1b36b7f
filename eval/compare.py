"""Compare evaluated runs with each other and with published reference numbers.

    python eval/compare.py runs/dense/eval/results.json runs/moe/eval/results.json --out reports/dense_vs_moe
    python eval/compare.py A.json B.json --baseline dense --reference eval/reference/pythia-1b.json

Reads the results.json files `moep-eval` writes and eval/reference/pythia-1b.json; writes report.md (runs and
references side by side: parameters total/active, tokens trained, training FLOPs, routing eval mode, scores;
then each run against the baseline run, e.g. MoE against its dense baseline at matched parameters) and
report.png (accuracies as grouped bars).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without `pip install -e .`, like pretrain.py

from moep_ds.evaluation.report import comparison_chart, comparison_markdown, load_records, load_reference  # noqa: E402

REFERENCE = REPO / "eval" / "reference" / "pythia-1b.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results.json files written by moep-eval")
    p.add_argument("--reference", default=str(REFERENCE), help="published numbers ('' for none)")
    p.add_argument("--baseline", help="run name the others are compared against (default: the first)")
    p.add_argument("--out", default="report", help="output directory for report.md and report.png")
    args = p.parse_args(argv)
    missing = [f for f in args.results if not Path(f).is_file()]
    if missing:
        print(f"error: results file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    records = load_records(args.results) + (load_reference(args.reference) if args.reference else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(comparison_markdown(records, args.baseline), encoding="utf-8")
    comparison_chart(records, out / "report.png")
    print((out / "report.md").read_text(encoding="utf-8"))  # the report is this script's product
    return 0


if __name__ == "__main__":
    sys.exit(main())
