import json

import pytest

from moep_ds.errors import UserError
from moep_ds.cli.analyze import main
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


def test_dead_means_below_a_tenth_of_the_uniform_share_and_the_last_val_loss_is_final(tmp_path):
    """With 4 experts the uniform share is 25%: an expert at 5% (a fifth of it) is alive, one at 2% dead; the
    summary's val_loss_final is the last evaluation's, not the first."""
    metrics = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 11)]
    metrics += [{"step": 5, "val_loss": 4.5}, {"step": 10, "val_loss": 4.0}]
    util = [{"step": s, "layers.0.tokens_per_expert": [40.0, 33.0, 25.0, 2.0],
             "layers.1.tokens_per_expert": [40.0, 30.0, 25.0, 5.0]} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "expert_utilization.jsonl").write_text("".join(json.dumps(u) + "\n" for u in util))
    summary = analyze(tmp_path)
    assert summary["layers"]["layers.0"]["dead_experts"] == [3]
    assert summary["layers"]["layers.1"]["dead_experts"] == []
    assert summary["val_loss_final"] == 4.0


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


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, message):
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {message}"], err


def insert_line(path, number, line):
    """Put `line` in as line `number` (1-based) of the file, the rows after it moving down."""
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(number - 1, line + "\n")
    path.write_text("".join(lines))


ROW = '{"step": 3, "layers.1.tokens_per_expert": %s}'


@pytest.mark.parametrize("line,problem", [
    ("this is not json", "not valid JSON (Expecting value: column 1): 'this is not json'"),
    ('{"step": 3, "layers.1.tokens_per', """not valid JSON (Unterminated string starting at: column 13): \
'{"step": 3, "layers.1.tokens_per'"""),
    ("[1,2,3]", "expected a JSON object, got [1, 2, 3]"),
    ('{"step": 3, "layers": 5}', "key 'layers' is neither 'event' nor '<layer>.<statistic>'"),
    ('{"step": 3, "../x.tokens_per_expert": [1]}', "key '../x.tokens_per_expert' is neither 'event' nor "
                                                  "'<layer>.<statistic>'"),
    ('{"step": 3}', "no statistics and no event"),
    ('{"layers.1.tokens_per_expert": [1, 1, 1, 1]}', "no 'step'"),
    ('{"step": "3", "layers.1.tokens_per_expert": [1, 1, 1, 1]}', 'step ("3") must be a non-negative integer'),
    (ROW % '"abc"', 'layers.1.tokens_per_expert ("abc") must be a list of non-negative token counts'),
    (ROW % "[1, 2, -3, 4]", "layers.1.tokens_per_expert ([1, 2, -3, 4]) must be a list of non-negative token counts"),
    (ROW % "[1, 2, 3]", "layers.1.tokens_per_expert has 3 experts where the lines before have 4"),
    ('{"step": 3, "layers.1.dropped_fraction": [0.5]}', "layers.1.dropped_fraction ([0.5]) must be a number"),
    ('{"step": 3, "event": "replace"}', 'event ("replace") must be a JSON object'),
])
def test_bad_utilization_row_is_one_line_error_and_writes_nothing(tmp_path, capsys, line, problem):
    write_run(tmp_path)
    path = tmp_path / "expert_utilization.jsonl"
    insert_line(path, 3, line)  # in the middle: not what an interrupted run leaves
    code, out, err = run_cli(capsys, str(tmp_path))
    assert_one_line_error(code, err, f"{path}, line 3: {problem}")
    assert out == "" and not (tmp_path / "analysis").exists()


@pytest.mark.parametrize("line,problem", [
    ('{"step": 1, "loss": ', "not valid JSON (Expecting value: column 21): '{\"step\": 1, \"loss\": '"),
    ('{"step": 3, "loss": "abc"}', 'loss ("abc") must be a number'),
    ('{"step": 3, "val_loss": true}', "val_loss (true) must be a number"),  # null: a non-finite one (below)
])
def test_bad_metrics_row_is_one_line_error_and_writes_nothing(tmp_path, capsys, line, problem):
    write_run(tmp_path)
    insert_line(tmp_path / "metrics.jsonl", 2, line)
    code, _, err = run_cli(capsys, str(tmp_path))
    assert_one_line_error(code, err, f"{tmp_path / 'metrics.jsonl'}, line 2: {problem}")
    assert not (tmp_path / "analysis").exists()


