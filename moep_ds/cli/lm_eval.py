"""lm-eval's own command line with the `moep_ds` model registered (lm-eval has no plugin lookup for --model).

    python -m moep_ds.cli.lm_eval --model moep_ds --model_args pretrained=runs/x --batch_size 16 \
        --tasks blimp_filtered --include_path "$(moep-eval --render_tasks /tmp/moep_tasks)"

Under `torchrun -m` or `deepspeed --module` the model is split over the ranks (evaluation/partitioned.py); only
rank 0 writes `--output_path` (lm-eval would write on every node's first rank). lm-eval's `--use_cache` is
refused there: it gives each rank its own cache, so ranks could skip requests the others compute.

A task name lm-eval does not know is one line naming it (lm-eval raises it as a ValueError with a traceback).
"""
import re
import sys

import moep_ds.evaluation.harness  # noqa: F401 - registers the model under the name moep_ds
from moep_ds.distributed.commands import run_guarded, run_split
from moep_ds.distributed.launcher import launched_world_size, launcher_rank
from moep_ds.errors import SharedUserError, UserError

OUTPUT_FLAGS = ("--output_path", "-o")
CACHE_FLAGS = ("--use_cache", "-c")
# lm-eval's error for --tasks names that no task folder defines, raised before the model is loaded (in older 0.4.x
# releases followed by ". Try `lm-eval --tasks list` ...")
TASKS_NOT_FOUND = re.compile(r"Tasks not found: (.+?)(?:\. Try .*)?", re.DOTALL)


def is_flag(arg: str, flags: tuple[str, ...]) -> bool:
    return arg in flags or any(arg.startswith(f"{flag}=") for flag in flags)


def launched_argv(argv: list[str], rank: int) -> list[str]:
    """lm-eval's arguments on `rank` of a launch: without the deepspeed launcher's --local_rank (lm-eval has no
    such option) and, except on rank 0, without the output path."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--local_rank"):
            skip = False
            continue
        if rank > 0 and is_flag(arg, OUTPUT_FLAGS):
            skip = "=" not in arg  # its value is the next argument
            continue
        out.append(arg)
    return out


def unknown_tasks_error(err: ValueError) -> UserError | None:
    """lm-eval's error for unknown task names as one line naming them; None for any other ValueError. Matching its
    text is the exact check: lm-eval resolves --tasks (names, patterns, YAML files) with --include_path itself,
    and indexing its ~15,000 tasks again beforehand would cost as long as its own look-up. Printed by every rank
    that hits it: a task YAML or --include_path folder one node lacks fails there only."""
    found = TASKS_NOT_FOUND.fullmatch(str(err))
    if found is None:
        return None
    names = found.group(1).split(", ")
    return UserError(f"--tasks: unknown lm-eval task(s) {names}; `lm-eval ls tasks` lists them "
                     "(--include_path DIR adds task YAMLs, e.g. those of moep-eval --render_tasks DIR)")


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    def body() -> int:
        if launched_world_size() > 1:
            cached = [arg for arg in sys.argv[1:] if is_flag(arg, CACHE_FLAGS)]
            if cached:
                raise SharedUserError(f"{cached[0]} is not supported under a launcher (each rank would keep its own "
                                      "cache and skip requests the other ranks compute)")
            sys.argv = [sys.argv[0], *launched_argv(sys.argv[1:], launcher_rank())]
        try:
            cli_evaluate()
        except ValueError as err:
            error = unknown_tasks_error(err)
            if error is None:
                raise
            raise error from None
        return 0

    return run_split(run_guarded, body)


if __name__ == "__main__":
    sys.exit(main())
