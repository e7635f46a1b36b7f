"""moep-plan's overlapped expert all-to-all (train.expert_comm.overlap_chunks, issue #44): the two-stream program of
planning/timing.py against the schedule worked by hand, the search over the all-to-all's options, H800, and the
real recipes' numbers: OLMoE-1B-7B on 64 H100s at expert parallel 8, DeepSeek-V3 671B on H800s."""
import dataclasses
import json
import math
import pathlib
import re

import pytest
import yaml

from moep_ds.cli.pretrain import dry_run
from moep_ds.config import config_from_dict, load_config
from moep_ds.interop.families import family_of
from moep_ds.planning.comm import Collective, CommPlan
from moep_ds.planning.hardware import assumptions, hardware
from moep_ds.planning.layout import Cluster
from moep_ds.planning.plan import candidate_layouts, plan_layout, plan_run
from moep_ds.planning.timing import (backward_program, comm_seconds, exposed_pass, forward_program,
                                     node_forward_program, reversed_program, seconds_of)
from moep_ds.training.ds_config import read_ds_config

REPO = pathlib.Path(__file__).resolve().parents[2]
OLMOE, DSV3 = REPO / "configs" / "olmoe_1b_7b.yaml", REPO / "configs" / "deepseek_v3_671b.yaml"
ZERO2 = read_ds_config(str(REPO / "ds_configs" / "zero2_bf16.json"))
ZERO2_OVERLAP = read_ds_config(str(REPO / "ds_configs" / "zero2_bf16_overlap.json"))  # the DeepSeek-V3 recipe's
PUBLISHED_GPU_HOURS = 2.664e6  # DeepSeek-V3's pre-training on H800s (its report, table 1)


def share(run):
    return run.time.exposed_comm_s / run.time.step_s


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
def test_compute_bound_chunks_expose_the_first_dispatch_less_the_shared_expert_and_the_last_combine(chunks):
    a, b, e = 1.0, 1.5, 3.0  # per chunk: dispatch + combine shorter than the experts' compute
    for h, first in ((0.0, 1.0), (0.4, 0.6), (2.0, 0.0)):
        assert exposed_pass(forward_program(a, b, e, h, chunks, False)) == pytest.approx(first + b)
    # backward: the first combine gradient, and the last dispatch gradient less the shared expert's backward
    assert exposed_pass(backward_program(b, a, 2 * e, 0.0, chunks, False)) == pytest.approx(b + a)
    assert exposed_pass(backward_program(b, a, 2 * e, 0.6, chunks, False)) == pytest.approx(b + a - 0.6)


def test_communication_bound_chunks_expose_the_difference_by_hand():
    # C = 3, a = b = 2, e = 1, no shared expert: D1 0-2, D2 2-4, E1 2-3, C1 4-6, D3 6-8, E2 4-5, C2 8-10, E3 8-9,
    # C3 10-12: span 12, compute 3
    assert exposed_pass(forward_program(2.0, 2.0, 1.0, 0.0, 3, False)) == pytest.approx(9.0)
    # every all-to-all waits for the compute issued before it: D2 starts after the shared expert (0-3)
    # D1 0-1, S 0-3, D2 3-4, E1 3-4, C1 4-5, E2 4-5, C2 5-6: span 6, compute 5
    assert exposed_pass(forward_program(1.0, 1.0, 1.0, 3.0, 2, False)) == pytest.approx(1.0)


def test_backward_is_the_forward_reversed():
    for chunks in (1, 2, 3, 4):
        for h in (0.0, 0.7):
            assert reversed_program(forward_program(1.0, 1.5, 3.0, h, chunks), {"C": 0.3, "D": 0.4}) == \
                backward_program(0.3, 0.4, 6.0, 2 * h, chunks)
    assert reversed_program(forward_program(1.0, 1.5, 3.0, 2.0, 1, True), {"C": 0.3, "D": 0.4}) == \
        backward_program(0.3, 0.4, 6.0, 4.0, 1, True)