def test_logs_that_are_not_files_are_errors(tmp_path, capsys):
    write_run(tmp_path)
    (tmp_path / "expert_utilization.jsonl").unlink()
    (tmp_path / "expert_utilization.jsonl").mkdir()
    code, _, err = run_cli(capsys, str(tmp_path))
    assert_one_line_error(code, err, f"{tmp_path / 'expert_utilization.jsonl'} is not a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expert_utilization.jsonl", "metrics.jsonl"]
    (tmp_path / "expert_utilization.jsonl").rmdir()
    (tmp_path / "analysis").write_text("mine")
    code, _, err = run_cli(capsys, str(tmp_path))
    assert_one_line_error(code, err, f"{tmp_path / 'analysis'} is not a directory")
    assert (tmp_path / "analysis").read_text() == "mine"
    (tmp_path / "analysis").unlink()
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    code, _, err = run_cli(capsys, str(tmp_path))
    assert_one_line_error(code, err, f"{tmp_path / 'metrics.jsonl'} is not a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_failed_analysis_leaves_an_earlier_one_as_it_was(tmp_path, capsys):
    write_run(tmp_path)
    analyze(tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "analysis").iterdir()}
    insert_line(tmp_path / "expert_utilization.jsonl", 21, "[]")  # after all of the layers' rows
    code, _, err = run_cli(capsys, str(tmp_path))
    path = tmp_path / "expert_utilization.jsonl"
    assert_one_line_error(code, err, f"{path}, line 21: expected a JSON object, got []")
    assert {p.name: p.read_bytes() for p in (tmp_path / "analysis").iterdir()} == before


def test_cut_off_last_lines_are_skipped_with_a_warning(tmp_path, caplog):
    write_run(tmp_path)
    expected = analyze(tmp_path, plots=False)
    cut = {"metrics.jsonl": '{"step": 21, "loss": 2.', "expert_utilization.jsonl": '{"step": 21, "layers.1.tok'}
    for name, text in cut.items():
        with open(tmp_path / name, "a") as f:
            f.write(text)  # a run killed in the middle of a write: no newline at the end
    with caplog.at_level("WARNING", logger="moep_ds.training.analyze"):
        assert analyze(tmp_path, plots=False) == expected
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'metrics.jsonl'}, line 22: skipped a cut-off last line (no newline at its end): "
        f"'{cut['metrics.jsonl']}'",
        f"{tmp_path / 'expert_utilization.jsonl'}, line 22: skipped a cut-off last line (no newline at its end): "
        f"'{cut['expert_utilization.jsonl']}'"]


def test_one_expert_count_may_be_a_bare_number(tmp_path):
    """monitor.split_stats writes a one-element statistic as a number: a 1-expert layer's tokens_per_expert."""
    write_run(tmp_path)
    insert_line(tmp_path / "expert_utilization.jsonl", 1, '{"step": 1, "layers.5.tokens_per_expert": 16.0}')
    layer = analyze(tmp_path, plots=False)["layers"]["layers.5"]
    assert layer["num_experts"] == 1 and layer["expert_load_mean"] == [1.0]


def test_the_trainers_closing_summary_warns_on_a_log_it_cannot_read(tmp_path, caplog):
    """The summary at the end of fit() is a convenience: training and checkpoints are complete by then, so a log
    that cannot be analysed is a warning there, not a failed run (moep-analyze itself exits 2)."""
    import types

    from moep_ds.training.trainer import Trainer

    write_run(tmp_path)
    with open(tmp_path / "expert_utilization.jsonl", "a") as f:
        f.write("not json\n")
    Trainer.log_analysis(types.SimpleNamespace(run_dir=tmp_path))
    assert "no utilisation summary: " in caplog.text and "line 22: not valid JSON" in caplog.text
    assert not (tmp_path / "analysis").exists()
