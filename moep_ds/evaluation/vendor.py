"""Copy the model code of moep_ds into an export directory as flat modules (no moep_ds install needed there).

Transformers' remote-code loader copies a modeling file and, recursively, the files it imports relatively,
but only flat ones (`from .name import x`, no sub-packages). So each module `moep_ds.a.b` becomes the file
`moep_ds_a_b.py` beside `modeling_moep.py`, with its `moep_ds` imports rewritten to relative imports, and a
generated `moep_ds_components.py` imports every copied module so the registries are filled as
`moep_ds.components` fills them.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the moep_ds package folder
# every module of these packages registers components or is model code
MODEL_PACKAGES = ("layers", "routing", "moe", "blocks", "models")
EXTRA_MODULES = ("moep_ds.schema", "moep_ds.registry", "moep_ds.errors")
# never copied: a model-code import of these at module level makes the export fail
NOT_MODEL_CODE = ("moep_ds.config", "moep_ds.data", "moep_ds.training", "moep_ds.evaluation", "moep_ds.cli")
COMPONENTS_MODULE = "moep_ds_components"


def flat_name(module: str) -> str:
    return module.replace(".", "_")


def module_file(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for f in (PACKAGE_DIR / rel.with_suffix(".py"), PACKAGE_DIR / rel / "__init__.py"):
        if module != "moep_ds" and f.is_file():
            return f
    return None


def is_vendored(module: str) -> bool:
    return module.startswith("moep_ds.") and not module.startswith(NOT_MODEL_CODE) and module_file(module) is not None


def model_modules() -> list[str]:
    """The modules to copy: every module of the model packages and what they import from moep_ds."""
    todo = [f"moep_ds.{pkg}.{f.stem}" for pkg in MODEL_PACKAGES for f in sorted((PACKAGE_DIR / pkg).glob("*.py"))
            if f.stem != "__init__"] + list(EXTRA_MODULES)
    seen: list[str] = []
    while todo:
        module = todo.pop(0)
        if module in seen:
            continue
        seen.append(module)
        for imported in imported_modules(ast.parse(module_file(module).read_text(encoding="utf-8"))):
            if is_vendored(imported):
                todo.append(imported)
    return seen


def imported_modules(tree: ast.Module) -> list[str]:
    """moep_ds modules an AST imports: `from moep_ds.a import b` names moep_ds.a, and moep_ds.a.b if b is a
    module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("moep_ds"):
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("moep_ds")]
    return out


def rewrite_imports(source: str, module: str) -> str:
    """`from moep_ds.a.b import X` -> `from .moep_ds_a_b import X`; `from moep_ds.a import mod` ->
    `from . import moep_ds_a_mod as mod`. Imports of non-model code are refused at module level."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    top_level = {id(n) for n in tree.body}
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("moep_ds") for a in node.names):
            raise ValueError(f"{module} line {node.lineno}: `import moep_ds...` cannot be vendored; "
                             "use `from moep_ds... import`")
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("moep_ds")):
            continue
        if not is_vendored(node.module):
            if id(node) in top_level:
                raise ValueError(f"{module} line {node.lineno}: model code imports {node.module} at module level")
            continue  # a lazy import of training/data code: left as is (needs moep_ds installed if reached)
        edits.append((node, replacement(node)))
    for node, text in sorted(edits, key=lambda e: -e[0].lineno):
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = lines[first][:node.col_offset]
        tail = lines[last][node.end_col_offset:]
        lines[first:last + 1] = [indent + text.replace("\n", "\n" + indent) + tail]
    return "".join(lines)


def replacement(node: ast.ImportFrom) -> str:
    modules, names = [], []
    for a in node.names:
        if module_file(f"{node.module}.{a.name}"):
            modules.append(f"from . import {flat_name(f'{node.module}.{a.name}')} as {a.asname or a.name}")
        else:
            names.append(a.name if a.asname is None else f"{a.name} as {a.asname}")
    out = [f"from .{flat_name(node.module)} import {', '.join(names)}"] if names else []
    return "\n".join(out + modules)


def vendor_model_code(out_dir: Path) -> list[str]:
    """Write the flat copies and the components module into `out_dir`; returns the file names written."""
    written = []
    modules = model_modules()
    for module in modules:
        text = rewrite_imports(module_file(module).read_text(encoding="utf-8"), module)
        header = f"# Copied from {module} by moep-export (imports made relative); edit the original, not this.\n"
        (out_dir / f"{flat_name(module)}.py").write_text(header + text, encoding="utf-8")
        written.append(f"{flat_name(module)}.py")
    # `from .x import *` (not `from . import x`): transformers follows only this form when copying files
    registrations = "".join(f"from .{flat_name(m)} import *  # noqa: F401,F403\n" for m in modules)
    (out_dir / f"{COMPONENTS_MODULE}.py").write_text(
        '"""Imports every copied moep_ds module, filling the registries (generated by moep-export)."""\n'
        + registrations + "\nREGISTERED = True\n", encoding="utf-8")
    return written + [f"{COMPONENTS_MODULE}.py"]
