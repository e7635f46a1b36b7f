"""bench/gated_deltanet.py runs as documented: one row per length, equal outputs, the summary line."""
from benchlib import run, table_rows


def test_prints_both_times_per_length_and_the_ratio():
    proc = run("gated_deltanet.py", "--lengths", "64", "100", "--head_dim", "16", "--repeats", "1")
    rows = table_rows(proc.stdout)
    assert [row[0] for row in rows] == ["64", "100"]
    for row in rows:
        ours, theirs, ratio, per_1k, diff = (float(c) for c in row[1:])
        assert ours > 0 and theirs > 0 and abs(ratio - ours / theirs) < 0.01 + 0.05 * ratio and diff < 1e-5
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("T 100 ours / transformers: ") and last.endswith("x")