def test_node_aware_dispatch_in_one_chunk_is_blocking():
    # both hops after the shared expert, one after the other (a and b: their sum), forward and backward
    assert exposed_pass(forward_program(1.0, 1.5, 3.0, 2.0, 1, True)) == pytest.approx(2.5)
    assert exposed_pass(backward_program(1.5, 1.0, 6.0, 4.0, 1, True)) == pytest.approx(2.5)


@pytest.mark.parametrize("chunks", [2, 3, 4, 8])
def test_compute_bound_node_aware_chunks_expose_the_first_dispatch_and_the_last_combines_by_hand(chunks):
    # per chunk: a 1 between nodes, f 0.5 inside the node, b 0.7 back inside, c 1.5 back between nodes (a step's
    # 3.7 within the experts' 4); n 0.1 the counts inside the node; h 0.5 the shared expert. N 0-0.1, D1 0.1-1.1,
    # D2 1.1-2.1 (S 0-0.5), F1 2.1-2.6, E1 from 2.6; after the last experts B(C), C(C-1), C(C): 2.1 + 3.7 exposed
    forward = node_forward_program(1.0, 0.5, 0.7, 1.5, 0.1, 4.0, 0.5, chunks)
    assert exposed_pass(forward) == pytest.approx((0.1 + 2 * 1.0 + 0.5 - 0.5) + (0.7 + 2 * 1.5))
    # backward, gradients c 1.2, b 0.6, f 0.4, a 0.9, compute doubled: gC(C), gC(C-1), gB(C) before the first
    # experts' backward; after the last gF1, gD2, gD1 (the shared expert's backward, 1.0, beside the last two)
    backward = reversed_program(forward, {"D": 0.9, "F": 0.4, "B": 0.6, "C": 1.2})
    assert exposed_pass(backward) == pytest.approx((2 * 1.2 + 0.6) + (0.4 + 2 * 0.9 - 1.0))


def test_communication_bound_node_aware_chunks_expose_the_difference_by_hand():
    # C = 2, a = 2, f = 1, b = 1, c = 2, e = 1, no shared expert nor counts: D1 0-2, D2 2-4, F1 4-5, F2 5-6, E1 5-6,
    # B1 6-7, E2 6-7, B2 7-8, C1 8-10, C2 10-12: span 12, compute 2
    assert exposed_pass(node_forward_program(2.0, 1.0, 1.0, 2.0, 0.0, 1.0, 0.0, 2)) == pytest.approx(10.0)


def test_h800_is_an_h100_with_deepseeks_links():
    h800, h100 = hardware("H800"), hardware("h100")
    assert (h800.bf16_tflops, h800.hbm_gbps, h800.memory_gib) == (h100.bf16_tflops, h100.hbm_gbps, h100.memory_gib)
    assert (h800.intra_node_gbps, h800.inter_node_gbps) == (200, 50)  # NVLink 400 GB/s both ways, IB 50 GB/s


def olmoe_plan(*overrides):
    return plan_run(load_config(OLMOE, list(overrides)), ZERO2, Cluster(64, 8), hardware("h100"), assumptions())


def test_olmoe_at_expert_parallel_8_exposes_less_communication_with_the_schedule():
    """The recipe's layout (expert parallel 8, ZeRO-2, 4 x 4 micro-batches, checkpointing): 31.2% of the step
    exposed with the dispatch blocking (before the schedule every all-to-all was exposed: the same 31.2%), 25.4% at
    the default 2 chunks, 22.1% at 4; its ZeRO-2 gradient reduction per micro-batch is most of the rest."""
    blocking = olmoe_plan("train.expert_comm.overlap_chunks=1")
    two, four = olmoe_plan(), olmoe_plan("train.expert_comm.overlap_chunks=4")
    assert two.layout.expert_overlap_chunks == 2 and two.layout.expert_parallel == 8
    assert share(blocking) == pytest.approx(0.312, abs=0.002)
    assert share(two) == pytest.approx(0.254, abs=0.002)
    assert share(four) == pytest.approx(0.221, abs=0.002)
    assert blocking.time.comm_s == pytest.approx(two.time.comm_s)  # the same bytes, less of them exposed
    assert blocking.time.compute_s == two.time.compute_s


