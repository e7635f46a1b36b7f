"""How a console command runs on every rank of a launch: argument parsing with one flag style (underscores, each
option also accepted with dashes), one-line errors printed once (by rank 0 where every rank has the same one), and
leaving the process group on failure. The commands themselves are in moep_ds/cli/."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from moep_ds.distributed.launcher import launcher_rank
from moep_ds.errors import ReportedElsewhere, SharedUserError, UserError
from moep_ds.schema import ConfigError

log = logging.getLogger("moep_ds")


# argparse types for counts: 0 would be read as "unset" or give inf / nan; argparse reports them in one usage line
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def spellings(option: str) -> list[str]:
    """`--num_proc` and `--num-proc`: the option as given and its other spelling (underscores are the style)."""
    if not option.startswith("--") or ("_" not in option and "-" not in option[2:]):
        return [option]
    style = "--" + option[2:].replace("-", "_")
    return [style, "--" + option[2:].replace("_", "-")]


class Parser(argparse.ArgumentParser):
    """argparse's parser, every long option under both spellings: `--batch_size` (the style, shown in --help) and
    `--batch-size`."""

    def add_argument(self, *names, **kwargs):
        if names and all(n.startswith("-") for n in names):
            names = tuple(dict.fromkeys(alias for n in names for alias in spellings(n)))
        return super().add_argument(*names, **kwargs)


class ArgumentParser(Parser):
    """`Parser` for the commands a launcher starts on every rank: every rank gets the same command line, so a usage error is printed by rank 0 only (the others exit with argparse's status 2 silently)."""

    def error(self, message: str):
        if launcher_rank() == 0:
            super().error(message)
        sys.exit(2)


def exit_joined(code: int) -> int:
    """`code`, for a command that failed while still in its process group (distributed/process_group.py
    `leave_process_group`): the interpreter's teardown could race gloo's worker threads, which let go of the last
    collective's tensors just after it returned, and abort the process (seen in ~1 of 10 two-process runs that
    agreed on a bad output directory). A process alone in its group leaves it here. With several ranks the others
    may be anywhere, so this rank cannot wait for them: it flushes its logs and standard streams and exits with
    `code` at once, without the teardown; nothing else is pending at that point."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return code
    if dist.get_world_size() == 1:
        from moep_ds.distributed.process_group import leave_process_group

        leave_process_group()
        return code
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # the launcher stopping the ranks as this one exits: no "received
        signal.signal(sig, signal.SIG_IGN)  # signal 15: checkpointing ..." from a rank that checkpoints nothing now
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def say(line: str) -> None:
    """`line` on stderr, prefixed with the launcher rank on every rank but 0."""
    rank = launcher_rank()
    print(line if rank == 0 else f"[rank {rank}] {line}", file=sys.stderr)


def run_guarded(fn, *args) -> int:
    """Run a command body, turning expected failures into one line on stderr and exit status 2.

    Every rank of a launcher gets the same command line, recipe and ds_config, so an error in them (ConfigError,
    SharedUserError) is printed by rank 0 only; other bad input (a file one node lacks) may differ between ranks
    and is printed by each, prefixed with its rank. The rank is the launcher's (environment), so this holds before
    and after the process group is joined."""
    try:
        return fn(*args) or 0
    except ReportedElsewhere:  # another rank printed the error
        return exit_joined(2)
    except UserError as err:
        if launcher_rank() == 0 or not isinstance(err, (ConfigError, SharedUserError)):  # every rank hits those alike
            say(f"error: {err}")
        return exit_joined(2)
    except RuntimeError as err:  # a collective failed: a rank is gone (one line naming it), or this rank's own bug
        from moep_ds.distributed.rank_errors import lost_rank_error

        lost = lost_rank_error(err)
        if lost is None:
            raise
        say(f"error: {lost}")
        return exit_joined(1)
    except KeyboardInterrupt:  # a second Ctrl-C while the trainer checkpoints, or one before training started
        say("interrupted")
        return exit_joined(130)


def run_command(body, args: argparse.Namespace) -> int:
    """Entry point of a console script: INFO logging to stderr, then `body(args)` with one-line errors."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_guarded(body, args)


def run_split(body, *args) -> int:
    """The exit status of a command on the ranks of a model split over them (moep-eval, moep-generate,
    lm_eval_cli, moep-import under a launcher): the largest status the ranks returned, after which every rank leaves
    the process group together. A rank whose `body(*args)` raises leaves at once instead (`exit_joined`; the
    interpreter for an unexpected error): the others may be in a collective it will not join, and the launcher stops
    them, so one rank failing fails the command everywhere. Errors that every rank meets alike (a checkpoint one
    rank cannot read: `stop_together`) are raised by all."""
    import torch.distributed as dist

    from moep_ds.checkpointing.sharded import all_reduce_value
    from moep_ds.distributed.process_group import leave_process_group

    code = body(*args)
    if dist.is_initialized():
        code = int(all_reduce_value(code, dist.ReduceOp.MAX))
        leave_process_group()
    return code
