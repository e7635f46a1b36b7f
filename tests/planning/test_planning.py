"""moep-plan's numbers against the model and by hand: parameters and FLOPs per token as --dry_run counts them, what a
rank holds under expert parallelism, memory per rank per ZeRO stage computed by hand for a tiny model, the traced
micro-batch against the same micro-batch run on the CPU, and the search (in-process, tiny models)."""
import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import ATTN, LAYERS, recipe  # noqa: E402

from moep_ds.cli.pretrain import dry_run  # noqa: E402
from moep_ds.config import config_from_dict, load_config  # noqa: E402
from moep_ds.errors import UserError  # noqa: E402
from moep_ds.models.causal_lm import build_model  # noqa: E402
from moep_ds.models.plan import plan_for  # noqa: E402
from moep_ds.moe.dispatch import ExpertStage  # noqa: E402
from moep_ds.planning.comm import link_bytes  # noqa: E402
from moep_ds.planning.hardware import GIB, assumptions, hardware  # noqa: E402
from moep_ds.planning.inventory import inventory  # noqa: E402
from moep_ds.planning.layout import Cluster, LayoutError, make_layout  # noqa: E402
from moep_ds.planning.plan import plan_run, recipe_global_batch, search  # noqa: E402
from moep_ds.planning.trace import trace_step  # noqa: E402
from moep_ds.schema import ConfigError  # noqa: E402
from moep_ds.training.ds_config import DeepSpeedConfigError  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DENSE = [{"type": "dense", "attention": ATTN}, {"type": "dense", "attention": {"num_heads": 4, "num_kv_heads": 2}}]
H100, ASSUMED = hardware("h100"), assumptions()


def tiny(layers, **train):
    if layers == "dense":
        raw = recipe("nova_moe", pathlib.Path("/nonexistent"), **train)
        raw["model"]["layers"] = DENSE
        return config_from_dict(raw)
    return config_from_dict(recipe(layers, pathlib.Path("/nonexistent"), **train))


@pytest.mark.parametrize("name", ["nova_moe", "msit_babylm", "pythia_1b_moep", "moe_stream"])
def test_parameters_and_flops_per_token_are_the_dry_runs(name, capsys):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert dry_run(cfg) == 0
    printed = json.loads(capsys.readouterr().out)
    assert inventory(cfg, 1).report.as_dict() == printed
    assert printed["flops_per_token"] > 6 * printed["params_active"] * 0.9  # a number, not a placeholder


@pytest.mark.parametrize("layers", ["nova_moe", "msit", "paths", "dense"])
def test_what_a_rank_holds_equals_the_model_it_builds(layers):
    cfg = tiny(layers)
    whole = build_model(cfg.model)
    inv = inventory(cfg, 1)
    assert inv.local_params == sum(p.numel() for p in whole.parameters()) == inv.report.params_total
    assert inv.expert_params == 0  # experts are ordinary parameters without expert parallelism
    if layers == "dense":
        return
    sharded = build_model(cfg.model, plan=plan_for(cfg.model, 2, rank=1))
    inv2 = inventory(cfg, 2)
    assert inv2.local_params == sum(p.numel() for p in sharded.parameters()) < inv.local_params
    experts = sum(p.numel() for m in sharded.modules() if isinstance(m, ExpertStage) for p in m.experts.parameters())
    assert inv2.expert_params == experts > 0
    assert {g.name for g in inv2.groups} >= {"decay", "decay_experts"}


def hand_counts(cfg):
    """(N, decay, no-decay) of the tiny dense model by its shapes: d 32, vocabulary 512 tied, 2 blocks of RMSNorm x2,
    qkv, output projection, SwiGLU."""
    d, v = 32, 512
    model = build_model(cfg.model)
    hidden = model.blocks[0].ffn.w1.weight.shape[0]
    qkv = [(4 + 2 * 4) * 8 * d, (4 + 2 * 2) * 8 * d]  # heads 4 (MHA), then 4 with 2 kv heads, head dim 8
    matrices = sum(q + d * d + 3 * d * hidden for q in qkv)
    norms = 2 * 2 * d + d  # two per block, the final one
    return v * d + matrices + norms, matrices, v * d + norms


def plan_tiny(stage, precision="bf16", gpus=4, **zero):
    cfg = tiny("dense", global_batch_size=4 * gpus)
    ds = {"zero_optimization": {"stage": stage, **zero}}
    if precision != "fp32":
        ds[precision] = {"enabled": True}
    return cfg, plan_run(cfg, ds, Cluster(gpus, gpus), H100, ASSUMED)