def olmoe_ep8_search() -> list:
    """The search's candidates at expert parallel 8 that fit, planned and ranked as `search` ranks them (only the
    expert-parallel-8 candidates are planned: the same ranking at a fraction of the whole search's time)."""
    cfg, runs, memory = load_config(OLMOE), [], {}
    for layout in candidate_layouts(cfg, ZERO2, Cluster(64, 8), 1024):
        if layout.expert_parallel == 8:
            key = dataclasses.replace(layout, expert_overlap_chunks=1)
            runs.append(plan_layout(cfg, layout, hardware("h100"), assumptions(), memory.get(key)))
            memory[key] = runs[-1].memory
    return sorted((r for r in runs if r.fits), key=lambda r: (r.time.step_s, r.memory.peak))


def test_olmoe_search_at_expert_parallel_8_picks_the_options_that_expose_least():
    """The fastest layout at expert parallel 8: ZeRO-1 (its reduction once a step) with overlap_comm (that reduction
    during the last micro-batch's backward), no checkpointing, once per rank, FP8 dispatch, 4 chunks: 10.0% of the
    step exposed (9.9985%; the all-to-all 4.0%, the expert parameters' all-gather after the step 2.8%, the half of the
    expert gradients' all-reduce not hidden 2.8%). Without overlap_comm the same layout exposes 12.6%."""
    runs = olmoe_ep8_search()
    best = runs[0].layout
    assert (best.zero_stage, best.overlap_comm, best.micro_batch, best.activation_checkpointing, best.expert_dedup,
            best.expert_fp8_dispatch, best.expert_overlap_chunks) == (1, True, 4, False, True, True, 4)
    assert share(runs[0]) <= 0.10 and share(runs[0]) == pytest.approx(0.09998, abs=0.0001)
    blocking_reduction = [r for r in runs if not r.layout.overlap_comm]
    assert blocking_reduction[0].layout == dataclasses.replace(best, overlap_comm=False)
    assert share(blocking_reduction[0]) == pytest.approx(0.126, abs=0.002)
    blocking = [r for r in runs if r.layout.expert_overlap_chunks == 1]  # the all-to-all in one chunk: 19.6%
    assert share(blocking[0]) == pytest.approx(0.196, abs=0.002)


# the layout configs/olmoe_1b_7b.yaml's header plans at expert parallel 8 on 64 H100s (the search's fastest there)
OLMOE_EP8 = ["train.expert_parallel_size=8", "train.activation_checkpointing=false",
             "train.expert_comm.fp8_dispatch=true", "train.expert_comm.overlap_chunks=4"]
ZERO1_OVERLAP = REPO / "ds_configs" / "zero1_bf16_overlap.json"


def test_olmoe_at_expert_parallel_8_exposes_at_most_a_tenth_of_its_step():
    """The issue's goal, default assumptions: the header's layout of configs/olmoe_1b_7b.yaml (its command, with
    ds_configs/zero1_bf16_overlap.json) exposes at most 10% of its step as communication (9.9985%), and fits."""
    header = re.sub(r" \\\n#\s+", " ", OLMOE.read_text().split("\nmodel:")[0])  # commands on one line
    assert f"--ds_config ds_configs/{ZERO1_OVERLAP.name} --gpus 64 --set {' '.join(OLMOE_EP8)}" in header
    run = plan_run(load_config(OLMOE, OLMOE_EP8), read_ds_config(str(ZERO1_OVERLAP)), Cluster(64, 8),
                   hardware("h100"), assumptions())
    assert run.fits and run.layout.zero_stage == 1 and run.layout.overlap_comm
    assert share(run) <= 0.10
    assert "9.9985%" in header and share(run) == pytest.approx(0.099985, abs=5e-6)


