"""The import contract (pyproject.toml [tool.importlinter], DESIGN.md §1): floors import only downward, no package
cycles, deepspeed only in distributed/, with no import ignored. Checked with import-linter's `lint-imports`, so that
the README's pytest command enforces it as CI does; and no import cycle between any two modules (an import inside a
function counts: it runs)."""
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


def test_no_contract_ignores_an_import():
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert [c["id"] for c in contracts] == ["floors", "no-cycles", "deepspeed"]
    assert not [c["id"] for c in contracts if c.get("ignore_imports")]


def module_cycles(graph) -> list[tuple[str, str]]:
    """(a, b) for every import a -> b of moep_ds modules where b also reaches a."""
    return sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                   if b.startswith("moep_ds.") and b != a and graph.chain_exists(importer=b, imported=a)})


def test_no_two_modules_import_each_other_at_module_or_function_level():
    import grimp

    graph = grimp.build_graph("moep_ds", exclude_type_checking_imports=True)
    assert module_cycles(graph) == []
    graph.add_import(importer="moep_ds.models.config", imported="moep_ds.config")  # the check bites
    assert ("moep_ds.config", "moep_ds.models.config") in module_cycles(graph)

