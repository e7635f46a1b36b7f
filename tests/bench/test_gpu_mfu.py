"""bench/gpu_mfu.py: the toy recipes exercise the real recipes' blocks, and the CPU dry run prints every row."""
import pytest

from benchlib import REPO, load, run, table_rows

mfu = load("gpu_mfu")


@pytest.mark.parametrize("name", mfu.RECIPES)
def test_dry_run_sizes_keep_block_types_and_routers(name):
    from moep_ds.config import load_config
    from moep_ds.models.accounting import meta_param_report

    full = load_config(REPO / "configs" / f"{name}.yaml")
    toy = load_config(REPO / "configs" / f"{name}.yaml", mfu.DRY_RUN_OVERRIDES[name])
    assert {type(b) for b in toy.model.expanded_layers()} == {type(b) for b in full.model.expanded_layers()}
    routers = lambda cfg: {type(r) for b in cfg.model.expanded_layers()  # noqa: E731
                           for r in (getattr(b, "router", None), getattr(getattr(b, "moe", None), "router", None),
                                     getattr(b, "path_router", None)) if r is not None}
    assert routers(toy) == routers(full)
    assert meta_param_report(toy.model).params_total < 2e6 < meta_param_report(full.model).params_total


def test_matmul_peak_is_positive_and_names_its_size():
    import torch

    tflops, n = mfu.matmul_peak_tflops(torch.device("cpu"), [32, 64], iters=2)
    assert tflops > 0 and n in (32, 64)


@pytest.mark.slow
def test_dry_run_prints_a_row_per_recipe():
    # one timed step of 8 sequences per recipe: the path is the dry run's, its numbers are not checked (msit_babylm's
    # default micro-batch of 64 for 1 + 2 steps took 27 of the run's 39 s on 2 cores)
    proc = run("gpu_mfu.py", "--dry_run", "--micro_batch", "8", "--warmup", "0", "--steps", "1")
    rows = {(row[0], row[1]): row for row in table_rows(proc.stdout)}
    assert set(rows) == {(name, variant) for name in mfu.RECIPES for variant in ("ckpt",)}
    for row in rows.values():
        tokens_per_s, tflops, mfu_measured = float(row[4].replace(",", "")), float(row[5]), float(row[6].rstrip("%"))
        assert tokens_per_s > 0 and tflops > 0 and mfu_measured > 0
        assert row[9] == "-"  # graphs: compiled rows only
        assert row[10].endswith("n/a (dry run)")
    assert "measured bf16 matmul peak" in proc.stdout
