"""Host (CPU) memory that training frees but the process keeps.

glibc's malloc serves an allocation of at least its mmap threshold with a mapping of its own, which `free` hands
back to the OS at once; smaller ones come from the heap, whose free space in the middle stays in the process.
The threshold starts at 128 KiB and, each time a mapped block is freed, rises to that block's size (up to 32 MiB).
After the first step of training on CPU, every activation of up to 32 MiB is therefore carved from the heap, and
the buffers a forward frees between the ones it keeps (checkpointed block inputs, the loss's log-softmax) are held
as holes: measured on `configs/nova_moe.yaml` at T 512, micro-batch 16, activation checkpointing on, 1.1 GB of
the 1.8 GB a forward adds to the process's resident memory were freed buffers (bench/RESULTS.md).

`return_freed_buffers_to_os` fixes the threshold (which also stops it rising), so that every tensor buffer of 1 MiB
or more is a mapping of its own and leaves the process when freed. The price is a page fault for each page of
each such buffer: measured 10-19% fewer tokens/s on that model, so the Trainer sets it where memory is what the
user asked for (activation checkpointing on CPU). GPU memory has its own caching allocator and is not affected.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)
RELEASE_THRESHOLD = 1 << 20  # bytes: tensor buffers from here up are returned to the OS when freed


def user_set_threshold() -> str | None:
    """The environment variable through which the user already chose glibc's mmap threshold, if any."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "MALLOC_MMAP_THRESHOLD_"
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def return_freed_buffers_to_os(threshold: int = RELEASE_THRESHOLD) -> bool:
    """Make every host allocation of `threshold` bytes or more a mapping of its own (glibc `mallopt`), so that
    freeing it returns its memory to the OS. Returns whether the setting was applied: not on a C library other than
    glibc, and not where the user set the threshold in the environment (their value stands)."""
    if platform.libc_ver()[0] != "glibc":
        log.debug("host memory: C library is not glibc; allocator left as it is")
        return False
    if (source := user_set_threshold()) is not None:
        log.info("host memory: mmap threshold left as set by %s", source)
        return False
    return ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) == 1


__all__ = ["RELEASE_THRESHOLD", "return_freed_buffers_to_os", "user_set_threshold"]
