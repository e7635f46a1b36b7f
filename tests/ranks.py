"""Several ranks of a process group inside one test: `run_ranks(2, fn, *args)` runs `fn(*args)` on 2 processes forked
from a server that has imported torch, DeepSpeed and the trainer once (multiprocessing's forkserver), each with the
environment a launcher gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so gloo and
DeepSpeed initialise as under torchrun. Each rank's return value, exit status, stdout and stderr come back; a rank
that fails ends the others, as torchrun does. Saves the interpreter, imports and launcher of a torchrun launch
(seconds each on the 2-core CI machine); a test that is about the launcher itself launches one.

    from ranks import run_ranks
    out = run_ranks(2, train, recipe_path)        # fn must be importable: a module-level function
    assert out[0].result == ...
"""
from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import pathlib
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback

PRELOAD = ["rank_preload"]  # imported by the fork server before it forks a rank
MAX_RANKS = 2  # no test runs more processes than the CI machine has cores
# except a test of several "nodes" (per_node), which needs 2 of 2 at least: node-aware expert dispatch
MAX_NODE_RANKS = 4
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK",
                 "MV2_COMM_WORLD_SIZE")
_context = None
# the environment at collection, before any test changed it: the fork server starts in it, since what it imports
# reads some variables once (OMP_NUM_THREADS, the Hugging Face cache paths)
_START_ENV = dict(os.environ)


@dataclasses.dataclass
class Rank:
    rank: int
    exitcode: int  # negative: ended by that signal (as subprocess reports it)
    stdout: str
    stderr: str
    result: object = None  # fn's return value (exit status 0 only)
    error: str | None = None  # the traceback of an exception fn raised


class RanksFailed(AssertionError):
    pass


@dataclasses.dataclass
class Joined:
    """The ranks of one run read as one command's result, as a launcher's: the first failing rank's exit status (0
    if none), and every rank's stdout and stderr in rank order."""
    returncode: int
    stdout: str
    stderr: str


def joined(ranks: list[Rank]) -> Joined:
    return Joined(next((r.exitcode for r in ranks if r.exitcode != 0), 0), "".join(r.stdout for r in ranks),
                  "".join(r.stderr for r in ranks))


def context():
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        test_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(_START_ENV)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(test_env)
        _context = ctx
    return _context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(extra: dict | None = None) -> dict:
    """This process's environment as a launched worker's starts: one thread, offline hubs, this checkout first on
    PYTHONPATH, no launcher variables of an outer launch."""
    from repo_paths import REPO

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.update(extra or {})
    return env


def command(module: str, argv: list[str]) -> None:
    """On a rank: `python -m MODULE ARGV` as the console command runs it (its main() reads sys.argv), the command's
    status the rank's exit status."""
    import importlib

    sys.argv = [module, *argv]
    raise SystemExit(importlib.import_module(module).main())


def run_command(nproc: int, module: str, *argv: str, **options) -> list[Rank]:
    """`python -m MODULE ARGV` on `nproc` ranks of a launch (options: those of run_ranks)."""
    return run_ranks(nproc, command, module, list(argv), **options)


def _rank_main(rank: int, env: dict, out: str, fn, args, kwargs) -> None:
    """A rank's process: the launcher's environment, stdout / stderr to files, fn, then leave the process group and
    exit without the interpreter's teardown (gloo's threads, distributed/process_group.py)."""
    gc.freeze()  # what the fork server made after its preload: not walked by this rank's collections either
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [f"rank{rank}"]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out, f"{name}{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    code, payload = 0, None
    try:
        payload = ("result", fn(*args, **kwargs))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported to the test
        traceback.print_exc()
        code, payload = 1, ("error", traceback.format_exc())
    try:
        if payload is not None:
            with open(os.path.join(out, f"result{rank}"), "wb") as f:
                pickle.dump(payload, f)
        dist = sys.modules.get("torch.distributed")
        if code == 0 and dist is not None and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(nproc: int, fn, *args, env: dict | None = None, timeout: float = 600, check: bool = True,
              grace: float | None = 2.0, per_node: int | None = None, **kwargs) -> list[Rank]:
    """Run `fn(*args, **kwargs)` on ranks 0 .. nproc-1 of a new process group's environment (gloo on CPU).

    env: extra environment variables. per_node: ranks per "node" (LOCAL_WORLD_SIZE and LOCAL_RANK as torchrun sets
    them on each of nproc / per_node nodes; up to MAX_NODE_RANKS ranks then), else one node of nproc. A rank that
    exits non-zero ends the others after `grace` seconds (SIGTERM, then SIGKILL), as a launcher does (torchrun: within 0.1 s; None: they run on, as processes without a launcher). check: raise, with every
    rank's output, unless all ranks exit 0. Ranks still running after `timeout` seconds are ended and the run
    fails, checked or not."""
    if nproc > (MAX_RANKS if per_node is None else MAX_NODE_RANKS):
        raise ValueError(f"{nproc} ranks: a test runs at most {MAX_RANKS} (the cores of the CI machine), "
                         f"{MAX_NODE_RANKS} as several nodes")
    per_node = per_node or nproc
    if nproc % per_node:
        raise ValueError(f"{nproc} ranks do not make nodes of {per_node}")
    ctx = context()
    base = launcher_env(env)
    base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory(prefix="ranks-") as out:
        procs = []
        for rank in range(nproc):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % per_node))
            p = ctx.Process(target=_rank_main, args=(rank, rank_env, out, fn, args, kwargs), name=f"rank{rank}")
            p.start()
            procs.append(p)
        timed_out = _wait(procs, timeout, grace)
        ranks = [_collect(rank, p.exitcode, pathlib.Path(out)) for rank, p in enumerate(procs)]
    if timed_out:
        raise RanksFailed(f"{fn.__name__} on {nproc} ranks timed out after {timeout} s\n{describe(ranks)}")
    if check and any(r.exitcode != 0 for r in ranks):
        raise RanksFailed(describe(ranks))
    return ranks


def _wait(procs, timeout: float, grace: float | None) -> bool:
    """Wait for every rank; end them all `grace` seconds after one failed, or at `timeout` (then True)."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if failed_at is None and grace is not None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            _end(procs)
            return now > deadline
        time.sleep(0.05)
    return False


def _end(procs) -> None:
    # a trainer takes SIGTERM as a stop request (at the end of its step): one stuck in a collective needs SIGKILL
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
        for p in procs:
            if p.exitcode is None:
                os.kill(p.pid, sig)
        deadline = time.monotonic() + wait
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)


def _collect(rank: int, exitcode: int, out: pathlib.Path) -> Rank:
    kind, value = "result", None
    if (out / f"result{rank}").exists():
        with open(out / f"result{rank}", "rb") as f:
            kind, value = pickle.load(f)
    text = [(out / f"{name}{rank}").read_text(errors="replace") if (out / f"{name}{rank}").exists() else ""
            for name in ("stdout", "stderr")]
    return Rank(rank, exitcode, *text, result=value if kind == "result" else None,
                error=value if kind == "error" else None)


def describe(ranks: list[Rank]) -> str:
    return "\n".join(f"rank {r.rank} exited {r.exitcode}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n"
                     f"{r.stderr[-6000:]}" for r in ranks)
