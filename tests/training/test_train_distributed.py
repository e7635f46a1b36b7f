"""End-to-end training on 2 CPU processes (gloo): ZeRO stages x precisions, expert parallelism, exact and
cross-layout resume, crash safety of checkpoints, TensorBoard scalars, fp16 loss scaling."""
import json
import pathlib

import pytest

from tiny import DS_CONFIGS, REPO, launch, losses, metrics, write_recipe

pytestmark = pytest.mark.slow
SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def jobs_file(tmp: pathlib.Path, jobs: list[dict]) -> str:
    path = tmp / f"jobs_{len(list(tmp.glob('jobs_*')))}.json"
    path.write_text(json.dumps(jobs))
    return str(path)


@pytest.fixture(scope="module")
def zero_matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    jobs, runs = [], {}
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            out = tmp / f"zero{stage}_{precision}"
            recipe = write_recipe(tmp / f"zero{stage}_{precision}.yaml", "mixed", out, max_steps=20)
            jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_{precision}.json")})
            runs[(stage, precision)] = out
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp, jobs))
    return runs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_zero_stage_and_precision_trains_all_routed_blocks(zero_matrix, stage, precision):
    curve = losses(zero_matrix[(stage, precision)])
    assert sorted(curve) == list(range(1, 21))
    first, last = sum(curve[s] for s in range(1, 4)) / 3, sum(curve[s] for s in range(18, 21)) / 3
    assert last < first - 0.3, curve


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_built_partitioned_trains_as_zero2(zero_matrix, precision):
    """ZeRO-3 builds and initialises the model partitioned (distributed/zero3.py), ZeRO-2 whole: the same initial
    weights, so the same losses on every routed block type."""
    zero3, zero2 = losses(zero_matrix[(3, precision)]), losses(zero_matrix[(2, precision)])
    for step in range(1, 6):
        assert zero3[step] == pytest.approx(zero2[step], abs=1e-4), (step, zero3, zero2)


def test_every_zero_stage_and_precision_logs_the_gradient_norm(zero_matrix):
    """ZeRO-0 fp32's norm is computed by distributed/grad_norm.py, the others by DeepSpeed: the same quantity."""
    norms = {key: [m["grad_norm"] for m in metrics(run) if "loss" in m] for key, run in zero_matrix.items()}
    assert all(len(n) == 20 for n in norms.values()), {key: len(n) for key, n in norms.items()}
    for stage in (0, 1, 3):
        assert norms[stage, "fp32"][:3] == pytest.approx(norms[2, "fp32"][:3], rel=1e-4), norms


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
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))
    utilization = [json.loads(l) for l in (run / "expert_utilization.jsonl").read_text().splitlines()]
    assert utilization and all("step" in u for u in utilization)


EP_LAYERS = "msit"


@pytest.fixture(scope="module")
def expert_parallel_runs(tmp_path_factory):
    """2 processes: expert parallel 1 and 2 on the same global batch under ZeRO 0, 1 and 2 (fp32, clipping on
    every step), ZeRO-0's and ZeRO-2's with checkpoints at step 5. MSIT: its experts' share of the gradient norm is large enough
    that clipping by anything but the norm over all experts shows in the losses."""
    tmp = tmp_path_factory.mktemp("ep")
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
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp, jobs))
    return tmp, runs


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


