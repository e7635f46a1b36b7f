"""train.compile with validation (issue: InductorError "Exponent must be non-negative" at the first evaluation of
the quick-start recipe, in routed attention's SDPA path, and nothing saved because evaluation came before the
step's checkpoint)."""
import pytest

from moep_ds.checkpointing import layout

from tiny import DS_CONFIGS, REPO, metrics, run_pretrain, write_recipe

QUICKSTART = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--ds_config",
              str(REPO / "ds_configs" / "quickstart.json")]


@pytest.mark.slow
def test_quickstart_recipe_compiled_validates_and_saves_as_eager(tmp_path):
    """2 steps of the quick-start recipe (one MSIT layer) with validation and a checkpoint at step 2, compiled and
    eager: the same losses and validation loss (compiled kernels round differently), and the checkpoint."""
    runs = {}
    for compile in (False, True):
        out = tmp_path / f"compile_{compile}"
        run_pretrain(1, *QUICKSTART, "--set", f"train.output_dir={out}", f"train.compile={compile}",
                     "model.layers[0].repeat=1", "train.max_steps=2", "train.eval_every=2", "train.eval_batches=1",
                     "train.checkpoint.every_steps=2", "train.log_every=1", timeout=900)
        assert [c.name for c in layout.complete_checkpoints(out)] == ["step_00000002"]
        runs[compile] = {(m["step"], key): m[key] for m in metrics(out) for key in ("loss", "val_loss") if key in m}
    assert sorted(runs[True]) == [(1, "loss"), (2, "loss"), (2, "val_loss")]
    assert runs[True] == pytest.approx(runs[False], abs=1e-4)


@pytest.mark.slow
def test_a_failing_evaluation_keeps_the_checkpoint_of_its_step(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, eval_every=2,
                          checkpoint={"every_steps": 2})
    [proc] = run_pretrain(1, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json"),
                          fault="eval", check=False)
    assert proc.exitcode != 0 and "simulated: the evaluation forward failed" in proc.stderr
    assert [c.name for c in layout.complete_checkpoints(out)] == ["step_00000002"]
