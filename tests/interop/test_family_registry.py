"""The registry of Hugging Face families (moep_ds/interop/families/): every module there is registered and every
registered name is a module, each ADAPTER names its own model_type, an unknown model_type is one line naming what
is read, and no module outside families/ names a family (no caller tests a family: import, export and the recipe
of a source go through the adapters)."""
from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

import moep_ds
from moep_ds.errors import UserError
from moep_ds.interop import families as registry
from moep_ds.interop.adapter import Family
from moep_ds.interop.families import FAMILY_MODULES, families, family_of

PACKAGE = Path(moep_ds.__file__).parent
# string literals that equal a model_type but name something else: the recipe's flavours and init schemes
NOT_FAMILIES = {("models/config.py", "gpt2"), ("models/config.py", "llama"), ("models/config.py", "gemma"),
                ("models/config.py", "gpt_neox")}


def test_every_module_is_registered_under_its_own_model_type():
    modules = sorted(m.name for m in pkgutil.iter_modules(registry.__path__))
    assert sorted(FAMILY_MODULES) == modules
    assert len(set(FAMILY_MODULES)) == len(FAMILY_MODULES)
    adapters = families()
    assert list(adapters) == list(FAMILY_MODULES)  # model_type = module name, unique, in the export's order
    for name, adapter in adapters.items():
        assert isinstance(adapter, Family) and adapter.model_type == name


@pytest.mark.parametrize("hf", [{"model_type": "jamba"}, {}, {"model_type": ["llama"]}])
def test_an_unknown_model_type_is_one_line_naming_the_families(hf):
    with pytest.raises(UserError) as err:
        family_of(hf, "SRC")
    assert str(err.value) == (f"SRC: config.json has model_type {hf.get('model_type')!r}; moep-import reads "
                              f"{', '.join(sorted(FAMILY_MODULES))}")


def test_a_known_model_type_is_its_adapter():
    assert family_of({"model_type": "llama"}, "SRC").hf_class == "LlamaForCausalLM"
    assert family_of({"model_type": "deepseek_v2"}, "SRC").hf_class == "DeepseekV2ForCausalLM"


def string_literals(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, docstrings left out."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_no_module_outside_the_families_names_a_family():
    names = set(FAMILY_MODULES)
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        where = file.relative_to(PACKAGE).as_posix()
        if where.startswith("interop/families/"):
            continue
        for node in string_literals(ast.parse(file.read_text(encoding="utf-8"))):
            if node.value in names and (where, node.value) not in NOT_FAMILIES:
                found.append(f"{where}:{node.lineno} {node.value!r}")
    assert found == []


def test_the_check_sees_a_family_named_outside_the_families():
    """The scan above finds a literal in code and skips one in a docstring (it can fail)."""
    tree = ast.parse('"""gpt2 in a docstring"""\nKIND = "olmoe"\n')
    assert [n.value for n in string_literals(tree)] == ["olmoe"]