@pytest.fixture(scope="module")
def one_process_reference(expert_parallel_runs):
    """The ZeRO-2 expert-parallel-1 MSIT run and the top-2 run of expert_parallel_runs on 1 process."""
    tmp, runs = expert_parallel_runs
    out = tmp / "ref_1p"
    recipe = write_recipe(tmp / "ref_1p.yaml", EP_LAYERS, out, max_steps=8, global_batch_size=8, grad_clip=0.05,
                          checkpoint={"every_steps": 5, "at_end": False}, eval_every=4)
    top2 = tmp / "top2_1p"
    top2_recipe = write_recipe(tmp / "top2_1p.yaml", "top2", top2, max_steps=4, global_batch_size=8, eval_every=3)
    launch(1, SCRIPTS / "run_many.py", jobs_file(tmp, [
        {"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")},
        {"recipe": str(top2_recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")}]))
    return {"msit": (recipe, out), "top2": (top2_recipe, top2)}


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


def test_expert_parallel_2_and_4_equal_1_on_four_processes(tmp_path):
    """4 processes (expert-data-parallel groups of 2 at expert parallel 2): ZeRO 0 and 1, clipping every step."""
    jobs, runs = [], {}
    for stage in (0, 1):
        for ep in (1, 2, 4):
            out = tmp_path / f"zero{stage}_ep{ep}"
            recipe = write_recipe(tmp_path / f"zero{stage}_ep{ep}.yaml", EP_LAYERS, out, max_steps=4,
                                  global_batch_size=16, expert_parallel_size=ep, grad_clip=0.05)
            jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_fp32.json")})
            runs[stage, ep] = out
    launch(4, SCRIPTS / "run_many.py", jobs_file(tmp_path, jobs))
    for (stage, ep), out in runs.items():
        assert losses(out) == pytest.approx(losses(runs[0, 1]), abs=1e-5), (stage, ep)


def resume_job(recipe, out, ckpt, stage=2, **overrides):
    sets = [f"train.output_dir={out}"] + [f"train.{k}={v}" for k, v in overrides.items()]
    return {"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"zero{stage}_fp32.json"), "resume": str(ckpt),
            "overrides": sets}


def test_checkpoints_move_between_expert_parallel_and_single_process(expert_parallel_runs, one_process_reference):
    tmp, runs = expert_parallel_runs
    recipe_ep2, out_ep2 = runs[2, 2]
    # an expert-parallel-2 checkpoint (2 processes) resumes on 1 process
    one = tmp / "ep2_on_1p"
    ckpt = out_ep2 / "checkpoints" / "step_00000005"
    recipe_1p, one_ref = one_process_reference["msit"]
    # and ZeRO-0's (no partitioned optimizer: each rank writes a share of its experts' rows, replicated over its
    # expert-data-parallel group), two steps: the second shows the Adam moments
    zero0 = tmp / "zero0_ep2_on_1p"
    _, out_zero0 = runs[0, 2]
    launch(1, SCRIPTS / "run_many.py", jobs_file(tmp, [
        resume_job(recipe_1p, one, ckpt, exit_at_step=6, expert_parallel_size=1),
        resume_job(recipe_1p, zero0, out_zero0 / "checkpoints" / "step_00000005", stage=0, exit_at_step=7,
                   expert_parallel_size=1)]))
    assert losses(one)[6] == pytest.approx(losses(out_ep2)[6], abs=1e-5)
    assert sorted(losses(zero0)) == [6, 7]
    for step in (6, 7):
        assert losses(zero0)[step] == pytest.approx(losses(out_zero0)[step], abs=1e-5), (step, losses(zero0))
    # and a 1-process checkpoint resumes on 2 processes at expert parallel 2
    two = tmp / "1p_on_ep2"
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp, [
        resume_job(recipe_ep2, two, one_ref / "checkpoints" / "step_00000005", exit_at_step=6)]))
    assert losses(two)[6] == pytest.approx(losses(one_ref)[6], abs=1e-5)


def test_exact_resume_with_lifecycle(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    jobs = []
    for out, extra in ((full, {}), (part, {"exit_at_step": 5})):
        recipe = write_recipe(tmp_path / f"{out.name}.yaml", "mixed", out, max_steps=10, **extra)
        jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")})
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp_path, jobs))
    assert sorted(losses(part)) == [1, 2, 3, 4, 5]
    resume = write_recipe(tmp_path / "resume.yaml", "mixed", part, max_steps=10)
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp_path, [
        {"recipe": str(resume), "ds_config": str(DS_CONFIGS / "zero2_fp32.json"), "resume": "auto"}]))
    assert losses(part) == losses(full)
    events = [json.loads(l) for l in (full / "expert_utilization.jsonl").read_text().splitlines() if '"event"' in l]
    resumed = [json.loads(l) for l in (part / "expert_utilization.jsonl").read_text().splitlines() if '"event"' in l]
    assert events and resumed == events  # the lifecycle manager replaced experts, and made the same decisions


