"""One running job per run directory: rank 0 holds an exclusive lock on RUN_DIR/.lock for the life of its process.

Without it two runs started into one train.output_dir (two launches at once, or a SLURM requeue while the old job
still runs) both pass the run-directory contract (training/run_dir.py) before either has written anything; then each
removes the other's half-written checkpoint and both append their loss curves to one metrics.jsonl.

The lock is flock(2) on RUN_DIR/.lock. The kernel releases it when the process ends, however it ends (a crash,
SIGKILL; on NFS a dead client's lock goes with its lease), so a crashed run's lock is simply taken by the next run:
nothing stale to clean up. The file stays and holds the last holder's record as one JSON line (host, pid, start
time, SLURM job id and restart count), which a refused run names. flock and not fcntl's record locks, which any
close of any descriptor of the file in the process would drop. Across nodes the lock holds where the file system
passes flock on (NFS, GPFS, Lustre mounted with `-o flock`; with `-o localflock` only within a node); where flock
is refused (ENOLCK, EOPNOTSUPP, ENOSYS) the run warns and goes on unlocked.

A SLURM requeue keeps SLURM_JOB_ID and counts SLURM_RESTART_COUNT up (the launchers pass both on as MOEP_SLURM_JOB_ID
and MOEP_SLURM_RESTART_COUNT, which reach the processes pdsh starts). A holder that is an earlier start of this same
job is finishing: its trainers checkpoint on the requeue's signal, and SLURM kills what is left after KillWait (30 s
by default). The new start waits for it, up to MOEP_RUN_LOCK_WAIT seconds (default 180), and then continues from
what it saved (the launchers resume with --resume auto); the other ranks wait meanwhile in a collective, so keep the
wait below its timeout (DEEPSPEED_TIMEOUT, 10 minutes by default). If it still holds the lock after that, SLURM has given that
start up (a node that stopped answering keeps its processes and, on NFS, its lock for a while) and the start SLURM
runs now owns the folder: it takes the lock over with a warning naming the old holder (a new lock file renamed over
the old one; the old start, were it still running, holds a lock on a file no longer named .lock). Any other holder
(another job, a second launch within one job, a run outside SLURM) is refused at once, in one line naming it.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import secrets
import socket
import time

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
WAIT_ENV = "MOEP_RUN_LOCK_WAIT"
DEFAULT_WAIT_S = 180.0
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# this process's locks, by run directory: a second run in the same process (a notebook, the tests) reuses its lock;
# with what the lock file held before (None: this process made it), which a failed start-up puts back
_held: dict[pathlib.Path, int] = {}
_found: dict[pathlib.Path, bytes | None] = {}


def job() -> tuple[str | None, int]:
    """(SLURM job id or None, restart count) of this process."""
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("MOEP_SLURM_JOB_ID") or None
    count = os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("MOEP_SLURM_RESTART_COUNT") or "0"
    return job_id, int(count) if count.isdigit() else 0


def holder_record() -> dict:
    job_id, restart = job()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started, "slurm_job_id": job_id,
            "slurm_restart_count": restart}


def describe(holder: dict | None) -> str:
    if not holder:
        return "a run that has not recorded itself yet"
    text = f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
    if holder.get("slurm_job_id"):
        text += f", SLURM job {holder['slurm_job_id']} (restart {holder.get('slurm_restart_count', 0)})"
    return text


def read_holder(path: pathlib.Path, tries: int = 20) -> dict | None:
    """The holder's record; retried briefly, as a holder that has just taken the lock is still writing it."""
    for _ in range(tries):
        try:
            holder = json.loads(path.read_text())
            if isinstance(holder, dict):
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


def is_locked_file(fd: int, path: pathlib.Path) -> bool:
    """Whether `fd` is still the file named `path` (a takeover renames a new lock file over it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def try_lock(path: pathlib.Path) -> int | None:
    """A descriptor of `path` holding its exclusive lock, None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        if is_locked_file(fd, path):
            return fd
        os.close(fd)  # taken over between our open and our lock: try the file now named so


