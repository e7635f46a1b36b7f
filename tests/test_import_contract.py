"""The import contract (pyproject.toml [tool.importlinter], DESIGN.md §1): floors import only downward, no package
cycles, deepspeed only in distributed/, with no import ignored. Checked with import-linter's `lint-imports`, so that
the README's pytest command enforces it as CI does; and no import cycle between any two modules (an import inside a
function counts: it runs), nor any circle of modules once the imports for annotations (`if TYPE_CHECKING:`) count too:
a floor that names another's type depends on it as much as one that calls it."""
from __future__ import annotations

import ast
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



def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The moep_ds modules one module's `import` / `from ... import` statements name, wherever they stand (module
    level, `if TYPE_CHECKING:`, inside a function); a package stands for its __init__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def longest_known(dotted: str) -> None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                longest_known(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                longest_known(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found - {name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the moep_ds modules it imports, from the source of every module under `root` (moep_ds/)."""
    paths = {module_name(path): path for path in root.rglob("*.py")}
    return {name: imported_modules(name, path, set(paths)) for name, path in paths.items()}


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str | None]:
    """Every module `start` reaches, each with the module that first imported it on the way (a BFS tree)."""
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for module in queue:
        for imported in sorted(graph[module]):
            if imported not in parent:
                parent[imported] = module
                queue.append(imported)
    return parent


def circles(graph: dict[str, set[str]]) -> list[str]:
    """One line per strongly connected set of modules (more than one module): a shortest circle through its first
    module, `a -> b -> ... -> a`, and how many modules the set holds."""
    reach = {module: reachable(graph, module) for module in graph}
    seen: set[str] = set()
    found = []
    for module in sorted(graph):
        members = sorted(m for m in reach[module] if module in reach[m])
        if len(members) < 2 or module in seen:
            continue
        seen.update(members)
        back = min((m for m in members if module in graph[m]), key=lambda m: len(chain(reach[module], m)))
        path = chain(reach[module], back) + [module]
        found.append(f"{' -> '.join(path)} ({len(members)} modules in the circle: {', '.join(members)})")
    return found


def chain(parent: dict[str, str | None], end: str) -> list[str]:
    path = [end]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return path[::-1]


def test_no_circle_of_modules_with_every_import_counted():
    """Type-only and function-level imports included: the root recipe and training import each other no more."""
    graph = import_graph(REPO / "moep_ds")
    assert not circles(graph), "import circles:\n" + "\n".join(circles(graph))
    graph["moep_ds.models.config"].add("moep_ds.config")  # the check bites, and names the circle
    assert [line for line in circles(graph) if "-> moep_ds.models.config -> moep_ds.config ->" in line]


def test_the_root_recipe_imports_nothing_of_training():
    """config.py (the root recipe) reaches no module of training/, directly or through another floor, with every
    import counted; and reading a recipe with train.callbacks, which names callbacks of training/ and of a user's
    module, imports none of them: their type is resolved when the trainer is built."""
    graph = import_graph(REPO / "moep_ds")
    assert [m for m in reachable(graph, "moep_ds.config") if m.startswith("moep_ds.training")] == []
    code = ("import sys; from moep_ds.config import config_from_dict; "
            "cfg = config_from_dict({'model': {'vocab_size': 64, 'd_model': 32, 'max_seq_len': 16, 'layers': "
            "[{'type': 'dense', 'attention': {'num_heads': 2}}]}, 'train': {'callbacks': {'evals': "
            "{'type': 'downstream_eval', 'every': 5}, 'mine': {'type': 'no_such_module:Recorder'}, 'stop': None}}}); "
            "print(sorted(m for m in sys.modules if m.startswith('moep_ds.training')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
