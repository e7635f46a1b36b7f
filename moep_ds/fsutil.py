"""File-system helpers shared by every floor: directories that appear whole (a temporary sibling renamed into place),
umask modes, checks that a directory can be written, and undoing folders a failed command created.

Every directory and file written through these gets the permissions the user's umask gives (tempfile.mkdtemp and
some writers create private files; an output should read like any other file of the user's).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from moep_ds.errors import UserError

log = logging.getLogger(__name__)


def umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def apply_umask(path: Path) -> None:
    """Give `path` (recursively) the modes a plain open()/mkdir() would have given it."""
    mask = umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


ASIDE_HEX = 12  # hex digits after ".old-" in the name of a folder set aside by replace_dir


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished directory `tmp` at `final`. An old `final` is renamed aside first (a hidden sibling that
    no reader lists) and deleted once the new one is in place: a crash leaves the old or the new one whole,
    where deleting it first could leave it half gone. Old copies of `final` that an earlier call, killed before
    deleting them, left aside are removed once the new one is in place (remove_left_aside)."""
    old = None
    if final.exists() or final.is_symlink():  # a link, even a dangling one, is replaced too
        # random, not the pid: a pid can repeat after a crash
        old = final.with_name(f".{final.name}.old-{secrets.token_hex(ASIDE_HEX // 2)}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None and old.is_symlink():
        old.unlink()
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)
    remove_left_aside(final.parent, re.escape(final.name), keep=old)


def remove_left_aside(parent: Path, name: str, keep: Path | None = None) -> None:
    """Tidy the folders in `parent` named as replace_dir sets a folder whose name matches the regular expression
    `name` aside (`.NAME.old-` and 12 hex digits; `keep`, the current call's own, excepted): only a replacement
    killed between its two renames leaves one. Where NAME is there, the copy is removed; where it is not, the copy
    is the only one and is renamed back. A warning each; links and files of such a name, and any other name, are
    left alone."""
    aside = re.compile(rf"\.({name})\.old-[0-9a-f]{{{ASIDE_HEX}}}")
    for path in sorted(parent.iterdir()):
        found = aside.fullmatch(path.name)
        if not found or path == keep or not path.is_dir() or path.is_symlink():
            continue
        original = parent / found.group(1)
        if original.exists() or original.is_symlink():
            log.warning("removing %s: an old copy of %s that an interrupted replacement left", path, original.name)
            shutil.rmtree(path, ignore_errors=True)
        else:
            log.warning("restoring %s from %s, where an interrupted replacement left it", original.name, path)
            os.replace(path, original)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, tmp: Path | None = None,
               publish: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to write into; on success it becomes `final` in one rename (with
    umask modes; `publish(tmp, final)` instead of `replace_dir` where the caller puts it in place its own way);
    on any error it is removed, as are the parent folders made for it, and `final` is left as it was. A process
    killed meanwhile (SIGKILL) cannot remove it: the next atomic_dir for `final` does (remove_stale_temporaries)."""
    final = Path(final)
    created = [p for p in final.parents if not p.exists()]  # deepest first
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            remove_stale_temporaries(final)
            tmp = temporary_dir(final)
        else:
            tmp.mkdir(parents=True)
    except BaseException:
        remove_empty_dirs(created)
        raise
    done = False
    try:
        yield tmp
        apply_umask(tmp)
        (publish or replace_dir)(tmp, final)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            remove_empty_dirs(created)  # after tmp is gone, or its parent is not empty


def temporary_dir(final: Path) -> Path:
    """A new hidden sibling of `final`, `.NAME.HOST-PIDNS-PID-XXXXXXXX.tmp`: the host, pid namespace and process
    that write it are in its name, so that a later process can tell one whose writer is dead
    (remove_stale_temporaries)."""
    prefix = f".{final.name}.{pid_owner()}-{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=final.parent))


def pid_owner() -> str:
    """Where this process's pid means this process: the host name (letters, digits, dashes) and the inode of the pid
    namespace (containers on one host, which may share its name, each count pids of their own)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS)
        namespace = 0
    return f"{re.sub(r'[^A-Za-z0-9-]', '', socket.gethostname())}-{namespace}"