def test_zero1_reduction_under_overlap_comm_is_overlappable_with_the_same_bytes():
    """ZeRO-1 with overlap_comm reduces its gradients in the backward of the step's last micro-batch (DeepSpeed's
    hooks, tests/training/test_overlap_comm.py): the same collectives and bytes, the reductions counted
    overlappable, `overlap` of them hidden; the second reduce bucket in memory."""
    plain = plan_run(load_config(OLMOE, OLMOE_EP8), read_ds_config(str(REPO / "ds_configs" / "zero1_bf16.json")),
                     Cluster(64, 8), hardware("h100"), assumptions())
    overlapped = plan_run(load_config(OLMOE, OLMOE_EP8), read_ds_config(str(ZERO1_OVERLAP)), Cluster(64, 8),
                          hardware("h100"), assumptions())
    assert overlapped.comm.by_kind_and_group() == plain.comm.by_kind_and_group()
    changed = {c.what for c, d in zip(plain.comm.collectives, overlapped.comm.collectives) if c != d}
    assert changed == {"gradients", "expert gradients"}
    reductions = [c for c in overlapped.comm.collectives if c.what in changed]
    assert all(c.overlappable and c.window == "last backward" and c.calls == 1 for c in reductions)
    hidden = sum(seconds_of(c, overlapped.layout, hardware("h100"), assumptions()) for c in reductions) / 2
    assert plain.time.exposed_comm_s - overlapped.time.exposed_comm_s == pytest.approx(hidden)
    assert overlapped.memory.peak - plain.memory.peak == 2 * 500_000_000  # one more bf16 reduce bucket


def test_zero1_reduction_hides_at_most_behind_the_last_backward():
    """What `overlap` would hide of the reductions in the last micro-batch's backward is capped by that backward."""
    layout = olmoe_plan(*OLMOE_EP8).layout
    reduction = Collective("expert gradients", "all_reduce", 2**30, 8, 1, True, "expert_data", window="last backward")
    seconds = seconds_of(reduction, layout, hardware("h100"), assumptions())
    assert comm_seconds(CommPlan((reduction,)), layout, hardware("h100"), assumptions()) == (seconds, seconds / 2)
    capped = comm_seconds(CommPlan((reduction,)), layout, hardware("h100"), assumptions(), (), seconds / 10)
    assert capped == (seconds, pytest.approx(0.9 * seconds))


DSV3_CONFIG_JSON = {  # deepseek-ai/DeepSeek-V3 config.json, the keys the recipe reads
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False}


def test_deepseek_v3_recipe_is_its_config_json_at_671b_and_37b_active(capsys):
    cfg = load_config(DSV3)
    raw = yaml.safe_load(DSV3.read_text())
    imported = config_from_dict({**raw, "model": family_of(DSV3_CONFIG_JSON, "DeepSeek-V3").recipe(DSV3_CONFIG_JSON)})
    assert cfg.model == imported.model
    assert dry_run(cfg) == 0
    counts = json.loads(capsys.readouterr().out)
    assert round(counts["params_total"] / 1e9) == 671 and round(counts["params_active"] / 1e9, 1) == 37.6
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    assert (cfg.train.global_batch_size, cfg.data.seq_len) == (15360, 4096)
    assert cfg.train.max_steps == math.ceil(14.8e12 / tokens)


def dsv3_plan(*overrides):
    cfg = load_config(DSV3, list(overrides))
    return plan_run(cfg, ZERO2_OVERLAP, Cluster(1920, 8), hardware("h800"), assumptions())


