"""A non-finite loss or gradient norm stops the run (Megatron's --check-for-nan-in-loss-and-grad): every rank stops
after that step together, with one line naming what was not finite, the step and the rank, and exit status 1; nothing
of that step is saved and no earlier checkpoint is rotated out; metrics.jsonl stays strict JSON. Faults are injected
on one rank (faults.py: nan, grad_inf); the ranks run in this test (tests/ranks.py). fp16 steps the loss scaler skips
go on (tests/training/test_train_distributed.py, fp16_runs)."""
import json
import pathlib

import pytest

from moep_ds.training.analyze import analyze
from tiny import DS_CONFIGS, run_pretrain, write_recipe

pytestmark = pytest.mark.slow


def refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def strict_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a JSON-lines file, read by a strict JSON reader (NaN, Infinity and -Infinity refused)."""
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def errors(ranks) -> list[str]:
    return [line for r in ranks for line in r.stderr.splitlines() if line.startswith("error:")]


def test_a_nan_loss_on_one_rank_stops_every_rank_after_that_step_saving_nothing_of_it(tmp_path):
    """Rank 1's loss of step 3 is nan (rank 0's is finite): both ranks stop after step 3 with status 1 and one line.
    The asynchronous save of step 2, still in flight when step 3 ends, completes; step 3 is not saved, so keep_last 2
    keeps steps 1 and 2 (a save of step 3 would have rotated step 1 out). Before, the run trained on to the end."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6,
                          checkpoint={"every_steps": 1, "keep_last": 2, "async_save": True})
    ranks = run_pretrain(2, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json"),
                         fault="nan", step=3, rank=1, check=False)
    assert [r.exitcode for r in ranks] == [1, 1], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    assert all("Traceback" not in r.stderr for r in ranks), ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    # the norm of a gradient with NaN in it: DeepSpeed's ZeRO-2 skips the update and reports inf
    assert errors(ranks) == ["error: non-finite loss (nan on rank 1) and gradient norm (inf) at step 3: training "
                             "stopped without saving step 3; the checkpoints before it are kept"]
    assert ranks[0].stderr.strip().splitlines()[-1] == errors(ranks)[0]
    assert "stopped at step" not in ranks[0].stderr  # not the stop-on-request message
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["loss"] is None and rows[2]["grad_norm"] is None  # written as null, not as a bare NaN
    assert all(isinstance(r["loss"], float) for r in rows[:2])
    strict_rows(out / "expert_utilization.jsonl")
    summary = analyze(out)  # moep-analyze reads the failed run's logs: the null loss is the failed step's
    assert summary["steps"] == 3 and summary["loss"] == {"first": rows[0]["loss"], "final": rows[1]["loss"]}


def test_an_infinite_gradient_norm_with_a_finite_loss_stops_the_run(tmp_path):
    """ZeRO-0 fp32 (the norm is ExactClipping's, distributed/grad_norm.py): the loss of step 2 is finite, its
    gradient infinite."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, checkpoint={"every_steps": 1, "keep_last": 1})
    [proc] = run_pretrain(1, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero0_fp32.json"),
                          fault="grad_inf", step=2, rank=0, check=False)
    assert proc.exitcode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = errors([proc])
    assert line.startswith("error: non-finite gradient norm (") and line.endswith(
        ") at step 2: training stopped without saving step 2; the checkpoints before it are kept"), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and isinstance(rows[1]["loss"], float)
