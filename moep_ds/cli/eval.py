"""`moep-eval`: lm-eval's `simple_evaluate` on a moep_ds checkpoint with the local task YAMLs.

    moep-eval runs/x                                  tasks from the recipe's eval.tasks (default: BLiMP
                                                      filtered + supplement), results in runs/x/eval/
    moep-eval runs/x --tasks grammar_pairs            the embedded grammar's minimal pairs (no data needed)
    moep-eval runs/x --tasks piqa arc_easy --limit 100 --batch_size 32
    moep-eval runs/x --set model.layers[1].moe.router.eval_mode=topk     evaluate with the training rule
    moep-eval --list_tasks                            the local task names
    moep-eval --render_tasks DIR                      rendered YAMLs for `lm_eval --include_path DIR`
    moep-eval runs/x --hub --tasks piqa               lm-eval's built-in tasks (downloads the datasets)
    torchrun --nproc_per_node N -m moep_ds.cli.eval runs/x ...
                                                      on N processes, each holding 1/N of the model (ZeRO-3;
                                                      or `deepspeed --num_gpus N --module moep_ds.cli.eval`;
                                                      `--expert_parallel`: 1/N of the experts, the rest whole)

Writes results.json (scores, lm-eval's results, parameters, tokens, FLOPs, routing eval mode) and
results.md (a table), and prints the table. A results.json already in the output folder is merged with, per task:
`--tasks grammar_pairs` then `--tasks wsc` keeps both; a task evaluated again takes the newest scores, and the
record keeps, for each task, what produced its numbers (checkpoint step, routing eval mode, limit, ...).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from moep_ds.checkpointing import layout
from moep_ds.distributed.commands import ArgumentParser, run_command
from moep_ds.errors import SharedUserError

log = logging.getLogger(__name__)

DEFAULT_TASKS = ["blimp_filtered", "blimp_supplement"]


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moep-eval", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("checkpoint", nargs="?", help="model directory, or run directory (newest complete checkpoint)")
    p.add_argument("--tasks", nargs="+", help="task or group names, space or comma separated")
    p.add_argument("--data_dir", help="data directory (default: eval.data_dir, $MOEP_DATA_DIR, ../shared/data)")
    p.add_argument("--batch_size", type=int, help="default: the recipe's eval.batch_size")
    p.add_argument("--limit", type=float, help="examples per task (a fraction if < 1); for quick checks only")
    p.add_argument("--num_fewshot", type=int)
    p.add_argument("--bootstrap_iters", type=int, default=1000, help="for stderrs of non-mean metrics (0: none)")
    p.add_argument("--device", help="default: cuda when there is a GPU, else cpu (one process; under a launcher "
                   "each rank uses its own)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--expert_parallel", action="store_true",
                   help="under a launcher: shard the experts over the ranks (all-to-all) instead of ZeRO-3")
    p.add_argument("--output", help="directory for results.json / results.md (default: CHECKPOINT/eval)")
    p.add_argument("--name", help="run name in reports (default: the checkpoint directory's name)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides before building")
    p.add_argument("--hub", action="store_true", help="use lm-eval's built-in tasks and hub datasets")
    p.add_argument("--list_tasks", action="store_true", help="print the local task names and exit")
    p.add_argument("--render_tasks", metavar="DIR", help="render the task YAMLs into DIR and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def split_tasks(values: list[str]) -> list[str]:
    return [t for v in values for t in v.split(",") if t]


def check_eval_args(args: argparse.Namespace) -> None:
    """Refuse bad evaluation options before the checkpoint is read: lm-eval would fail on them after the model
    is loaded, or run and record them. Every rank of a launch is given the same options: SharedUserError."""
    from moep_ds.evaluation.generate import parse_device

    if args.tasks is not None and not split_tasks(args.tasks):
        raise SharedUserError(f"--tasks ({' '.join(args.tasks)!r}) names no task")
    if args.batch_size is not None and args.batch_size < 1:
        raise SharedUserError(f"--batch_size ({args.batch_size}) must be >= 1")
    if args.limit is not None and not 0 < args.limit < math.inf:  # also refuses nan
        raise SharedUserError(f"--limit ({args.limit:g}) must be a number > 0 (a fraction of each task if < 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise SharedUserError(f"--num_fewshot ({args.num_fewshot}) must be >= 0")
    if args.num_fewshot and not args.hub:  # lm-eval would draw the examples from the split being scored
        raise SharedUserError(f"--num_fewshot ({args.num_fewshot}): the local task files hold only the split that "
                              "is scored, so the examples would come from it; few-shot needs the hub tasks (--hub)")
    if args.bootstrap_iters < 0:
        raise SharedUserError(f"--bootstrap_iters ({args.bootstrap_iters}) must be >= 0 (0: no stderrs)")
    if args.device is not None:
        parse_device(args.device)
    if args.output or Path(args.checkpoint).is_dir():  # else the checkpoint's own error says more
        layout.check_dir_target("--output", output_dir(args))
        previous_record(output_dir(args))  # one that cannot be merged with fails before the evaluation


def previous_record(out_dir: Path) -> dict[str, Any] | None:
    """The record already in `out_dir` that this evaluation's merges into (None: none there)."""
    from moep_ds.errors import UserError
    from moep_ds.evaluation.report import load_records

    path = out_dir / "results.json"
    if not path.exists():
        return None
    try:
        return load_records([path])[0]
    except UserError as err:  # every rank reads the same file
        raise SharedUserError(f"{err}; this evaluation's results merge into it: move it away, or pass --output "
                              "another folder") from None