def test_kill_during_checkpoint_write_resumes_from_previous(tmp_path, monkeypatch):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6, checkpoint={"every_steps": 2, "keep_last": 2})
    args = ["--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json")]
    with monkeypatch.context() as patch:
        patch.setenv("MOEP_TEST_FAULT", "kill")
        patch.setenv("MOEP_TEST_FAULT_STEP", "4")
        crashed = launch(2, SCRIPTS / "pretrain_fault.py", *args, check=False)
    assert crashed.returncode != 0
    root = out / "checkpoints"
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000002"]
    assert (root / ".tmp-step_00000004").is_dir()  # the half-written one is not a checkpoint
    (root / ".step_00000002.old-0123456789ab").mkdir()  # as a replacement killed before its delete leaves one
    resumed = launch(2, REPO / "pretrain.py", *args, "--resume", "auto")
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000004", "step_00000006"]
    assert not list(root.glob(".tmp-*")) and not list(root.glob(".step_*"))
    steps = [m["step"] for m in metrics(out)]
    assert steps == [1, 2, 3, 4, 5, 6]  # rows 3-4 of the crashed run were dropped on resume from step 2


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_dynamic_loss_scaling_skips_overflowing_steps(tmp_path, stage):
    """ZeRO-0 included: DeepSpeed 0.19 leaves its loss scaling to us there (distributed/optimizer_state.py loss_for_backward)."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=16)
    ds = json.loads((DS_CONFIGS / f"zero{stage}_fp16.json").read_text())
    ds["fp16"]["initial_scale_power"] = 24  # overflows at first: the scaler must skip steps and back off
    ds_path = tmp_path / "fp16.json"
    ds_path.write_text(json.dumps(ds))
    launch(1, SCRIPTS / "fp16_on_cpu.py", "--config", str(recipe), "--ds_config", str(ds_path))
    rows = metrics(out)
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] <= 2.0**24 and scales[-1] < scales[0]
    assert 1 <= rows[-1]["skipped_steps"] <= len(rows) - 4  # it backed off, then trained
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, no NaN
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


def test_fp16_zero0_trains_as_zero2(tmp_path):
    """ZeRO-0 fp16 (DeepSpeed's FP16_UnfusedOptimizer: loss scaled by us, Adam's zero-gradient initialisation step
    undone) follows ZeRO-2 fp16 step for step."""
    runs = {}
    for stage in (0, 2):
        out = tmp_path / f"z{stage}"
        recipe = write_recipe(tmp_path / f"z{stage}.yaml", "top2", out, max_steps=4)
        launch(1, SCRIPTS / "fp16_on_cpu.py", "--config", str(recipe), "--ds_config",
               str(DS_CONFIGS / f"zero{stage}_fp16.json"))
        runs[stage] = metrics(out)
    assert [r["step"] for r in runs[0]] == [1, 2, 3, 4]
    for z0, z2 in zip(runs[0], runs[2]):
        assert z0["loss"] == pytest.approx(z2["loss"], abs=1e-4), (z0, z2)
        assert z0["loss_scale"] == z2["loss_scale"]


def test_conflicting_settings_fail_before_training(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, grad_clip=0.5)
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({"gradient_clipping": 1.0}))
    proc = launch(1, REPO / "pretrain.py", "--config", str(recipe), "--ds_config", str(ds_path), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: train.grad_clip (0.5) conflicts with ds_config gradient_clipping (1.0); set it in one place")
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def lifecycle_events(run_dir: pathlib.Path) -> list[dict]:
    lines = (run_dir / "expert_utilization.jsonl").read_text().splitlines()
    return [json.loads(line)["event"] for line in lines if '"event"' in line]


def test_moe_stream_lifecycle_expert_parallel_2_equals_1(tmp_path):
    """configs/moe_stream.yaml at tiny shapes, ZeRO-2 fp32 on 2 ranks: with its 8 experts sharded over the 2
    ranks, the losses and the lifecycle's replacements (decided on statistics reduced over the ranks, clones
    sent from the rank holding the source) are those of the run with every expert on both ranks."""
    layer = "model.layers[0]"
    shapes = ["data.source=builtin", "data.tokenizer.vocab_size=512", "model.vocab_size=512", "model.d_model=32",
              "model.max_seq_len=32", f"{layer}.repeat=2", f"{layer}.mixer.state_size=4", f"{layer}.mixer.chunk_size=8",
              f"{layer}.moe.expert.hidden_size=48", f"{layer}.moe.router.lifecycle.min_tokens=16",
              f"{layer}.moe.router.lifecycle.check_interval=2", f"{layer}.moe.router.lifecycle.threshold_ratio=1.0",
              "train.max_steps=5", "train.log_every=1", "train.micro_batch_size=4", "train.global_batch_size=8",
              "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false", "train.optimizer.lr=1.0e-2",
              "train.schedule.warmup_steps=2"]
    runs = {ep: tmp_path / f"ep{ep}" for ep in (1, 2)}
    jobs = [{"recipe": str(REPO / "configs" / "moe_stream.yaml"), "ds_config": str(DS_CONFIGS / "zero2_fp32.json"),
             "overrides": shapes + [f"train.output_dir={out}", f"train.expert_parallel_size={ep}"]}
            for ep, out in runs.items()]
    launch(2, SCRIPTS / "run_many.py", jobs_file(tmp_path, jobs))
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
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    launch(1, SCRIPTS / "run_many.py", str(tmp_path / "jobs.json"))
    for name in names:
        reference = losses(tmp_path / f"zero2_{name.split('_')[1]}")
        got = losses(tmp_path / name)
        assert sorted(got) == [1, 2, 3], name
        for step in got:
            assert got[step] == pytest.approx(reference[step], abs=1e-4), (name, step, got[step], reference[step])
