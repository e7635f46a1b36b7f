"""bench/train_throughput.py: the optimizer-state measurement, the shrunk recipes, and a toy end-to-end run."""
import pytest
import torch

from benchlib import REPO, load, run, table_rows

tt = load("train_throughput")


def test_state_bytes_counts_adam_moments_and_step():
    layer = torch.nn.Linear(3, 5)
    optimizer = torch.optim.AdamW(layer.parameters())
    assert tt.state_bytes(optimizer) == 0
    layer(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in layer.parameters())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert tt.state_bytes(optimizer) == 2 * params * 4 + steps


@pytest.mark.parametrize("model", list(tt.RECIPES))
def test_shrunk_recipes_keep_their_block_types(model):
    from moep_ds.config import load_config
    from moep_ds.models.accounting import meta_param_report

    full = load_config(REPO / tt.RECIPES[model])
    toy = load_config(REPO / tt.RECIPES[model], tt.recipe_overrides(model, "toy", REPO / "runs" / "x", 4))
    assert {type(b) for b in toy.model.expanded_layers()} == {type(b) for b in full.model.expanded_layers()}
    assert toy.data.source == "builtin" and toy.train.max_steps == 4 and toy.train.global_batch_size is None
    assert meta_param_report(toy.model).params_total < meta_param_report(full.model).params_total / 10


def test_targets_report_met_and_missed():
    Row = tt.Row
    results = {Row("dense", "plain", 1): {"per_rank": 100.0, "cpu_per_rank": 100.0},
               Row("dense", "zero2", 1): {"per_rank": 85.0, "cpu_per_rank": 95.0},
               Row("dense", "zero0", 2): {"optimizer_state": 1000},
               Row("dense", "zero2", 2): {"optimizer_state": 500}}
    lines = tt.targets(["dense"], results, "wall")
    assert "(wall time) / plain = 0.85" in lines[0] and "MISSED" in lines[0]
    assert "= 0.50" in lines[1] and "met" in lines[1]
    assert "(cpu time) / plain = 0.95" in tt.targets(["dense"], results, "cpu")[0]


@pytest.mark.slow
def test_toy_run_prints_the_table_and_zero2_halves_optimizer_state():
    proc = run("train_throughput.py", "--models", "dense", "--stages", "2", "--nprocs", "2",
               "--size", "toy", "--steps", "4", "--warmup", "1")
    rows = {row[1]: row for row in table_rows(proc.stdout)}
    assert set(rows) == {"plain", "zero2 x2"}
    for row in rows.values():
        assert float(row[2]) > 0 and float(row[3]) > 0 and float(row[5]) > 0 and float(row[7]) > 0
    assert rows["plain"][4] == rows["plain"][6] == "1.00x"
    assert float(rows["zero2 x2"][3]) == pytest.approx(float(rows["zero2 x2"][2]) / 2, abs=1)
    # the plain loop holds all Adam state, as ZeRO-0 does; ZeRO-2 on 2 ranks holds half per rank (plus padding)
    assert float(rows["zero2 x2"][8]) <= 0.55 * float(rows["plain"][8])


def test_paired_summary_pools_the_pairs_of_every_run():
    row = tt.Row("nova_moe", "paired2", 1)
    runs = [{"ratios": [0.80, 0.90, 1.00], "plain_s": 0.10, "trainer_s": 0.11},
            {"ratios": [0.85, 0.95], "plain_s": 0.20, "trainer_s": 0.22}]
    [line] = tt.paired_table([row], {row: runs})[2:]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["nova_moe", "zero2 x1 / plain, paired", "150.0", "165.0", "0.900"]
    assert cells[6] == "5"
    [target] = tt.paired_targets([row, tt.Row("nova_moe", "paired0", 1)], {row: runs})
    assert target == "nova_moe: ZeRO-2 x1 / plain, CPU time, median of step pairs = 0.900 (target >= 0.90: met)"


@pytest.mark.slow
def test_toy_paired_run_alternates_plain_and_trainer_steps():
    proc = run("train_throughput.py", "--paired", "--models", "dense", "--stages", "2", "--size", "toy",
               "--steps", "6", "--warmup", "2")
    [row] = table_rows(proc.stdout)
    assert row[1] == "zero2 x1 / plain, paired" and row[6] == "4"
    plain_ms, zero_ms, ratio = float(row[2]), float(row[3]), float(row[4])
    assert plain_ms > 0 and zero_ms > 0 and 0.1 < ratio < 10
    assert "dense: ZeRO-2 x1 / plain, CPU time, median of step pairs" in proc.stdout
