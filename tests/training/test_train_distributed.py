"""End-to-end training on 2 CPU ranks (gloo, tests/ranks.py): every ZeRO stage once in fp32 and bf16 once, expert
parallelism, exact and cross-layout resume, crash safety of checkpoints, TensorBoard scalars, fp16 loss scaling
(every shipped stage x precision config on 1 rank)."""
import json
import pathlib

import pytest

from tiny import DS_CONFIGS, REPO, losses, metrics, run_jobs, run_pretrain, write_recipe

pytestmark = pytest.mark.slow
ZERO_RUNS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
STEPS = 12


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, one_process_reference):
    """The jobs of expert_parallel_jobs, moe_stream_jobs and zero_matrix_jobs in one launch of 2 ranks, one after
    another in one process group (as each set's own jobs ran before): the runs of each set, and the ranks. The ZeRO
    matrix comes last, since its activation-checkpointed job changes the process's allocator
    (training/host_memory.py)."""
    parts = {"ep": expert_parallel_jobs(tmp_path_factory.mktemp("ep"), one_process_reference),
             "stream": moe_stream_jobs(tmp_path_factory.mktemp("stream")),
             "zero": zero_matrix_jobs(tmp_path_factory.mktemp("zero"))}
    ranks = run_jobs(2, [job for jobs, _ in parts.values() for job in jobs])
    return {name: runs for name, (_, runs) in parts.items()} | {"ranks": ranks}


@pytest.fixture(scope="module")
def zero_matrix(two_rank_runs):
    """The runs of zero_matrix_jobs, and the ranks of their launch (two_rank_runs)."""
    return {**two_rank_runs["zero"], "ranks": two_rank_runs["ranks"]}


def zero_matrix_jobs(tmp: pathlib.Path) -> tuple[list[dict], dict]:
    """Every routed block type, 12 steps on 2 ranks: each ZeRO stage in fp32, bf16 at ZeRO-3 (its partitioned
    build in bf16; every stage in bf16 on 1 rank: test_every_shipped_fp32_and_bf16_config_trains_as_zero2). ZeRO-2
    checkpoints at step 6 and is resumed from there to the end ("resumed"); ZeRO-3 runs with activation
    checkpointing too, stopped at step 3 ("recomputed")."""
    jobs, runs = [], {}
    for stage, precision in ZERO_RUNS:
        out = tmp / f"zero{stage}_{precision}"
        ckpt = {"every_steps": 6 if (stage, precision) == (2, "fp32") else None, "at_end": False}
        recipe = write_recipe(tmp / f"zero{stage}_{precision}.yaml", "mixed", out, max_steps=STEPS, checkpoint=ckpt)
        jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_{precision}.json")})
        runs[(stage, precision)] = out
    runs["resumed"] = tmp / "zero2_resumed"
    jobs.append({**jobs[2], "resume": str(runs[2, "fp32"] / "checkpoints" / "step_00000006"),
                 "overrides": [f"train.output_dir={runs['resumed']}"]})
    runs["recomputed"] = tmp / "zero3_recomputed"
    jobs.append({**jobs[3], "overrides": [f"train.output_dir={runs['recomputed']}", "train.exit_at_step=3",
                                          "train.activation_checkpointing=true"]})
    return jobs, runs


@pytest.mark.parametrize("stage, precision", ZERO_RUNS)
def test_every_zero_stage_and_precision_trains_all_routed_blocks(zero_matrix, stage, precision):
    curve = losses(zero_matrix[(stage, precision)])
    assert sorted(curve) == list(range(1, STEPS + 1))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last < first - 0.3, curve


def test_zero3_built_partitioned_trains_as_zero2(zero_matrix):
    """ZeRO-3 builds and initialises the model partitioned (distributed/zero3.py), ZeRO-2 whole: the same initial
    weights, so the same losses on every routed block type (in bf16: tests/distributed/test_zero3.py compares the
    partitioned bf16 build's weights, and the shipped-config test below its losses with ZeRO-2's)."""
    zero3, zero2 = losses(zero_matrix[(3, "fp32")]), losses(zero_matrix[(2, "fp32")])
    for step in range(1, 6):
        assert zero3[step] == pytest.approx(zero2[step], abs=1e-4), (step, zero3, zero2)


def test_every_zero_stage_logs_the_gradient_norm(zero_matrix):
    """ZeRO-0 fp32's norm is computed by distributed/grad_norm.py, the others by DeepSpeed: the same quantity."""
    norms = {key: [m["grad_norm"] for m in metrics(zero_matrix[key]) if "loss" in m] for key in ZERO_RUNS}
    assert all(len(n) == STEPS for n in norms.values()), {key: len(n) for key, n in norms.items()}
    for stage in (0, 1, 3):
        assert norms[stage, "fp32"][:3] == pytest.approx(norms[2, "fp32"][:3], rel=1e-4), norms


