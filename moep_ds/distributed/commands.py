"""How a console command runs on every rank of a launch: argument parsing with one flag style (underscores, each
option also accepted with dashes), one-line errors printed once (by rank 0 where every rank has the same one), and
leaving the process group on failure. The commands themselves are in moep_ds/cli/."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Iterator

from moep_ds.distributed.launcher import launched_world_size, launcher_rank
from moep_ds.errors import ReportedElsewhere, SharedUserError, TrainingFailed, UserError
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler's stop) or SIGHUP (the terminal closed) raised in the main thread, as
    SIGINT raises KeyboardInterrupt: the command's `finally` blocks remove its temporaries (fsutil.atomic_dir)
    before it exits."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While a command of one process runs, SIGTERM and SIGHUP raise Terminated (once: a repeat during the clean-up
    is ignored; a signal ignored already, as `nohup` ignores SIGHUP, stays ignored). Not for the ranks of a launch: a
    rank waiting in a collective runs no Python code until the collective returns, so torchrun's SIGTERM to the
    survivors of a failed rank must end them at once (what one leaves, the next command into the same output
    removes: fsutil.remove_stale_temporaries)."""
    if launched_world_size() > 1 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        for sig in STOPPING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    previous = {sig: signal.getsignal(sig) for sig in STOPPING_SIGNALS}
    for sig, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(sig, terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interruption(err: BaseException) -> KeyboardInterrupt | None:
    """The SIGINT / SIGTERM (KeyboardInterrupt, Terminated) behind `err`: DCP wraps one raised while it writes."""
    from moep_ds.fsutil import exception_chain

    return next((e for e in exception_chain(err) if isinstance(e, KeyboardInterrupt)), None)


def stopped(signal_error: KeyboardInterrupt) -> int:
    """One line and the shell's status for a command stopped by a signal: 128 + its number."""
    if isinstance(signal_error, Terminated):
        say(f"terminated ({signal.Signals(signal_error.signum).name})")
        return exit_joined(128 + signal_error.signum)
    say("interrupted")
    return exit_joined(128 + signal.SIGINT)


def run_guarded(fn, *args) -> int:
    """Run a command body, turning expected failures into one line on stderr and exit status 2, and SIGINT / SIGTERM /
    SIGHUP into one line and status 128 + the signal's number (after its temporaries are removed: sigterm_raises).

    Every rank of a launcher gets the same command line, recipe and ds_config, so an error in them (ConfigError,
    SharedUserError) is printed by rank 0 only; other bad input (a file one node lacks) may differ between ranks
    and is printed by each, prefixed with its rank. The rank is the launcher's (environment), so this holds before
    and after the process group is joined."""
    try:
        with sigterm_raises():
            return fn(*args) or 0
    except ReportedElsewhere:  # another rank printed the error
        return exit_joined(2)
    except TrainingFailed as err:  # every rank stopped at the same step; rank 0 says why
        if launcher_rank() == 0:
            say(f"error: {err}")
        return exit_joined(1)
    except UserError as err:
        if launcher_rank() == 0 or not isinstance(err, (ConfigError, SharedUserError)):  # every rank hits those alike
            say(f"error: {err}")
        return exit_joined(2)
    except RuntimeError as err:  # a collective failed: a rank is gone (one line naming it), or this rank's own bug
        from moep_ds.distributed.rank_errors import lost_rank_error

        lost = lost_rank_error(err)
        if lost is None and interruption(err) is None:
            raise
        if lost is None:
            return stopped(interruption(err))
        say(f"error: {lost}")
        return exit_joined(1)
    except KeyboardInterrupt as err:  # a second Ctrl-C while the trainer checkpoints, one before training started
        return stopped(err)
    except BaseException as err:  # DCP's CheckpointException (a BaseException) around a signal's exception
        if isinstance(err, (SystemExit, GeneratorExit)) or interruption(err) is None:
            raise
        return stopped(interruption(err))


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