def test_deepseek_v3_on_h800s_against_the_published_gpu_hours():
    """15,360 sequences on 1,920 H800s (2,048 cannot divide them, every rank being data-parallel): the recipe's
    layout (expert parallel 64 over 8 nodes, node-aware in 4 chunks, ZeRO-2 with overlap_comm) fits and needs 1.98x the
    published 2.664M GPU-hours (2.11x with the other 128 GPUs of 2,048 counted; 2.27x without overlap_comm); in one
    chunk and bf16, 2.68x. The issue's goal was 1.4x: the compute alone, at the assumed 45% of the bf16 peak with
    checkpointing's recomputation, is 1.30x (DeepSeek: FP8 GEMMs); the all-to-all over InfiniBand is longer than the
    experts' compute that hides it (DeepSeek: DualPipe's pipeline parallelism hides it behind another micro-batch's
    whole layer)."""
    run = dsv3_plan()
    assert run.fits and run.layout.expert_parallel == 64 and run.layout.expert_node_aware
    assert run.layout.expert_overlap_chunks == 4 and run.layout.overlap_comm and run.layout.zero_stage == 2
    assert run.time.gpu_hours / PUBLISHED_GPU_HOURS == pytest.approx(1.98, abs=0.01)
    compute_only = run.time.compute_s * run.time.steps * 1920 / 3600
    assert compute_only / PUBLISHED_GPU_HOURS == pytest.approx(1.30, abs=0.01)
    blocking = dsv3_plan("train.expert_comm.overlap_chunks=1", "train.expert_comm.fp8_dispatch=false")
    assert blocking.time.gpu_hours / PUBLISHED_GPU_HOURS == pytest.approx(2.68, abs=0.01)


def test_deepseek_v3_node_aware_at_expert_parallel_64_hides_its_hops_in_chunks():
    """The recipe's expert parallel 64 on 8 nodes (its 8 groups one a node): node-aware dispatch (once per node over
    InfiniBand, then inside the node over NVLink) exposes 48.2% of the step blocking in one chunk, 43.3% in 2 chunks,
    34.3% in 4: the same rows (the counts of every chunk add a few ints), 25.8 s exposed a step, 21.1 s, 14.4 s."""
    node_aware = ("train.expert_parallel_size=64", "train.expert_comm.node_aware=true")
    runs = {chunks: dsv3_plan(*node_aware, f"train.expert_comm.overlap_chunks={chunks}") for chunks in (1, 2, 4)}
    assert all(r.layout.expert_node_aware and r.layout.expert_parallel == 64 for r in runs.values())
    assert [round(share(r), 3) for r in runs.values()] == [0.482, 0.433, 0.343]
    assert runs[4].time.comm_s == pytest.approx(runs[1].time.comm_s, rel=1e-5)
    assert runs[1].layout.expert_comm() == "once per rank, node-aware, fp8, blocking"
    assert runs[4].layout.expert_comm() == "once per rank, node-aware, fp8, 4 chunks overlapped"


def test_deepseek_v3_recipe_holds_the_fastest_layout_of_its_micro_batch_and_checkpointing():
    """The search's own candidates and ranking, restricted to the recipe's micro-batch and activation checkpointing
    (every expert-parallel size, ZeRO stage with and without overlap_comm, all-to-all option): one trace of the 671B
    model instead of the full search's eight (80 s of CI's 20 minutes). The full search is the command in the
    recipe's header."""
    cfg = load_config(DSV3)
    recipe = dsv3_plan().layout
    memory, runs = {}, []
    for layout in candidate_layouts(cfg, ZERO2, Cluster(1920, 8), 15360):
        if (layout.micro_batch, layout.activation_checkpointing) != (recipe.micro_batch,
                                                                     recipe.activation_checkpointing):
            continue
        key = dataclasses.replace(layout, expert_overlap_chunks=1)
        runs.append(plan_layout(cfg, layout, hardware("h800"), assumptions(), memory.get(key)))
        memory[key] = runs[-1].memory
    fitting = sorted((r for r in runs if r.fits), key=lambda r: (r.time.step_s, r.memory.peak))
    assert len(fitting) > 10 and fitting[0].layout == recipe