def test_activation_checkpointing_under_zero3_trains_as_without(zero_matrix):
    """The recipe switch under ZeRO-3 (parameters fetched again for the recomputation): the same losses as without
    it, every routed block type."""
    plain, recomputed = losses(zero_matrix[(3, "fp32")]), losses(zero_matrix["recomputed"])
    assert sorted(recomputed) == [1, 2, 3]
    assert recomputed == {step: plain[step] for step in (1, 2, 3)}
    # on CPU the checkpointed run also returns freed host buffers to the OS (training/host_memory.py), rank 0 says so
    output = "".join(rank.stdout + rank.stderr for rank in zero_matrix["ranks"])
    assert output.count("go back to the OS when freed") == 1


def test_exact_resume_with_lifecycle(zero_matrix):
    """ZeRO-2 resumed from step 6 trains steps 7-12 bit-identically, and the lifecycle manager makes the same
    replacements as in the uninterrupted run."""
    full, resumed = losses(zero_matrix[(2, "fp32")]), losses(zero_matrix["resumed"])
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert resumed == {step: full[step] for step in range(7, STEPS + 1)}
    events = [e for e in lifecycle_events(zero_matrix[(2, "fp32")]) if e["step"] > 6]
    assert events and lifecycle_events(zero_matrix["resumed"]) == events


