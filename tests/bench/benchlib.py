"""Load bench/*.py scripts as modules, and run them as the README says (fresh interpreter, 1 thread)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], env=full_env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} {args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def table_rows(stdout: str) -> list[list[str]]:
    """Cells of the markdown table rows in `stdout` (header and separator excluded)."""
    rows = [line.strip("|").split("|") for line in stdout.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]
