"""The import contract (pyproject.toml [tool.importlinter], DESIGN.md §1): floors import only downward, no package
cycles, deepspeed only in training/ and distributed/. Checked with import-linter's `lint-imports`, so that the
README's pytest command enforces it as CI does."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the moep_ds package found under `root`, with the repository's contracts."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"  # the test extras'
    return subprocess.run([lint, "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts(tmp_path):
    proc = lint_imports(REPO, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def test_an_upward_import_a_cycle_and_a_stray_deepspeed_import_are_refused(tmp_path):
    """The contracts bite: a copy of the package with a model module importing the trainer (upward, and a cycle
    between models and training) and an MoE module importing deepspeed breaks all three."""
    copy = tmp_path / "src"
    shutil.copytree(REPO / "moep_ds", copy / "moep_ds", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "moep_ds" / "models" / "accounting.py", "a") as f:
        f.write("\n\ndef _upward():\n    from moep_ds.training import trainer  # noqa: F401\n")
    with open(copy / "moep_ds" / "moe" / "layer.py", "a") as f:
        f.write("\n\ndef _stray():\n    import deepspeed  # noqa: F401\n")
    proc = lint_imports(copy, tmp_path)
    assert proc.returncode != 0
    assert "Contracts: 0 kept, 3 broken." in proc.stdout, proc.stdout
    assert "moep_ds.models is not allowed to import moep_ds.training" in proc.stdout
    assert "moep_ds.moe.layer -> deepspeed" in proc.stdout
