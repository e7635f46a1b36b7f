"""downstream_eval (training/callbacks/downstream_eval.py) on the quick-start recipe: eval/grammar_pairs/acc logged at
the steps asked, equal to moep-eval's on the checkpoint of the same step; on 2 processes the split over the ranks
gives moep-eval's number too."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/training: tiny.py

from tiny import REPO, metrics, run_pretrain  # noqa: E402

LIMIT = 6  # examples per grammar_pairs phenomenon


def quickstart(nproc: int, out: pathlib.Path) -> None:
    callbacks = f"train.callbacks=[{{type: downstream_eval, tasks: [grammar_pairs], every: 10, limit: {LIMIT}}}]"
    run_pretrain(nproc, "--config", str(REPO / "configs" / "quickstart.yaml"), "--ds_config",
                 str(REPO / "ds_configs" / "quickstart.json"), "--set", f"train.output_dir={out}",
                 "model.layers[0].repeat=1", "train.max_steps=20", "train.eval_every=null",
                 "train.checkpoint.every_steps=10", "train.checkpoint.keep_last=2", callbacks, timeout=900)


def moep_eval(ckpt: pathlib.Path, out: pathlib.Path) -> float:
    from moep_ds.cli.eval import main

    assert main([str(ckpt), "--tasks", "grammar_pairs", "--limit", str(LIMIT), "--bootstrap_iters", "0",
                 "--data_dir", str(out / "nowhere"), "--output", str(out)]) == 0
    return json.loads((out / "results.json").read_text())["scores"]["grammar_pairs"]["acc"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_downstream_eval_logs_moep_evals_accuracy_at_the_steps_asked(tmp_path, nproc):
    run = tmp_path / "run"
    quickstart(nproc, run)
    rows = {m["step"]: m for m in metrics(run) if "eval/grammar_pairs/acc" in m}
    assert sorted(rows) == [10, 20]
    accs = {}
    for step in (10, 20):
        accs[step] = moep_eval(run / "checkpoints" / f"step_{step:08d}", tmp_path / f"eval{step}")
        assert rows[step]["eval/grammar_pairs/acc"] == pytest.approx(accs[step], abs=1e-9), step
        # the per-phenomenon scores are logged too
        assert sum(k.startswith("eval/grammar_pairs_") for k in rows[step]) > 1
    events = tensorboard_tags(run)
    assert "eval/grammar_pairs/acc" in events


def tensorboard_tags(run: pathlib.Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for path in run.rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_an_unknown_task_fails_at_the_first_step_naming_it(tmp_path):
    import types

    from moep_ds.errors import UserError
    from moep_ds.training.callbacks import StepEvent, build_callback, parse_callback

    callback = build_callback(parse_callback({"type": "downstream_eval", "tasks": ["grammar_pairs", "no_such_task"]},
                                             "train.callbacks[0]"))
    callback.trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(eval=types.SimpleNamespace(data_dir=None)))
    with pytest.raises(UserError, match="no_such_task"):
        callback.before_step(StepEvent(1))
