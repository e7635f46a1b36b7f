import json

import pytest

from moep_ds.errors import UserError
from moep_ds.cli import analyze_main as main
from moep_ds.training.analyze import analyze


def write_run(run, steps=20):
    metrics, util = [], []
    for step in range(1, steps + 1):
        metrics.append({"step": step, "loss": 5.0 - 0.1 * step, "ce_loss": 5.0 - 0.1 * step, "lr": 1e-3,
                        "tokens_per_s": 100.0})
        # expert 3 starves after step 10; layer 1 drops a decreasing share of tokens
        starving = [40.0, 30.0, 30.0, 0.0] if step > 10 else [25.0, 25.0, 25.0, 25.0]
        util.append({"step": step, "layers.1.tokens_per_expert": starving, "layers.1.dropped_fraction": 0.5 / step,
                     "layers.1.router_entropy": 1.2, "layers.3.tokens_per_expert": [10.0, 10.0]})
    util.append({"step": 12, "event": {"event": "replace", "layer": "blocks.1.moe", "expert": 3}})
    metrics.append({"step": 20, "val_loss": 3.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "expert_utilization.jsonl").write_text("".join(json.dumps(u) + "\n" for u in util))


def test_summary_drop_rates_loads_and_dead_experts(tmp_path):
    write_run(tmp_path)
    summary = analyze(tmp_path)
    layer = summary["layers"]["layers.1"]
    assert layer["drop_rate"]["peak"] == 0.5 and layer["drop_rate"]["final"] == pytest.approx(0.025)
    assert layer["drop_rate"]["average"] == pytest.approx(sum(0.5 / s for s in range(1, 21)) / 20)
    assert layer["expert_load_recent"] == [0.4, 0.3, 0.3, 0.0]
    assert layer["expert_load_mean"] == [0.325, 0.275, 0.275, 0.125]
    assert layer["dead_experts"] == [3]
    assert summary["layers"]["layers.3"]["dead_experts"] == []
    assert summary["lifecycle_events"] == 1 and summary["val_loss_final"] == 3.5
    assert summary["loss"] == {"first": pytest.approx(4.9), "final": pytest.approx(3.0)}
    out = tmp_path / "analysis"
    for name in ("summary.json", "summary.md", "loss.png", "expert_load_layers.1.png", "expert_load_layers.3.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_table_and_rejects_missing_run(tmp_path, capsys):
    write_run(tmp_path)
    assert main([str(tmp_path), "--no_plots"]) == 0
    assert "| layers.1 | 4 |" in capsys.readouterr().out
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: run directory {str(tmp_path / 'nope')!r} has no metrics.jsonl"
    with pytest.raises(UserError):
        analyze(tmp_path / "nope")