def remove_stale_temporaries(final: Path) -> None:
    """Remove the temporaries of `final` (temporary_dir) that a process of this host left when it was killed before
    it could (SIGKILL, a node's out-of-memory killer): its pid is no longer running. One of another host or
    container, or of a running pid (perhaps reused), is left alone: it may be being written."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.([A-Za-z0-9-]*)-(\d+)-[a-z0-9_]{{8}}\.tmp")
    owner = pid_owner()
    for path in sorted(final.parent.iterdir()) if final.parent.is_dir() else []:
        found = pattern.fullmatch(path.name)
        if found and found.group(1) == owner and not path.is_symlink() and path.is_dir() \
                and not pid_running(int(found.group(2))):
            log.warning("removing %s: a temporary of %s that a process killed before it finished (pid %s) left",
                        path, final.name, found.group(2))
            shutil.rmtree(path, ignore_errors=True)


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


@contextlib.contextmanager
def output_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Where to write a directory that must appear whole: a temporary sibling (atomic_dir), or, when `final` is
    an existing empty folder, that folder itself, emptied again on error (a mount point, or a folder made for
    the output in a parent this process cannot write: no sibling can be made there, and nothing is replaced)."""
    final = Path(final)
    if not is_empty_dir(final):
        with atomic_dir(final) as tmp:
            yield tmp
        return
    try:
        yield final
        for child in final.iterdir():  # not the folder itself: it is the caller's (perhaps a mount point)
            apply_umask(child)
    except BaseException:
        for child in final.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        raise


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Remove `dirs` (deepest first) as long as they are empty: a failed write leaves no new folders behind,
    and never removes one that something else has filled meanwhile."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def check_dir_target(option: str, path: Path) -> None:
    """Refuse a directory to write into that is a file or lies under one, before any work (mkdir's error would
    be a traceback, and often only once the work is done)."""
    for existing in (path, *path.parents):
        if existing.is_dir():
            return
        if existing.exists() or existing.is_symlink():  # a file, or a link to nothing
            if existing == path:
                raise UserError(f"{option} ({str(path)!r}) exists and is not a directory")
            raise UserError(f"{option} ({str(path)!r}) cannot be created: {str(existing)!r} is not a directory")


def check_writable(directory: str | os.PathLike, field: str) -> Path:
    """Create `directory` if needed and make sure files can be written there: PROBE_BYTES written and synced (a full
    disk still creates an empty file); one-line UserError otherwise."""
    path = Path(directory)
    probe = path / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(bytes(PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise UserError(write_error(field, path, err)) from None
    return path


def write_error(field: str, path: Path, err: OSError) -> str:
    """The line for an OSError met writing in `path`, named as `field`: a full disk with the space left there."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{field} ({str(path)!r}): {disk_full(path)}"
    return f"{field} ({str(path)!r}) is not writable: {err.strerror or err}"


PROBE_BYTES = 1 << 20


def disk_full(where: Path, free: int | None = None) -> str:
    """What a write that found no space says: the path and the space left on its file system (`free` bytes)."""
    free = free_bytes(where) if free is None else free
    return f"disk full (No space left on device) writing {str(where)!r}, {free >> 20} MiB free there"


def disk_full_reason(err: BaseException, where: Path) -> str | None:
    """`disk_full` where `err` is a write that found no space, whatever wrapped the OSError (the cause chain, DCP's
    CheckpointException with each rank's exception, torch.save's stream writer turning a short write into
    "[enforce fail at inline_container.cc] unexpected pos N vs M"); None for any other error. The path named is
    `where` (the output being written, not its temporary), or the file the OSError names where that lies elsewhere
    (a library's cache)."""
    causes = list(exception_chain(err))
    full = [e for e in causes if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)]
    if not full and not (any("unexpected pos" in str(e) or "No space left" in str(e) for e in causes)
                         and free_bytes(where) < DISK_FULL_BYTES):
        return None
    named = next((Path(e.filename).absolute() for e in full if isinstance(e.filename, str)), None)
    if named is not None and not named.is_relative_to(Path(where).absolute().parent):
        where = named
    return disk_full(where)


DISK_FULL_BYTES = 64 << 20  # a short write with less than this left on the file system is taken for a full disk


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, its causes and contexts, and the per-rank exceptions of a DCP CheckpointException."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


@contextlib.contextmanager
def writing_to(where: str | os.PathLike) -> Iterator[None]:
    """A command's write of `where`: a full disk met anywhere inside is one UserError line naming `where` and the
    space left there (disk_full_reason), not the OSError (or wrapper) of whichever library wrote the bytes."""
    try:
        yield
    except BaseException as err:
        # not `except Exception`: DCP's CheckpointException is a BaseException
        stopped = isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))
        reason = None if stopped else disk_full_reason(err, Path(where))
        if reason is None:
            raise
        raise UserError(reason) from None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` or its nearest existing parent (0 if none can be asked)."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def first_missing(directory: str | os.PathLike) -> Path | None:
    """The outermost folder on the way to `directory` that does not exist yet (None: `directory` exists)."""
    path, missing = Path(directory).absolute(), None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def remove_new_dir(directory: str | os.PathLike, created: Path | None) -> None:
    """Undo the creation of `directory`, whose outermost new folder was `created` (`first_missing` before): the
    directory goes with what this run wrote there; the new folders above it only while empty, since another run
    started at the same time may have put its own directory beside this one."""
    if created is None:
        return
    directory = Path(directory).absolute()
    shutil.rmtree(directory, ignore_errors=True)
    for parent in directory.parents:
        if not parent.is_relative_to(created):
            break
        try:
            parent.rmdir()
        except OSError:  # not empty (or gone)
            break