def output_dir(args: argparse.Namespace) -> Path:
    return Path(args.output or Path(args.checkpoint) / "eval")


def list_tasks(data_dir: str | None) -> int:
    from moep_ds.evaluation.tasks import DEFAULT_DATA_DIR, render_tasks

    with tempfile.TemporaryDirectory() as tmp:
        rendered = render_tasks(data_dir or os.environ.get("MOEP_DATA_DIR") or DEFAULT_DATA_DIR, tmp)
        for name in rendered.top_level:
            subtasks = rendered.specs[name].subtasks
            print(f"{name}  ({len(subtasks)} sub-tasks)" if subtasks else name)
    return 0


def task_manager(args: argparse.Namespace, cfg: Any, tasks: list[str], tmp: str) -> tuple[Any, list[str], str | None]:
    """lm-eval TaskManager and task names: local rendered YAMLs (checked against the data) or the hub's."""
    from lm_eval.tasks import TaskManager

    from moep_ds.evaluation.tasks import HUB_TASKS, local_task_manager

    if args.hub:
        manager = TaskManager()
        names = [HUB_TASKS.get(t, t) for t in tasks]
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:
            raise SharedUserError(f"unknown lm-eval task(s) {unknown}; `lm-eval ls tasks` lists them")
        return manager, names, None
    manager, data_dir = local_task_manager(args.data_dir or cfg.eval.data_dir, tasks, tmp)
    return manager, tasks, str(data_dir)


def evaluate(args: argparse.Namespace) -> dict[str, Any] | None:
    """Check the tasks and data, load the model, run simple_evaluate; returns the results record (None on the
    ranks other than 0 under a launcher: evaluation/partitioned.py)."""
    from moep_ds.checkpointing.model_dir import load_recipe
    from moep_ds.config import config_from_dict
    from moep_ds.evaluation.harness import MoepLM, run_tasks
    from moep_ds.evaluation.partitioned import load_eval_model

    model_dir, stored = load_recipe(args.checkpoint, args.set)  # a run directory resolves (and logs) once
    cfg = config_from_dict(stored.raw)
    tasks = split_tasks(args.tasks) if args.tasks else (cfg.eval.tasks or DEFAULT_TASKS)
    batch_size = args.batch_size or cfg.eval.batch_size
    with tempfile.TemporaryDirectory(prefix="moep_eval_tasks_") as tmp:
        manager, names, data_dir = task_manager(args, cfg, tasks, tmp)
        model, cfg, tokenizer, meta, engine = load_eval_model(model_dir, args.set, args.dtype, args.expert_parallel)
        lm = MoepLM(model=model, tokenizer=tokenizer, batch_size=batch_size, device=args.device, dtype=args.dtype)
        lm.meta, lm.engine = meta, engine
        results = run_tasks(lm, names, manager, limit=args.limit, num_fewshot=args.num_fewshot,
                            bootstrap_iters=args.bootstrap_iters)
    if results is None or lm.ranks[0] != 0:
        return None
    settings = {"tasks": names, "data_dir": data_dir, "batch_size": batch_size, "limit": args.limit,
                "num_fewshot": args.num_fewshot, "hub": args.hub, "overrides": args.set, "dtype": args.dtype,
                "ranks": lm.ranks[1], "split": split_name(lm.model, lm.ranks[1])}
    return build_record(results, lm, cfg, meta, name=args.name or run_name(args.checkpoint), settings=settings)


