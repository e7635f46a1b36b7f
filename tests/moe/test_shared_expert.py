"""Shared experts beside the routed ones (moe/shared.py): each gate by its formula, the parameters counted as
always active (accounting and --dry_run), the destination-ranks statistic, and the two recipes that use them."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moep_ds.config import load_config
from moep_ds.layers.ffn import FFNConfig
from moep_ds.models.accounting import meta_param_report
from moep_ds.moe.layer import MoEConfig, MoELayer, destination_ranks
from moep_ds.moe.shared import SharedExpertConfig
from moep_ds.routing.plan import RoutingPlan
from moep_ds.routing.topk import TopKConfig

D, E, H, HS = 8, 4, 12, 20
REPO_CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[2] / "configs"


def layer(gate: str | None, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    shared = None if gate is None else SharedExpertConfig(hidden_size=HS, gate=gate)
    cfg = MoEConfig(num_experts=E, expert=FFNConfig(type="swiglu", hidden_size=H),
                    router=TopKConfig(k=2, load_balancing_weight=0.0), shared_expert=shared)
    m = MoELayer(cfg, d_model=D).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.4)
    return m


def swiglu(ffn, x):
    return (F.silu(x @ ffn.w1.weight.t()) * (x @ ffn.w3.weight.t())) @ ffn.w2.weight.t()


@pytest.mark.parametrize("gate", ["none", "sigmoid", "residual_mix"])
def test_each_gate_by_its_formula(gate):
    m = layer(gate)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    routed = layer(None)  # same seed: the same router and experts
    with torch.no_grad():
        routed.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("shared.")})
    r = routed(x).y
    s = swiglu(m.shared.ffn, x)
    if gate == "none":
        want = r + s
    elif gate == "sigmoid":
        want = r + torch.sigmoid(x @ m.shared.gate.weight.t()) * s
    else:
        c = torch.softmax(x @ m.shared.gate.weight.t() + m.shared.gate.bias, -1)
        want = c[..., :1] * r + c[..., 1:] * s
    torch.testing.assert_close(m(x).y, want, rtol=1e-12, atol=1e-12)
    m(x).y.sum().backward()
    assert all(p.grad is not None for p in m.shared.parameters())


@pytest.mark.parametrize("gate,gate_params", [("none", 0), ("sigmoid", D), ("residual_mix", 2 * D + 2)])
def test_shared_expert_is_counted_as_active(gate, gate_params):
    shared = 3 * D * HS + gate_params
    assert layer(gate).num_active_params() == layer(None).num_active_params() + shared
    assert layer(None).num_active_params() == E * D + 2 * 3 * D * H  # router + k experts


def test_dry_run_counts_the_shared_experts(capsys):
    """deepseek_tiny by hand: per MoE layer the router (32 x 64), 4 routed and 1 shared expert of 3 x 64 x 32."""
    from moep_ds.cli.pretrain import main as pretrain_main

    assert pretrain_main(["--config", str(REPO_CONFIGS / "deepseek_tiny.yaml"), "--dry_run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = load_config(REPO_CONFIGS / "deepseek_tiny.yaml", ["model.layers[1].moe.shared_expert=null"])
    without = meta_param_report(cfg.model)
    expert = 3 * 64 * 32
    assert report["params_active"] - without.params_active == 2 * expert  # two MoE layers
    assert report["params_total"] - without.params_total == 2 * expert
    moe_active = 32 * 64 + 4 * expert + expert
    dense = meta_param_report(load_config(REPO_CONFIGS / "deepseek_tiny.yaml", ["model.layers[1].repeat=1"]).model)
    assert report["params_active"] - dense.params_active == moe_active + 4 * 64 * 64 + 2 * 64  # + attention, norms


def test_destination_ranks_against_a_naive_count():
    torch.manual_seed(0)
    T, E8, K = 12, 8, 3
    experts_TK = torch.stack([torch.randperm(E8)[:K] for _ in range(T)])
    order = torch.argsort(experts_TK.reshape(-1), stable=True)
    counts = torch.bincount(experts_TK.reshape(-1), minlength=E8)
    plan = RoutingPlan(order // K, torch.ones(T * K), counts, T)
    for per_rank in (1, 2, 4, 8):
        want = sum(len({int(e) // per_rank for e in row}) for row in experts_TK) / T
        assert float(destination_ranks(plan, per_rank)) == pytest.approx(want)


def test_recipes_state_what_their_comments_name():
    ds = load_config(REPO_CONFIGS / "deepseek_tiny.yaml").model.layers
    moe = [layer.moe for layer in ds if layer.type == "ffn_moe"][0]
    assert (moe.num_experts, moe.router.k, moe.router.score, moe.router.num_groups, moe.router.group_topk) == \
        (32, 4, "sigmoid", 4, 2)
    assert moe.router.renormalize and moe.router.scaling_factor == 2.5 and moe.router.bias_update_rate == 0.001
    assert moe.shared_expert.gate == "none" and moe.shared_expert.hidden_size == moe.expert.hidden_size
    qwen = load_config(REPO_CONFIGS / "qwen_moe_tiny.yaml").model.layers[0].moe
    assert (qwen.router.score, qwen.router.renormalize, qwen.router.load_balancing_scope) == ("softmax", False, "global")
    assert qwen.shared_expert.gate == "sigmoid" and qwen.shared_expert.hidden_size == 8 * qwen.expert.hidden_size


def test_model_directory_keeps_the_bias_and_the_shared_expert(tmp_path):
    """An exported model directory (moep-export, moep-eval) holds the selection bias and the shared expert: the
    loaded model routes and computes as the saved one."""
    import sys

    sys.path.insert(0, str(REPO_CONFIGS.parent / "tests" / "training"))
    import tiny

    from moep_ds.checkpointing.model_dir import load_model_dir, save_model_dir
    from moep_ds.config import config_from_dict
    from moep_ds.models.causal_lm import build_model

    cfg = config_from_dict(tiny.recipe("deepseek", tmp_path / "run"))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        model.blocks[1].moe.router.balancer.bias_E.copy_(torch.linspace(-0.5, 0.5, 8))
    save_model_dir(model, cfg, tmp_path / "export")
    loaded, _, _, _ = load_model_dir(tmp_path / "export")
    assert torch.equal(loaded.blocks[1].moe.router.balancer.bias_E, torch.linspace(-0.5, 0.5, 8))
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
