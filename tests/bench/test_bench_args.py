"""Counts the bench scripts take must be positive: 0 was read as "unset" (another step count ran silently) or
printed inf / nan tables."""
import argparse

import pytest

from benchlib import run
from moep_ds.distributed.commands import non_negative_int, positive_int


def test_count_types():
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    for parse, text in ((positive_int, "0"), (positive_int, "-2"), (non_negative_int, "-1")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize("script, args, message", [
    ("moe_layer.py", ["--experts", "0"], "argument --experts: 0 is not a positive integer"),
    ("moe_layer.py", ["--tables", "top2"], "--tables: top2 is printed with the expert choice row; add expert_choice"),
    ("gpu_mfu.py", ["--dry_run", "--steps", "0"], "argument --steps: 0 is not a positive integer"),
])
def test_bench_scripts_refuse_a_zero_count(script, args, message):
    with pytest.raises(AssertionError) as info:  # run() raises on a non-zero exit, with the output
        run(script, *args, timeout=120)
    assert f"{script} {tuple(args)} exited 2" in str(info.value) and str(info.value).rstrip().endswith(message)
