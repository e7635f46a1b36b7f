"""MANIFEST.json: the size and checksum of every file of a checkpoint, so that flipped bytes are found before they are
trained on or exported (a shard whose size is intact passes `sharded.check_files`, and DCP reads garbage weights
from it without a word).

    {"format": 1, "algorithm": "xxh3_128", "files": {"__0_0.distcp": {"bytes": 123, "digest": "9f..."}, ...}}

Every file under the checkpoint except COMPLETE and the manifest itself is listed. Each rank hashes the files it
wrote (`own_files`: its DCP data file, hashed on its way to disk by sharded.HashingFileSystem, and its RNG state;
rank 0 the rest), in parallel; rank 0 writes the manifest before COMPLETE (training/checkpoint.py
CheckpointWriter.seal). At load the files are checked in shares (`share`) that the ranks verify in parallel
(training/checkpoint.py check_together), or all by one process (`check`: moep-export, moep-eval, moep-generate).

xxh3_128 (the xxhash package) reads at memory speed, some 5x sha256 here (bench/RESULTS.md, checkpoint_scale): a
checksum against flipped bytes, not a signature. Other algorithms hashlib knows are read too. Checkpoints written
before 2026-12-07 have no manifest: nothing to check. (Nor for a newer one whose manifest was deleted: a marker
elsewhere, in meta.json say, would travel with that file into the directories written from a checkpoint's meta.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable

import xxhash

from moep_ds.checkpointing import sharded
from moep_ds.checkpointing.sharded import DamagedCheckpoint

log = logging.getLogger(__name__)

MANIFEST_FILE = "MANIFEST.json"
ALGORITHM = "xxh3_128"
FORMAT = 1
UNLISTED = {"COMPLETE", MANIFEST_FILE}  # the marker written after the manifest, and the manifest
RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt")  # the files a rank writes itself
BLOCK = 8 << 20


def hasher(algorithm: str) -> Any:
    if algorithm == ALGORITHM:
        return xxhash.xxh3_128()
    return hashlib.new(algorithm)  # ValueError for a name hashlib does not know


def digest(file: Path, algorithm: str = ALGORITHM) -> str:
    """The hex checksum of `file`, read in blocks (hashers release the GIL on large buffers)."""
    h, buf = hasher(algorithm), bytearray(BLOCK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def bytes_digest(data: bytes, algorithm: str = ALGORITHM) -> str:
    h = hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def listed_files(folder: Path) -> list[str]:
    """Every file under `folder` the manifest lists, as relative POSIX paths, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() not in UNLISTED)


def writer_rank(name: str) -> int:
    """The rank that wrote file `name` of a checkpoint: the rank in its name, else 0."""
    m = RANK_FILE.fullmatch(name)
    return int(m.group(1) or m.group(2)) if m else 0


def own_files(folder: Path, rank: int) -> list[str]:
    return [name for name in listed_files(folder) if writer_rank(name) == rank]


def records(folder: Path, names: Iterable[str], algorithm: str = ALGORITHM) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "digest"}} of files `names` of `folder` (OSError as reading raises it)."""
    return {n: {"bytes": (folder / n).stat().st_size, "digest": digest(folder / n, algorithm)} for n in names}


def write(folder: Path, files: dict[str, dict[str, Any]], algorithm: str = ALGORITHM) -> None:
    """The manifest of `folder` from the ranks' `files`; a file no rank recorded (a rank that wrote under another
    name) is hashed here, so that every file is listed."""
    files = {**files, **records(folder, [n for n in listed_files(folder) if n not in files], algorithm)}
    text = json.dumps({"format": FORMAT, "algorithm": algorithm, "files": dict(sorted(files.items()))}, indent=1)
    (folder / MANIFEST_FILE).write_text(text + "\n")


def seal(folder: Path, algorithm: str = ALGORITHM) -> None:
    """The manifest of every file of `folder`, hashed by this one process (an import, a test's edited copy)."""
    write(folder, {}, algorithm)


def read(folder: Path) -> dict[str, Any] | None:
    """The manifest's {"algorithm", "files"}; None for a checkpoint written without one; DamagedCheckpoint for one
    that is unreadable."""
    f = folder / MANIFEST_FILE
    if not f.is_file():
        log.debug("checkpoint %s has no %s (written before checksums): its files are not checked", folder, f.name)
        return None
    try:
        manifest = json.loads(f.read_text())
        algorithm, files = manifest["algorithm"], manifest["files"]
        hasher(algorithm)
        if not (isinstance(files, dict) and all(isinstance(r.get("bytes"), int) and isinstance(r.get("digest"), str)
                                                for r in files.values())):
            raise ValueError("a file's record is not {bytes, digest}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedCheckpoint(f"checkpoint {str(folder)!r} is damaged: {str(f)!r} is unreadable "
                                f"({type(err).__name__}: {err})") from None
    return {"algorithm": algorithm, "files": files}


def share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` verifies: the largest first, each to the rank with the fewest bytes so far
    (the same split on every rank, from the manifest alone)."""
    loads, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = loads.index(min(loads))
        loads[r] += files[name]["bytes"]
        if r == rank:
            mine.append(name)
    return mine


def check(folder: Path, rank: int = 0, world: int = 1, already: dict[str, bytes] | None = None) -> None:
    """Every file of a sharded checkpoint there and whole (`sharded.check_files`), then its checksums (this rank's
    share of them): DamagedCheckpoint naming the first file that is not. `already`: files the caller has read
    (name -> bytes), whose bytes are checked instead of reading them again."""
    sharded.check_files(folder)
    verify(folder, rank, world, already)


def verify(folder: Path, rank: int = 0, world: int = 1, already: dict[str, bytes] | None = None) -> None:
    """Raise DamagedCheckpoint naming the first file (of this rank's share) that is missing, of another size or
    checksum than the manifest records; nothing for a checkpoint without a manifest. `already`: as in `check`."""
    already = already or {}
    manifest = read(folder)
    if manifest is None:
        return
    files, algorithm = manifest["files"], manifest["algorithm"]
    for name in sorted(share(files, rank, world)):
        f, want = folder / name, files[name]
        where = f"checkpoint {str(folder)!r} is damaged: {str(f)!r}"
        if not f.is_file():
            raise DamagedCheckpoint(f"{where} is missing")
        if f.stat().st_size != want["bytes"]:
            raise DamagedCheckpoint(f"{where} has {f.stat().st_size} bytes, {MANIFEST_FILE} records {want['bytes']}")
        try:
            got = digest(f, algorithm) if name not in already else bytes_digest(already[name], algorithm)
        except OSError as err:
            raise DamagedCheckpoint(f"{where} is unreadable ({err.strerror or err})") from None
        if got != want["digest"]:
            raise DamagedCheckpoint(f"{where} fails its checksum ({algorithm} {got}, {MANIFEST_FILE} records "
                                    f"{want['digest']})")