def pad(n, multiple):
    return -(-n // multiple) * multiple


def items(run):
    return {i.name: i.bytes for i in run.memory.items}


def test_memory_by_hand_zero0_bf16():
    cfg, run = plan_tiny(0)
    N, _, _ = hand_counts(cfg)
    got = items(run)
    assert got["parameters (bf16)"] == 2 * N and got["fp32 master weights"] == 4 * N
    assert got["Adam moments (fp32)"] == 8 * N and got["fp32 gradients of the masters"] == 4 * N
    assert got["gradients kept after backward"] == 2 * N and got["gradient all-reduce bucket"] == 2 * N
    static = 2 * N + 4 * N + 8 * N
    # backward; the reduction: kept gradients and their flat copy; the step: kept gradients and fp32 master gradients
    assert run.memory.peak == static + max(got["activations and gradients kept in backward"], 2 * N + 2 * N,
                                           2 * N + 4 * N)


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_by_hand_zero1_and_zero2_bf16(stage):
    cfg, run = plan_tiny(stage, contiguous_gradients=False)  # the shipped JSONs' "auto" at expert parallelism 1
    N, decay, keep = hand_counts(cfg)
    flat = pad(decay, 2 * 4) + pad(keep, 2 * 4)  # each group padded to 2 x data parallel
    part = flat // 4
    got = items(run)
    assert got["parameters (bf16, flat groups)"] == 2 * flat
    assert got["fp32 master partition"] == 4 * part and got["Adam moments (fp32, partition)"] == 8 * part
    assert got["fp32 gradients of the partition"] == 4 * part
    # ZeRO-1 keeps every gradient; ZeRO-2 without contiguous gradients keeps them until 5e8 are pending, then
    # all-reduces a flat copy of them
    assert got["gradients kept after backward"] == 2 * N and got["gradient all-reduce bucket"] == 2 * N
    static = 2 * flat + 12 * part
    assert run.memory.peak == static + max(got["activations and gradients kept in backward"], 2 * N + 2 * N,
                                           2 * N + 4 * part)


def test_memory_by_hand_zero2_contiguous_gradients():
    cfg, run = plan_tiny(2, contiguous_gradients=True, reduce_bucket_size=1000)
    N, decay, keep = hand_counts(cfg)
    part = (pad(decay, 8) + pad(keep, 8)) // 4
    got = items(run)
    assert got["gradient partition (bf16)"] == 2 * part and got["reduce bucket (contiguous gradients)"] == 2 * 1000
    assert got["gradients kept after backward"] == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_go_to_their_owner_only_without_multi_rank_bucket_allreduce(stage):
    """DeepSpeed 0.19 reads `use_multi_rank_bucket_allreduce` on its contiguous, reduce-scattered path only
    (stage_1_and_2.py average_tensor): false reduces each slice to the rank that owns it, the same size as the
    all-reduce but half its bytes on the links; without contiguous gradients every gradient is all-reduced anyway
    (counted against real runs: tests/planning/test_plan_comm.py)."""
    base = plan_tiny(stage, contiguous_gradients=True)[1]
    owner = plan_tiny(stage, contiguous_gradients=True, use_multi_rank_bucket_allreduce=False)[1]
    grads = [c for c in base.comm.collectives if c.what == "gradients"]
    to_owner = [c for c in owner.comm.collectives if c.what == "gradients"]
    assert [c.kind for c in grads] == ["all_reduce"] and [c.kind for c in to_owner] == ["reduce"]
    assert to_owner[0].total == grads[0].total > 0
    assert link_bytes(to_owner[0], owner.layout).intra == link_bytes(grads[0], base.layout).intra / 2
    fallback = plan_tiny(stage, contiguous_gradients=False, use_multi_rank_bucket_allreduce=False)[1]
    assert [c.kind for c in fallback.comm.collectives if c.what == "gradients"] == ["all_reduce"]


def test_memory_by_hand_zero3_fp32():
    cfg, run = plan_tiny(3, precision="fp32", stage3_param_persistence_threshold=1000)
    model = build_model(cfg.model)
    numels = [p.numel() for p in model.parameters()]
    part = sum(-(-n // 4) for n in numels)
    persistent = sum(n for n in numels if n < 1000)
    got = items(run)
    assert got["parameter partitions (fp32)"] == 4 * part and got["persistent parameters (whole)"] == 4 * persistent
    assert got["fp32 master partition"] == 4 * part and got["Adam moments (fp32, partition)"] == 8 * part
    assert got["gradient partition (fp32)"] == 4 * part
    # 2 x (parameters after any module) is far below stage3_max_reuse_distance: all stay gathered until backward
    assert got["gathered parameters (ZeRO-3)"] == 4 * (sum(numels) - persistent)
    assert got["reduce bucket"] == 4 * 500_000_000 and got["reduce-scatter input"] == 4 * sum(numels)
    static = 4 * (part + persistent + part + 2 * part + part + 500_000_000)
    gathered = got["gathered parameters (ZeRO-3)"]
    assert run.memory.peak == static + max(got["activations and gradients kept in backward"] + gathered,
                                           gathered + 4 * sum(numels), 4 * part)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_traced_micro_batch_equals_the_cpu_run_of_a_dense_model(checkpointing):
    """Same model, same kernels (fused attention on the CPU as modelled on meta): the same bytes saved by forward
    and the same peak over forward and backward, to the byte."""
    cfg = tiny("dense")
    meta = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.bfloat16, checkpointing=checkpointing)
    cpu = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.bfloat16, checkpointing=checkpointing,
                     device="cpu")
    assert (meta.saved, meta.peak) == (cpu.saved, cpu.peak)
    assert set(meta.saved_by) == set(cpu.saved_by)


@pytest.mark.parametrize("layers", ["nova_moe", "top2", "msit", "ssm_moe", "paths"])
def test_traced_routed_blocks_are_within_8_percent_of_the_cpu_run(layers):
    """The CPU picks other expert kernels (a loop with a hand-written backward) and windowed attention kernels than
    the accelerator path traced on meta, and routes by its weights instead of the expected loads."""
    cfg = tiny(layers)
    meta = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.float32, checkpointing=False)
    cpu = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.float32, checkpointing=False, device="cpu")
    assert meta.saved == pytest.approx(cpu.saved, rel=0.08) and meta.peak == pytest.approx(cpu.peak, rel=0.08)
    assert meta.saved > 0.5 * meta.peak