def record(fd: int) -> None:
    data = (json.dumps(holder_record()) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def take_over(path: pathlib.Path) -> int:
    """Lock a new file and rename it over `path`: later runs find this process as the holder."""
    new = path.with_name(f"{LOCK_FILE}.{secrets.token_hex(4)}")
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    record(fd)
    os.replace(new, path)
    return fd


def wait_s() -> float:
    value = os.environ.get(WAIT_ENV, "")
    try:
        return float(value) if value else DEFAULT_WAIT_S
    except ValueError:
        log.warning("%s (%r) is not a number of seconds; waiting %g s", WAIT_ENV, value, DEFAULT_WAIT_S)
        return DEFAULT_WAIT_S


def is_earlier_start(holder: dict | None) -> bool:
    """Whether the holder is an earlier start of this SLURM job (a requeue: same job id, lower restart count)."""
    job_id, restart = job()
    return bool(holder and job_id and str(holder.get("slurm_job_id")) == job_id
                and isinstance(holder.get("slurm_restart_count"), int) and holder["slurm_restart_count"] < restart)


def lock_run_dir(run_dir: pathlib.Path) -> str | None:
    """Take the run directory's lock for the life of this process (module docstring); the one-line refusal naming
    the holder when another run holds it, None once this process holds it (or the file system has no locks)."""
    run_dir = run_dir.resolve()
    path = run_dir / LOCK_FILE
    if run_dir in _held:
        if is_locked_file(_held[run_dir], path):
            return None
        os.close(_held.pop(run_dir))  # the folder was removed (a failed start) and made again
    try:
        fd = try_lock(path)
        holder = None if fd is not None else read_holder(path)
        if fd is None and is_earlier_start(holder):
            fd = wait_for_earlier_start(path, holder)
    except OSError as err:
        if err.errno not in UNSUPPORTED:
            raise
        log.warning("%s: the file system refuses locks (%s): nothing keeps a second run out of this folder while "
                    "this one runs", path, err.strerror)
        return None
    if fd is None:
        return (f"train.output_dir ({str(run_dir)!r}) is in use by another run ({describe(holder)}): wait for it to "
                f"end, stop it (touch {run_dir / 'STOP'}), or start this run in another train.output_dir")
    found = os.pread(fd, 1 << 16, 0) if os.fstat(fd).st_size else None
    if holder is None and found:
        log.info("%s: the earlier run there (%s) has ended", run_dir, describe(read_holder(path, tries=1)))
    record(fd)
    _held[run_dir], _found[run_dir] = fd, found
    return None


def release_run_dir(run_dir: pathlib.Path) -> None:
    """A start-up that failed leaves the folder as it found it: the lock file removed where this process made it,
    else its earlier record put back; then the lock goes. Nothing where this process holds no lock."""
    run_dir = pathlib.Path(run_dir).resolve()
    fd = _held.pop(run_dir, None)
    if fd is None:
        return
    found = _found.pop(run_dir, None)
    try:
        if is_locked_file(fd, run_dir / LOCK_FILE) and found is None:
            # while still locked: a run that opened it meanwhile tries again. Another rank of this failed start may
            # have removed the new folder already (training/trainer.py, fsutil.remove_new_dir)
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
        elif is_locked_file(fd, run_dir / LOCK_FILE):
            os.ftruncate(fd, 0)
            os.pwrite(fd, found, 0)
    finally:
        os.close(fd)


def wait_for_earlier_start(path: pathlib.Path, holder: dict) -> int:
    """A requeued job's start: wait for its earlier start to let the lock go, then take it over."""
    limit = wait_s()
    log.warning("%s is held by an earlier start of this SLURM job (%s): waiting up to %g s (%s) for it to end",
                path.parent, describe(holder), limit, WAIT_ENV)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        fd = try_lock(path)
        if fd is not None:
            return fd
    log.warning("%s: the earlier start of this SLURM job (%s) still holds the lock after %g s; taking it over",
                path.parent, describe(holder), limit)
    return take_over(path)
