"""bench/gated_deltanet.py runs as documented: one row per length, equal outputs, the summary line."""
from benchlib import run, table_rows


def test_prints_both_times_per_length_and_the_ratio():
    proc = run("gated_deltanet.py", "--lengths", "64", "100", "--head_dim", "16", "--repeats", "1")
    rows = table_rows(proc.stdout)
    assert [row[0] for row in rows] == ["64", "100"]
    for row in rows:
        ours, theirs, ratio, per_1k, diff = (float(c) for c in row[1:])
        # the times are printed to 0.1 ms (toy sizes: about 1 ms), the ratio of the unrounded ones to 0.01
        rounding = 0.05 / theirs + 0.05 * ours / theirs ** 2 + 0.005
        assert ours > 0 and theirs > 0 and abs(ratio - ours / theirs) <= rounding * 1.01 and diff < 1e-5
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("T 100 ours / transformers: ") and last.endswith("x")
