"""Host memory freed in training goes back to the OS (glibc mmap threshold; training/host_memory.py)."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from moep_ds.training import host_memory
from tests.training.tiny import REPO, env

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")

# The pattern a checkpointed forward leaves on glibc's heap: large temporaries freed between buffers that are kept.
FRAGMENT = """
import json, os, sys
import torch
from moep_ds.training.host_memory import return_freed_buffers_to_os

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

applied = return_freed_buffers_to_os() if sys.argv[1] == "1" else False
warm = torch.ones(5 << 20)  # a 20 MiB buffer freed once: glibc's dynamic threshold rises above 16 MiB
del warm
base = rss()
temporaries, kept = [], []
for _ in range(8):
    temporaries.append(torch.ones(4 << 20))  # 16 MiB, touched
    kept.append(torch.ones(1 << 16))  # 256 KiB, allocated above it
del temporaries
print(json.dumps({"applied": applied, "held_mib": (rss() - base) / 2**20}))
"""


def held_after_free(apply: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", FRAGMENT, str(int(apply))], env=env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def test_freed_buffers_leave_the_process():
    """128 MiB of freed temporaries: glibc's default keeps them as heap holes; with the setting they are gone."""
    default, released = held_after_free(False), held_after_free(True)
    assert not default["applied"] and released["applied"]
    assert default["held_mib"] > 100, default  # the behaviour the setting exists for
    assert released["held_mib"] < 8, released


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "65536"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")])
def test_a_threshold_set_by_the_user_stands(monkeypatch, name, value):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv(name, value)
    assert host_memory.user_set_threshold() == name
    assert host_memory.return_freed_buffers_to_os() is False


def test_other_tunables_do_not_count_as_a_threshold(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert host_memory.user_set_threshold() is None
