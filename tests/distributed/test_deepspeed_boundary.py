"""DeepSpeed is reached through distributed/ only (DESIGN.md §1): the AST of every other module of moep_ds is walked
and fails on
  - an import of deepspeed (any form, also inside a function, also importlib.import_module("deepspeed..."));
  - an attribute of an engine object (an expression whose name holds "engine") that distributed/engine.py's
    `Engine` does not offer;
  - an attribute that DeepSpeed's engine or optimizers (ZeRO 1/2/3, bf16, fp16) define, read from the installed
    DeepSpeed's own source, unless torch's Module, Optimizer or Tensor, `Engine`, or moep_ds's own code outside
    distributed/ defines that name too.
No list of known names: the forbidden ones come from DeepSpeed's classes, the allowed ones from `Engine`."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "moep_ds"


def outside_distributed() -> dict[Path, str]:
    return {p: p.read_text() for p in PACKAGE.rglob("*.py") if "distributed" not in p.relative_to(PACKAGE).parts}


def class_names(cls: type) -> set[str]:
    """Methods and `self.X =` attributes of `cls` and its bases outside torch, from their source."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


@functools.cache
def engine_api() -> frozenset[str]:
    from moep_ds.distributed.engine import Engine

    return frozenset(n for n in class_names(Engine) if not n.startswith("_"))


def defined_by(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, arguments, keywords, stored attributes, annotated fields,
    command-line options."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
            names.add(node.value[2:].replace("-", "_"))
    return names


@functools.cache
def deepspeed_only() -> frozenset[str]:
    """Attributes DeepSpeed's engine and optimizers define that nothing else moep_ds uses defines."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    names = set().union(*(class_names(c) for c in (DeepSpeedEngine, DeepSpeedZeroOptimizer, BF16_Optimizer,
                                                     DeepSpeedZeroOptimizer_Stage3, FP16_UnfusedOptimizer,
                                                     FP16_Optimizer)))
    generic = (set(dir(torch.nn.Module)) | set(vars(torch.nn.Module())) | set(dir(torch.optim.Optimizer))
               | set(dir(torch.Tensor)) | set(dir(object)))
    ours = set().union(*(defined_by(ast.parse(text)) for text in outside_distributed().values()))
    return frozenset(names - generic - engine_api() - ours)


def terminal_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def violations(text: str, where: str = "<module>") -> list[str]:
    tree = ast.parse(text)
    found = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" for a in node.names):
            found.append(f"{line}: imports deepspeed")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            found.append(f"{line}: imports from {node.module}")
        elif (isinstance(node, ast.Call) and terminal_name(node.func) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("deepspeed")):
            found.append(f"{line}: imports {node.args[0].value}")
        elif isinstance(node, ast.Attribute):
            owner = terminal_name(node.value)
            if owner and "engine" in owner.lower() and node.attr not in engine_api():
                found.append(f"{line}: {owner}.{node.attr} is no attribute of distributed.engine.Engine")
            elif node.attr in deepspeed_only():
                found.append(f"{line}: .{node.attr} is DeepSpeed's engine or optimizer internals")
        elif (isinstance(node, ast.Call) and terminal_name(node.func) in ("getattr", "setattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value) in deepspeed_only()):
            found.append(f"{line}: {terminal_name(node.func)}(..., {node.args[1].value!r}) is DeepSpeed's")
    return found


def test_no_module_outside_distributed_imports_deepspeed_or_touches_its_engine():
    found = [v for path, text in outside_distributed().items()
             for v in violations(text, str(path.relative_to(PACKAGE)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("code, why", [
    ("import deepspeed", "imports deepspeed"),
    ("def f():\n    from deepspeed.utils import groups", "imports from deepspeed.utils"),
    ("import importlib\nimportlib.import_module('deepspeed.moe')", "imports deepspeed.moe"),
    ("def f(engine):\n    engine.global_steps = 3", "engine.global_steps is no attribute"),
    ("def f(self):\n    return self.engine.get_global_grad_norm()", "engine.get_global_grad_norm is no attribute"),
    ("def f(opt):\n    return opt.single_partition_of_fp32_groups[0]", ".single_partition_of_fp32_groups is DeepSpeed's"),
    ("def f(opt):\n    return getattr(opt, 'fp32_partitioned_groups_flat', None)", "'fp32_partitioned_groups_flat')"),
])
def test_the_check_bites(code, why):
    found = violations(code)
    assert found and why in found[0], found


def test_what_the_engine_offers_is_allowed():
    assert not violations("def f(self):\n    self.engine.backward(x)\n    return self.module.engine.lr()")
    assert {"backward", "step", "lr", "grad_norm", "state_dict", "write_events"} <= engine_api()
    assert {"global_steps", "clip_fp32_gradients", "get_global_grad_norm", "get_lr"} <= deepspeed_only()
