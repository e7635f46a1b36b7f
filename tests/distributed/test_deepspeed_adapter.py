"""DeepSpeed's internals are used in one module (distributed/deepspeed_adapter.py), each still where the adapter
says in the installed DeepSpeed; expert parallelism is explicit: no context variable carries it, no module changes
its class, and DeepSpeed's engine sees the routed stages as its MoE layers through one parameter-free view each."""
from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.models.plan import plan_for
from moep_ds.moe.dispatch import ExpertStage

PACKAGE = Path(__file__).resolve().parents[2] / "moep_ds"
ADAPTER = PACKAGE / "distributed" / "deepspeed_adapter.py"
# what only the adapter may touch: DeepSpeed's private group functions and the optimizer internals it lists
INTERNALS = re.compile(r"groups\._|_hp_mapping|_lazy_init_hp_params|_hp_optimizer_states_linked|"
                       r"fp32_partitioned_groups_flat|fp16_groups|fp32_groups|loss_scale_config|FP16_UnfusedOptimizer|"
                       r"runtime\.fp16")


def sources() -> dict[Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code) without comments and docstrings (which may name an internal to explain it)."""
    docs = {n for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for n in range(node.lineno, node.end_lineno + 1)}
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return [(i, line) for i, line in enumerate(lines, 1) if i not in docs]


def test_only_the_adapter_uses_deepspeed_internals():
    found = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
             for path, text in sources().items() if path != ADAPTER
             for i, line in code_lines(text) if INTERNALS.search(line)]
    assert not found, "\n".join(found)
    in_adapter = {m.group(0) for _, line in code_lines(ADAPTER.read_text()) for m in INTERNALS.finditer(line)}
    assert len(in_adapter) >= 8, in_adapter  # the pattern finds them where they are used


def test_no_context_variable_and_no_class_swapping_carry_expert_parallelism():
    class_swaps = [f"{path.relative_to(PACKAGE)}: {line.strip()}" for path, text in sources().items()
                   for line in text.splitlines() if re.search(r"\.__class__\s*=[^=]", line)]
    assert not class_swaps, class_swaps
    # deferred_init.py's flag (whether constructors draw initial values) is the one context variable left
    context_vars = [str(path.relative_to(PACKAGE)) for path, text in sources().items() if "ContextVar" in text]
    assert context_vars == ["deferred_init.py"], context_vars
    for name in ("_SHARD", "expert_shard", "held_experts", "ExpertLayout", "shard_of", "engine_view_class"):
        assert not [p for p, text in sources().items() if re.search(rf"\b{name}\b", text)], name


def test_every_internal_the_adapter_names_is_where_it_says_in_the_installed_deepspeed():
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils import groups

    assert deepspeed.__version__.startswith("0.19."), deepspeed.__version__  # setup.py: >=0.19,<0.20
    for name in ("_create_expert_and_data_parallel", "_get_expert_parallel_group_dict",
                 "_get_expert_parallel_group", "_get_expert_data_parallel_group"):
        assert callable(getattr(groups, name)), name
    configure = inspect.getsource(DeepSpeedEngine._configure_distributed_model)
    assert "isinstance(module, MoE)" in configure and "module.num_experts" in configure
    assert "set_deepspeed_parallelism" in configure
    assert "set_deepspeed_parallelism" in vars(MoE)
    unfused = inspect.getsource(FP16_UnfusedOptimizer.__init__)
    assert all(f"self.{a}" in unfused for a in ("fp16_groups", "fp32_groups", "loss_scale_config"))
    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        assert callable(getattr(cls, "_lazy_init_hp_params_optimizer_state")), cls
        assert "_hp_optimizer_states_linked" in inspect.getsource(cls)
    assert "self.fp32_partitioned_groups_flat" in inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    from deepspeed.utils.tensor_fragment import tensor_fragment

    assert {"hp_fragment", "lp_fragment_address"} <= {f.name for f in tensor_fragment.__dataclass_fields__.values()}
    assert callable(tensor_fragment.get_optim_state_fragment)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_deepspeed_sees_each_routed_stage_as_moe_without_a_class_change():
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import has_moe_layers, is_moe_param

    from moep_ds.distributed import deepspeed_adapter

    layers = [{"type": "ffn_moe", "attention": {"num_heads": 2},
               "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 8},
                       "router": {"type": "topk", "k": 2}}},
              {"type": "paths", "attention": {"num_heads": 2}, "d_path": 8, "num_paths": 2,
               "num_projection_experts": 2}]
    cfg = config_from_dict({"model": {"flavour": "llama", "vocab_size": 32, "d_model": 16, "max_seq_len": 8,
                                      "layers": layers}}).model
    plan = plan_for(cfg, size=2, rank=1)
    model = build_model(cfg, plan=plan)
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stages = [m for m in model.modules() if isinstance(m, ExpertStage)]
    # what setup_expert_parallel does beside giving each stage its all-to-all over the plan's group (which the
    # expert-parallel runs under torchrun test: tests/training/test_train_distributed.py)
    for stage in stages:
        deepspeed_adapter.show_as_moe(stage, stage.num_experts, plan.size)
    views = deepspeed_adapter.moe_views(model)
    assert len(views) == len(stages) == 4 and all(isinstance(v, MoE) for v in views)
    assert has_moe_layers(model) == (True, 4)
    assert [(v.num_experts, v.ep_size, v.num_local_experts, v.expert_group_name) for v in views] == [
        (4, 2, 2, "ep_size_2"), (2, 2, 1, "ep_size_2"), (2, 2, 1, "ep_size_2"), (2, 2, 1, "ep_size_2")]
    assert all(type(m) is classes[name] for name, m in model.named_modules() if name in classes)
    assert model.state_dict().keys() == state.keys()  # the views hold nothing
    experts = {id(p) for s in stages for p in s.experts.parameters()}
    assert all(is_moe_param(p) == (id(p) in experts) and getattr(p, "group_name", "ep_size_2") == "ep_size_2"
               for p in model.parameters())
    assert sum(is_moe_param(p) for p in model.parameters()) == len(experts) > 4
    with pytest.raises(RuntimeError, match="does not run"):
        views[0]()
