"""bench/gated_activation.py runs as documented and prints one row per size."""
from benchlib import load, run, table_rows


def test_prints_fused_and_unfused_times_per_size():
    proc = run("gated_activation.py", "--kind", "geglu", "--repeats", "1")
    rows = table_rows(proc.stdout)
    assert len(rows) == len(load("gated_activation").SIZES)
    for row in rows:
        unfused, fused, ratio = float(row[1]), float(row[2]), float(row[3])
        assert unfused > 0 and fused > 0 and abs(ratio - fused / unfused) < 0.01 + 0.01 * ratio
