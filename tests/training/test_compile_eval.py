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


@pytest.mark.slow
def test_validations_after_the_first_do_not_recompile():
    """Issue 40 item 16: under train.compile (each block compiled, as the trainer does) a validation's routed token
    counts differ from batch to batch (eval_mode threshold); once the first validation has compiled the dynamic
    graphs, later ones reuse them. Before, a pad test on the count (N mod the chunk) compiled one more graph per
    residue at later validations, until dynamo's recompile limit (8) at the quick start's second validation. Two
    of the quick start's four experts (windows 16 and 8, both chunked by 32) halve the block's compilation; the
    threshold routes 352 = 11 x 32 tokens to the first expert in the second validation's first batch, which that
    pad test compiled one more graph for (checked with it restored: graphs [19, 21, 21])."""
    import torch
    from torch._dynamo.utils import counters

    from moep_ds import build_model, load_config
    from moep_ds.training.blocks import apply_block_options

    cfg = load_config(REPO / "configs/quickstart.yaml", overrides=[
        "model.layers[0].repeat=1", "model.d_model=32", "model.vocab_size=64", "model.layers[0].attention.num_heads=2",
        "model.layers[0].experts.d_thin=32", "model.layers[0].experts.num_heads=2",
        "model.layers[0].experts.windows=[16,8]"])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    router = model.blocks[0].router
    router.threshold.fill_(0.49)  # near 1 / E, as the thresholds' EMA leaves them in training: counts vary by batch
    apply_block_options(model, activation_checkpointing=False, compile=True)
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    graphs, counts = [], []
    with torch.no_grad():
        for _ in range(3):  # validations of 2 micro-batches of the quick start's shape
            for _ in range(2):
                out = model(torch.randint(0, 64, (8, 64), generator=generator))
                counts.append(tuple(int(c) for c in out.stats["layers.0.tokens_per_expert"]))
            graphs.append(counters["stats"]["unique_graphs"])
    assert len(set(counts)) == 6  # every batch routes other token counts to the experts
    # a later validation routes a multiple of the chunk (32) to an expert: no padding, what the pad test recompiled for
    assert any(n % 32 == 0 for batch in counts[2:] for n in batch), counts
    assert graphs[1] == graphs[2] == graphs[0], graphs