def test_tensorboard_events_hold_the_named_scalars(zero_matrix):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = zero_matrix[(2, "fp32")]
    events = list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/ce_loss", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert tag in tags, sorted(tags)
    assert any(t.startswith("train/aux/layers.") and t.endswith("load_balancing_loss") for t in tags), sorted(tags)
    assert any(t.startswith("moe/layers.") and "/expert_" in t for t in tags), sorted(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    utilization = [json.loads(l) for l in (run / "expert_utilization.jsonl").read_text().splitlines()]
    assert utilization and all("step" in u for u in utilization)


EP_LAYERS = "msit"


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    """The ZeRO-2 expert-parallel-1 MSIT run and the top-2 run of expert_parallel_runs on 1 process (launched
    before them, so that their launch also resumes this MSIT run's checkpoint at expert parallel 2)."""
    tmp = tmp_path_factory.mktemp("ref")
    out = tmp / "ref_1p"
    recipe = write_recipe(tmp / "ref_1p.yaml", EP_LAYERS, out, max_steps=8, global_batch_size=8, grad_clip=0.05,
                          checkpoint={"every_steps": 5, "at_end": False}, eval_every=4)
    top2 = tmp / "top2_1p"
    top2_recipe = write_recipe(tmp / "top2_1p.yaml", "top2", top2, max_steps=4, global_batch_size=8, eval_every=3)
    run_jobs(1, [{"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")},
                 {"recipe": str(top2_recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")}])
    return {"msit": (recipe, out), "top2": (top2_recipe, top2)}


@pytest.fixture(scope="module")
def expert_parallel_runs(two_rank_runs):
    """The folder of expert_parallel_jobs' runs, and the runs (two_rank_runs)."""
    return two_rank_runs["ep"]


def expert_parallel_jobs(tmp: pathlib.Path, one_process_reference: dict) -> tuple[list[dict], tuple]:
    """2 processes: expert parallel 1 and 2 on the same global batch under ZeRO 0, 1 and 2 (fp32, clipping on
    every step), ZeRO-0's and ZeRO-2's with checkpoints at step 5. MSIT: its experts' share of the gradient norm is large enough
    that clipping by anything but the norm over all experts shows in the losses. The same launch resumes the
    1-process reference's checkpoint of step 5 at expert parallel 2 for a step ("1p_on_ep2",
    test_checkpoints_move_between_expert_parallel_and_single_process)."""
    runs, jobs = {}, []
    for stage in (0, 1, 2):
        for ep in (1, 2):
            out = tmp / f"zero{stage}_ep{ep}"
            ckpt = {"every_steps": 5 if stage in (0, 2) else None, "at_end": False}
            recipe = write_recipe(tmp / f"zero{stage}_ep{ep}.yaml", EP_LAYERS, out, max_steps=8, global_batch_size=8,
                                  expert_parallel_size=ep, grad_clip=0.05, checkpoint=ckpt, eval_every=4)
            jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_fp32.json")})
            runs[stage, ep] = (recipe, out)
    out = tmp / "top2_2p"  # validation on 1 and 2 processes (test_one_process_trains_and_validates_as_two)
    recipe = write_recipe(tmp / "top2_2p.yaml", "top2", out, max_steps=4, global_batch_size=8, eval_every=3)
    jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")})
    runs["top2"] = (recipe, out)
    for ep in (1, 2):  # the MoEP paths block: three routed stages (projection experts, paths) sharded alike
        out = tmp / f"paths_ep{ep}"
        recipe = write_recipe(tmp / f"paths_ep{ep}.yaml", "paths", out, max_steps=6, global_batch_size=8,
                              expert_parallel_size=ep, grad_clip=0.05)
        jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero1_fp32.json")})
        runs["paths", ep] = (recipe, out)
    runs["1p_on_ep2"] = tmp / "1p_on_ep2"
    jobs.append(resume_job(runs[2, 2][0], runs["1p_on_ep2"],
                           one_process_reference["msit"][1] / "checkpoints" / "step_00000005", exit_at_step=6))
    return jobs, (tmp, runs)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_expert_parallel_2_equals_expert_parallel_1(expert_parallel_runs, stage):
    """Each expert's gradient is averaged over the ranks that hold it, not added to other experts' (ZeRO-1 with
    DeepSpeed's non-contiguous gradient path did that), and clipped by the norm over all experts (ZeRO-0 fp32:
    distributed/grad_norm.py; DeepSpeed's own clipping there averages the ranks' norms)."""
    _, runs = expert_parallel_runs
    ep1, ep2 = losses(runs[stage, 1][1]), losses(runs[stage, 2][1])
    assert sorted(ep1) == sorted(ep2) == list(range(1, 9))
    for step in range(1, 9):
        assert ep2[step] == pytest.approx(ep1[step], abs=1e-5), (step, ep1, ep2)
    val1, val2 = val_losses(runs[stage, 1][1]), val_losses(runs[stage, 2][1])
    assert sorted(val1) == [4, 8] and val2 == pytest.approx(val1, abs=1e-5), (val1, val2)


def val_losses(run) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metrics(run) if "val_loss" in m}


def test_one_process_trains_and_validates_as_two(expert_parallel_runs, one_process_reference):
    """The same global batches, and validation on the same windows (eval_batches global batches, not per rank).
    Validation is compared on top-2 routing: MSIT's expert choice evaluates with thresholds averaged over the
    ranks' estimates, which differ from one estimate over the whole batch."""
    _, runs = expert_parallel_runs
    for name, two in (("msit", runs[2, 1][1]), ("top2", runs["top2"][1])):
        one = one_process_reference[name][1]
        assert losses(one) == pytest.approx(losses(two), abs=1e-5), name
        assert sorted(val_losses(one)) == ([4, 8] if name == "msit" else [3, 4])  # and at the last step
    one, two = val_losses(one_process_reference["top2"][1]), val_losses(runs["top2"][1])
    assert one == pytest.approx(two, abs=1e-5), (one, two)


def test_moep_paths_expert_parallel_2_equals_1(expert_parallel_runs):
    """ZeRO-1 with clipping on every step (test_expert_parallel_blocks.py runs the paths recipe at ZeRO-2)."""
    _, runs = expert_parallel_runs
    ep1, ep2 = losses(runs["paths", 1][1]), losses(runs["paths", 2][1])
    assert sorted(ep1) == sorted(ep2) == list(range(1, 7))
    assert ep2 == pytest.approx(ep1, abs=1e-5)


def resume_job(recipe, out, ckpt, stage=2, **overrides):
    sets = [f"train.output_dir={out}"] + [f"train.{k}={v}" for k, v in overrides.items()]
    return {"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_fp32.json"), "resume": str(ckpt),
            "overrides": sets}


def test_checkpoints_move_between_expert_parallel_and_single_process(expert_parallel_runs, one_process_reference):
    tmp, runs = expert_parallel_runs
    _, out_ep2 = runs[2, 2]
    # an expert-parallel-2 checkpoint (2 processes) resumes on 1 process
    one = tmp / "ep2_on_1p"
    ckpt = out_ep2 / "checkpoints" / "step_00000005"
    recipe_1p, one_ref = one_process_reference["msit"]
    # and ZeRO-0's (no partitioned optimizer: each rank writes a share of its experts' rows, replicated over its
    # expert-data-parallel group), two steps: the second shows the Adam moments
    zero0 = tmp / "zero0_ep2_on_1p"
    _, out_zero0 = runs[0, 2]
    run_jobs(1, [resume_job(recipe_1p, one, ckpt, exit_at_step=6, expert_parallel_size=1),
                 resume_job(recipe_1p, zero0, out_zero0 / "checkpoints" / "step_00000005", stage=0, exit_at_step=7,
                            expert_parallel_size=1)])
    assert losses(one)[6] == pytest.approx(losses(out_ep2)[6], abs=1e-5)
    assert sorted(losses(zero0)) == [6, 7]
    for step in (6, 7):
        assert losses(zero0)[step] == pytest.approx(losses(out_zero0)[step], abs=1e-5), (step, losses(zero0))
    # and a 1-process checkpoint resumes on 2 processes at expert parallel 2 (in expert_parallel_runs' launch)
    assert losses(runs["1p_on_ep2"])[6] == pytest.approx(losses(one_ref)[6], abs=1e-5)


def test_kill_during_checkpoint_write_resumes_from_previous(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6, checkpoint={"every_steps": 2, "keep_last": 2})
    args = ["--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json")]
    crashed = run_pretrain(2, *args, fault="kill", step=4, check=False)
    assert crashed[0].exitcode == -9  # SIGKILL once its shard of step 4 was written
    root = out / "checkpoints"
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000002"]
    assert (root / ".tmp-step_00000004").is_dir()  # the half-written one is not a checkpoint
    (root / ".step_00000002.old-0123456789ab").mkdir()  # as a replacement killed before its delete leaves one
    resumed = run_pretrain(2, *args, "--resume", "auto")[0]
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000004", "step_00000006"]
    assert not list(root.glob(".tmp-*")) and not list(root.glob(".step_*"))
    steps = [m["step"] for m in metrics(out)]
    assert steps == [1, 2, 3, 4, 5, 6]  # rows 3-4 of the crashed run were dropped on resume from step 2


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    """ZeRO-0 and ZeRO-2 fp16 on 1 rank: 16 steps from a loss scale of 2^24, and 4 steps as shipped (2^16, no
    overflow: DeepSpeed's ZeRO-0 optimizer halves the scale at the first overflow, the ZeRO optimizers only at the
    second, `hysteresis` 2)."""
    tmp = tmp_path_factory.mktemp("fp16")
    runs, jobs = {}, []
    for stage in (0, 2):
        for name, steps, scale_power in (("overflow", 16, 24), ("shipped", 4, None)):
            runs[stage, name] = tmp / f"zero{stage}_{name}"
            recipe = write_recipe(tmp / f"zero{stage}_{name}.yaml", "top2", runs[stage, name], max_steps=steps)
            ds = json.loads((DS_CONFIGS / f"zero{stage}_fp16.json").read_text())
            if scale_power:  # overflows at first: the scaler must skip steps and back off
                ds["fp16"]["initial_scale_power"] = scale_power
            (tmp / f"zero{stage}_{name}.json").write_text(json.dumps(ds))
            jobs.append({"recipe": str(recipe), "ds_config": str(tmp / f"zero{stage}_{name}.json")})
    run_jobs(1, jobs, fp16=True)
    return runs


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_dynamic_loss_scaling_skips_overflowing_steps(fp16_runs, stage):
    """ZeRO-0 included: DeepSpeed 0.19 leaves its loss scaling to us there (distributed/optimizer_state.py loss_for_backward)."""
    rows = metrics(fp16_runs[stage, "overflow"])  # strict JSON (tiny.metrics)
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] <= 2.0**24 and scales[-1] < scales[0]
    assert 1 <= rows[-1]["skipped_steps"] <= len(rows) - 4  # it backed off, then trained
    # a skipped step's gradient norm is inf (DeepSpeed's): no non-finite training, so the run went on to the end
    assert [r["step"] for r in rows] == list(range(1, 17))
    skipped = [r for before, r in zip([{"skipped_steps": 0}, *rows], rows)
               if r["skipped_steps"] > before["skipped_steps"]]
    assert skipped and all(r["grad_norm"] is None for r in skipped)  # inf, written as null
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, no NaN
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