def split_name(model: Any, ranks: int) -> str | None:
    """How the model was split over the ranks of a launch (None: one process)."""
    from moep_ds.evaluation.partitioned import experts_sharded

    return None if ranks == 1 else "expert_parallel" if experts_sharded(model) else "zero3"


def run_name(checkpoint: str) -> str:
    p = Path(checkpoint).resolve()
    return p.parent.parent.name if p.parent.name == "checkpoints" else p.name


def build_record(results: dict[str, Any], lm: Any, cfg: Any, meta: dict[str, Any], *, name: str,
                 settings: dict[str, Any]) -> dict[str, Any]:
    from moep_ds.models.eval_modes import summarize_routing_modes
    from moep_ds.evaluation.report import flat_scores
    from moep_ds.models.accounting import meta_param_report

    params = meta_param_report(cfg.model).as_dict()  # of the whole model, also when each rank holds a part
    tokens = meta.get("tokens")
    moep = {
        "model_dir": meta.get("model_dir"), "step": meta.get("step"), "tokens": tokens, **params,
        "train_flops": params["flops_per_token"] * tokens if tokens else None,
        "routing_eval_mode": summarize_routing_modes(lm.routing_eval_mode),
        "routing_eval_modes": lm.routing_eval_mode, **settings,
    }
    keep = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples", "config")
    return {"name": name, "moep": moep, "scores": flat_scores(results),
            "lm_eval": {k: results[k] for k in keep if k in results}}


def write_record(record: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """`record` merged into the one in `out_dir` (evaluation/report.py merge_records), each file replaced whole."""
    from lm_eval.utils import handle_non_serializable

    from moep_ds.evaluation.report import evaluations, merge_records, results_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    previous = previous_record(out_dir)
    if previous is not None:
        others = {e.get("model_dir") for e in evaluations(previous).values()} - {record["moep"].get("model_dir")}
        if others:  # another checkpoint of the run, or another model into the same --output
            log.warning("%s holds scores of %s too: kept beside this evaluation's of %s, each task with what produced "
                        "it (evaluations)", out_dir / "results.json", ", ".join(sorted(map(str, others))),
                        record["moep"].get("model_dir"))
    record = merge_records(previous, record)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    replace_text(json_path, json.dumps(record, indent=2, default=handle_non_serializable) + "\n")
    replace_text(md_path, results_markdown(record))
    return json_path, md_path


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before, never a part: an interrupted write would lose earlier tasks."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _main(args: argparse.Namespace) -> int:
    if args.list_tasks:
        return list_tasks(args.data_dir)
    if args.render_tasks:
        from moep_ds.evaluation.tasks import render_tasks, resolve_data_dir

        layout.check_dir_target("--render_tasks", Path(args.render_tasks))
        data_dir = resolve_data_dir(args.data_dir, must_exist=False)
        if not data_dir.is_dir():
            log.warning("data directory %s does not exist: only grammar_pairs will find its data", data_dir)
        print(render_tasks(data_dir, args.render_tasks).path)
        return 0
    if not args.checkpoint:
        raise SharedUserError("moep-eval needs a checkpoint: a model directory or a run directory")
    check_eval_args(args)
    record = evaluate(args)
    if record is None:  # a rank other than 0 of a partitioned evaluation: rank 0 writes
        return 0
    json_path, md_path = write_record(record, output_dir(args))
    print(md_path.read_text(encoding="utf-8"))  # the table is this command's product
    log.info("wrote %s and %s", json_path, md_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    from moep_ds.distributed.commands import run_split

    return run_split(run_command, _main, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
