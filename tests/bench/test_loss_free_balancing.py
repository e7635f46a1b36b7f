"""bench/loss_free_balancing.py: the load ratio from a utilisation log, and a toy end-to-end run of both arms."""
import json
import math

import pytest

from benchlib import load, run, table_rows

lfb = load("loss_free_balancing")


def test_load_ratio_sums_the_last_steps_per_layer(tmp_path):
    rows = [{"step": 1, "layers.1.tokens_per_expert": [100.0, 0.0, 0.0]},
            {"step": 2, "layers.1.tokens_per_expert": [3.0, 1.0, 2.0], "layers.2.tokens_per_expert": [1.0, 0.0]},
            {"step": 2, "event": {"event": "replace"}},
            {"step": 3, "layers.1.tokens_per_expert": [3.0, 2.0, 2.0], "layers.2.tokens_per_expert": [4.0, 0.0]}]
    (tmp_path / "expert_utilization.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ratios = lfb.load_ratios(tmp_path, last=2)
    assert ratios["layers.1"] == pytest.approx(6.0 / 3.0)
    assert math.isinf(ratios["layers.2"])


@pytest.mark.slow
def test_toy_run_prints_both_arms(tmp_path):
    proc = run("loss_free_balancing.py", "--steps", "4", "--last", "2", "--json", str(tmp_path / "r.json"),
               env={"PYTHONPATH": str(lfb.REPO)}, timeout=600)
    rows = {row[0]: row for row in table_rows(proc.stdout)}
    assert set(rows) == {"layers.1", "layers.2", "final loss"}
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["rate"] == 0.001 and result["steps"] == 4 and set(result["on"]) == {"layers.1", "layers.2"}