def test_fp16_zero0_trains_as_zero2(fp16_runs):
    """ZeRO-0 fp16 (DeepSpeed's FP16_UnfusedOptimizer: loss scaled by us, Adam's zero-gradient initialisation step
    undone) follows ZeRO-2 fp16 step for step."""
    zero0, zero2 = metrics(fp16_runs[0, "shipped"]), metrics(fp16_runs[2, "shipped"])
    assert [r["step"] for r in zero0] == [1, 2, 3, 4]
    for z0, z2 in zip(zero0, zero2):
        assert z0["loss"] == pytest.approx(z2["loss"], abs=1e-4), (z0, z2)
        assert z0["loss_scale"] == z2["loss_scale"]


def test_conflicting_settings_fail_before_training(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, grad_clip=0.5)
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({"gradient_clipping": 1.0}))
    [proc] = run_pretrain(1, "--config", str(recipe), "--ds_config", str(ds_path), check=False)
    assert proc.exitcode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: train.grad_clip (0.5) conflicts with ds_config gradient_clipping (1.0); set it in one place")
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def lifecycle_events(run_dir: pathlib.Path) -> list[dict]:
    lines = (run_dir / "expert_utilization.jsonl").read_text().splitlines()
    return [json.loads(line)["event"] for line in lines if '"event"' in line]