def test_checkpointing_keeps_block_inputs_only():
    cfg = tiny("top2")
    off = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.bfloat16, checkpointing=False)
    on = trace_step(cfg.model, micro_batch=4, seq_len=32, dtype=torch.bfloat16, checkpointing=True)
    assert on.saved < off.saved and on.saved_by.get("ffn_moe.moe", 0) < 100  # a routing statistic, not activations
    assert [(r.num_experts, r.assignments) for r in on.routed] == [(4, 4 * 32 * 2)]  # top-2: T x k assignments


def test_layouts_that_cannot_exist_are_one_line_errors():
    cfg = tiny("nova_moe")
    with pytest.raises(LayoutError, match=r"^--gpus_per_node \(8\) must be <= --gpus \(4\)$"):
        Cluster(4, 8)
    with pytest.raises(LayoutError, match=r"^--gpus \(12\) must be a multiple of --gpus_per_node \(8\)$"):
        Cluster(12, 8)
    three = config_from_dict(recipe("nova_moe", pathlib.Path("/nonexistent")))
    three.train.expert_parallel_size = 3
    with pytest.raises(ConfigError, match=r"^model\.layers\[1\]\.moe\.num_experts \(4\) must be divisible by "
                                          r"expert_parallel_size \(3\)$"):
        make_layout(three, {}, Cluster(6, 6))
    cfg.train.expert_parallel_size = 2
    with pytest.raises(UserError, match=r"^train\.expert_parallel_size \(2\) > 1 is not supported with ZeRO stage 3"):
        make_layout(cfg, {"zero_optimization": {"stage": 3}}, Cluster(4, 4))
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size \(6\)"):
        make_layout(cfg, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, Cluster(4, 4))


def test_a_layout_that_does_not_fit_says_by_how_much_and_its_largest_item():
    cfg = tiny("dense")
    run = plan_run(cfg, {"zero_optimization": {"stage": 2, "contiguous_gradients": True}}, Cluster(2, 2),
                   hardware("h100", ["memory_gib=3.5"]), ASSUMED)
    assert not run.fits
    over = (run.memory.peak - 1.5 * GIB) / GIB
    assert run.shortfall() == (
        f"does not fit: {run.memory.peak / GIB:.1f} GiB per rank, {over:.1f} GiB over the 2 GiB usable of h100 "
        "(3.5 GiB less 2 reserved); largest item: reduce bucket (contiguous gradients) (1.9 GiB)")


def test_search_lists_every_layout_training_accepts_fastest_first():
    cfg = tiny("nova_moe", global_batch_size=16)
    ds = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    cluster = Cluster(4, 2)
    runs = search(cfg, ds, cluster, H100, ASSUMED, recipe_global_batch(cfg, ds, cluster))
    layouts = {(r.layout.expert_parallel, r.layout.zero_stage, r.layout.micro_batch, r.layout.activation_checkpointing)
               for r in runs}
    # 4 experts: expert parallel 1, 2, 4; ZeRO-3 and ZeRO-0 in bf16 only without it; micro-batch divides 16 / 4
    expected = {(ep, z, mb, ck) for ep in (1, 2, 4) for z in (0, 1, 2, 3) for mb in (1, 2, 4) for ck in (False, True)
                if ep == 1 or z in (1, 2)}
    assert layouts == expected
    assert all(r.layout.global_batch == 16 for r in runs)
    times = [r.time.step_s for r in runs]
    assert times == sorted(times)
    assert {r.comm.by_kind().get("all_to_all", 0) > 0 for r in runs} == {True, False}
