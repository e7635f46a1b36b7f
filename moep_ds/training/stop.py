"""Stopping cleanly: signals, the launcher going away, or RUN_DIR/STOP ask for a checkpoint and an exit at the next
step boundary (the trainer's stop callback, training/callbacks/builtin.py, reads `StopRequest.requested`)."""
from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time

import psutil

from moep_ds.distributed.launcher import launcher_generations

log = logging.getLogger(__name__)


INTERRUPT_ECHO_S = 1.0


class StopRequest:
    """SIGUSR1 / SIGTERM (SLURM preemption), SIGINT (Ctrl-C, which reaches every process of the terminal's process
    group: under `deepspeed` the trainers and their launcher, which then sends SIGTERM), or the launcher going away,
    ask for a checkpoint and a clean exit at the next step boundary (`requested`). A second SIGINT aborts at once
    (KeyboardInterrupt): the way out of a checkpoint that takes too long.

    SIGTERM to the `deepspeed` runner kills the runner only: its per-node launcher and the trainers go on,
    re-parented. A daemon thread watches the launcher's processes (or the pids in `watch`; none for a process no
    launcher started) every `poll_s` seconds (MOEP_STOP_POLL_S, default 5) and sets `requested` once one of them is
    gone or has a new parent, or once `stop_file` (RUN_DIR/STOP, watched on rank 0) exists."""

    def __init__(self, watch: list[int] | None = None, poll_s: float | None = None,
                 stop_file: pathlib.Path | None = None):
        self.requested = False
        self.stop_file = stop_file
        poll_s = float(os.environ.get("MOEP_STOP_POLL_S", 5.0)) if poll_s is None else poll_s
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)
        watch = launcher_chain() if watch is None else watch
        self.parents = {pid: parent_pid(pid) for pid in watch}
        if self.parents or stop_file is not None:
            threading.Thread(target=self.watch_launcher, args=(poll_s,), daemon=True,
                             name="moep-launcher-watch").start()

    def handle(self, signum, frame) -> None:
        log.warning("received signal %d: checkpointing and stopping after this step", signum)
        self.requested = True
        # A repeat must not kill the process while it checkpoints or shuts down; a second Ctrl-C is meant to.
        self.interrupted_at = time.monotonic()
        signal.signal(signum, self.interrupt_again if signum == signal.SIGINT else signal.SIG_IGN)

    def interrupt_again(self, signum, frame) -> None:
        """A second Ctrl-C aborts; one within INTERRUPT_ECHO_S of the first is the same Ctrl-C passed on by a
        launcher (torchrun forwards the SIGINT its agent got to the trainers, which got it from the terminal too)."""
        if time.monotonic() - self.interrupted_at > INTERRUPT_ECHO_S:
            raise KeyboardInterrupt

    def watch_launcher(self, poll_s: float) -> None:
        while not self.requested:
            time.sleep(poll_s)
            gone = [pid for pid, parent in self.parents.items() if parent_pid(pid) != parent]
            if self.stop_file is not None and self.stop_file.exists():
                log.warning("found %s: checkpointing and stopping after this step", self.stop_file)
                self.requested = True
            elif gone:
                log.warning("launcher process %s is gone: checkpointing and stopping after this step", gone[0])
                self.requested = True


def parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def launcher_chain() -> list[int]:
    """This process and the launcher processes above it whose parents must not change while training; none when
    no launcher started this process (a plain `python pretrain.py`, whose shell may exit: nohup ... &)."""
    try:
        parent = psutil.Process(os.getppid())
        generations = launcher_generations(parent.cmdline())
    except psutil.Error:
        return []
    if generations == 0:
        return []
    chain = [os.getpid()]
    for _ in range(generations - 1):
        chain.append(parent.pid)
        parent = parent.parent()
        if parent is None:
            break
    return chain