def moe_stream_jobs(tmp: pathlib.Path) -> tuple[list[dict], dict]:
    """configs/moe_stream.yaml at tiny shapes, ZeRO-2 fp32, at expert parallel 1 and 2 (two_rank_runs)."""
    layer = "model.layers[0]"
    shapes = ["data.source=builtin", "data.tokenizer.vocab_size=512", "model.vocab_size=512", "model.d_model=32",
              "model.max_seq_len=32", f"{layer}.repeat=2", f"{layer}.mixer.state_size=4", f"{layer}.mixer.chunk_size=8",
              f"{layer}.moe.expert.hidden_size=48", f"{layer}.moe.router.lifecycle.min_tokens=16",
              f"{layer}.moe.router.lifecycle.check_interval=2", f"{layer}.moe.router.lifecycle.threshold_ratio=1.0",
              "train.max_steps=5", "train.log_every=1", "train.micro_batch_size=4", "train.global_batch_size=8",
              "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false", "train.optimizer.lr=1.0e-2",
              "train.schedule.warmup_steps=2"]
    runs = {ep: tmp / f"ep{ep}" for ep in (1, 2)}
    jobs = [{"recipe": str(REPO / "configs" / "moe_stream.yaml"), "ds_config": str(DS_CONFIGS / "zero2_fp32.json"),
             "overrides": shapes + [f"train.output_dir={out}", f"train.expert_parallel_size={ep}"]}
            for ep, out in runs.items()]
    return jobs, runs


def test_moe_stream_lifecycle_expert_parallel_2_equals_1(two_rank_runs):
    """configs/moe_stream.yaml at tiny shapes, ZeRO-2 fp32 on 2 ranks: with its 8 experts sharded over the 2
    ranks, the losses and the lifecycle's replacements (decided on statistics reduced over the ranks, clones
    sent from the rank holding the source) are those of the run with every expert on both ranks."""
    runs = two_rank_runs["stream"]
    ep1, ep2 = losses(runs[1]), losses(runs[2])
    assert sorted(ep1) == sorted(ep2) == [1, 2, 3, 4, 5]
    for step in ep1:
        assert ep2[step] == pytest.approx(ep1[step], rel=1e-4), (step, ep1, ep2)
    events1, events2 = lifecycle_events(runs[1]), lifecycle_events(runs[2])
    assert events1, "expected replacements within 5 steps"
    assert len({e["layer"] for e in events1}) == 2 and {e["step"] for e in events1} <= {2, 4}
    decided = ("event", "step", "layer", "expert", "source", "age_tokens")
    assert [[e[k] for k in decided] for e in events2] == [[e[k] for k in decided] for e in events1]
    for a, b in zip(events1, events2):
        for key in ("score", "value", "threshold", "frequency", "impact"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-9), (key, a, b)


def test_every_shipped_fp32_and_bf16_config_trains_as_zero2(tmp_path):
    """Each shipped ZeRO JSON in fp32 or bf16, CPU offload included (the recipe's AdamW runs on the offloaded
    partitions), trains and gives the ZeRO-2 run's losses in the same precision (fp16: the tests above)."""
    names = sorted(p.stem for p in DS_CONFIGS.glob("zero*_*.json") if "fp16" not in p.stem)
    assert {"zero0_bf16", "zero2_bf16_offload", "zero3_bf16_offload", "zero3_fp32"} <= set(names)
    jobs = []
    for name in names:
        recipe = write_recipe(tmp_path / f"{name}.yaml", "top2", tmp_path / name, max_steps=3)
        jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"{name}.json")})
    run_jobs(1, jobs)
    for name in names:
        reference = losses(tmp_path / f"zero2_{name.split('_')[1]}")
        got = losses(tmp_path / name)
        assert sorted(got) == [1, 2, 3], name
        for step in got:
            assert got[step] == pytest.approx(reference[step], abs=1e-4), (name, step, got[step], reference[step])
