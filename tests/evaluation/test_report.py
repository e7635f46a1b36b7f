"""Results records, markdown tables, the comparison report and the published reference numbers."""
import importlib.util
import json
import math

import pytest

from moep_ds.evaluation.report import (
    comparison_markdown, flat_scores, load_records, load_reference, merge_records, record_problem, results_markdown,
)

from repo_paths import REPO

REFERENCE = REPO / "eval" / "reference" / "pythia-1b.json"
LM_EVAL_OUT = {
    "results": {
        "blimp_filtered": {"alias": "blimp_filtered", "acc,none": 0.6, "acc_stderr,none": "N/A", "sample_len": 9},
        "blimp_filtered_x": {"acc,none": 0.5, "acc_stderr,none": 0.1},
        "lambada_openai": {"perplexity,none": 40.5, "perplexity_stderr,none": 2.0, "acc,none": 0.25},
        "piqa": {"acc,none": 0.61, "acc_norm,none": 0.6},
    },
    "groups": {"blimp_filtered": {"acc,none": 0.6}},
}


def record(name, scale, active):
    scores = {t: {m: v * scale for m, v in ms.items()} for t, ms in flat_scores(LM_EVAL_OUT).items()}
    return {"name": name, "scores": scores,
            "moep": {"tasks": ["blimp_filtered", "lambada_openai", "piqa"], "params_total": 1000, "params_active": active,
                     "tokens": 10_000, "flops_per_token": 6000.0, "routing_eval_mode": "threshold",
                     "model_dir": "m", "step": 1}}


def test_flat_scores_drop_filters_and_non_numbers():
    scores = flat_scores(LM_EVAL_OUT)
    assert scores["blimp_filtered"] == {"acc": 0.6}
    assert scores["blimp_filtered_x"] == {"acc": 0.5, "acc_stderr": 0.1}
    assert scores["lambada_openai"] == {"perplexity": 40.5, "perplexity_stderr": 2.0, "acc": 0.25}


def test_flat_scores_keep_a_group_score_reported_under_groups_only():
    """lm-eval puts a group's aggregate (BLiMP over its 67 sub-tasks) under "groups"; it is the score the report
    shows for the group."""
    out = {"results": {"blimp_filtered_x": {"acc,none": 0.5}, "blimp_filtered_y": {"acc,none": 0.7}},
           "groups": {"blimp_filtered": {"acc,none": 0.6, "acc_stderr,none": 0.01}}}
    assert flat_scores(out) == {"blimp_filtered_x": {"acc": 0.5}, "blimp_filtered_y": {"acc": 0.7},
                                "blimp_filtered": {"acc": 0.6, "acc_stderr": 0.01}}


def test_comparison_against_a_named_baseline_that_is_not_the_first_run():
    dense, moe = record("dense", 1.0, 1000), record("moe", 1.1, 250)
    md = comparison_markdown([dense, moe], baseline="moe")
    assert "## Against moe" in md
    cols = [("blimp_filtered", "acc"), ("lambada_openai", "acc"), ("lambada_openai", "perplexity"), ("piqa", "acc")]
    diffs = [(1 if m == "perplexity" else 100) * (dense["scores"][t][m] - moe["scores"][t][m]) for t, m in cols]
    row = "| dense | 1.000 | 4.000 | " + " | ".join(f"{d:+.2f}" for d in diffs) + " |"
    assert row in md.splitlines()
    assert all(d < 0 for d in diffs)  # the baseline scores 10% higher everywhere


def test_results_markdown_lists_every_metric_with_the_routing_mode():
    md = results_markdown(record("run", 1.0, 1000))
    assert "routing eval mode: threshold" in md
    assert "| lambada_openai | perplexity | 40.50 | 2.00 |" in md
    assert "| piqa | acc_norm | 60.00 | – |" in md


def evaluation(tasks, scores, mode, step=5, subtasks=None):
    """A moep-eval record of `tasks` scored `scores` ({task: acc}), under routing eval mode `mode`."""
    lm_eval = {"results": {t: {"acc,none": a} for t, a in scores.items()}, "group_subtasks": subtasks or {},
               "versions": {t: 1 for t in scores}, "config": {"routing_eval_mode": mode}}
    return {"name": "run", "scores": flat_scores(lm_eval),
            "moep": {"tasks": tasks, "routing_eval_mode": mode, "step": step, "limit": None, "model_dir": "m"},
            "lm_eval": lm_eval}


def test_a_second_evaluation_merges_per_task_and_the_newest_wins():
    """`moep-eval --tasks grammar_pairs` then `--tasks wsc` into one folder kept only wsc (issue #46 item 7)."""
    first = merge_records(None, evaluation(["grammar_pairs"], {"grammar_pairs": 0.6, "grammar_pairs_a": 0.5,
                                                               "grammar_pairs_b": 0.7}, "threshold",
                                           subtasks={"grammar_pairs": ["grammar_pairs_a", "grammar_pairs_b"]}))
    assert first["evaluations"] == {"grammar_pairs": {"routing_eval_mode": "threshold", "step": 5, "limit": None,
                                                      "model_dir": "m",
                                                      "lm_eval_config": {"routing_eval_mode": "threshold"}}}
    both = merge_records(first, evaluation(["wsc"], {"wsc": 0.4}, "topk", step=6))
    assert both["moep"]["tasks"] == ["grammar_pairs", "wsc"] and record_problem(both) is None
    assert {t: m["acc"] for t, m in both["scores"].items()} == {"grammar_pairs": 0.6, "grammar_pairs_a": 0.5,
                                                                "grammar_pairs_b": 0.7, "wsc": 0.4}
    # what produced each task's number stays with it; the record's own mode says they differ
    assert both["evaluations"]["grammar_pairs"]["routing_eval_mode"] == "threshold"
    assert (both["evaluations"]["wsc"]["routing_eval_mode"], both["evaluations"]["wsc"]["step"]) == ("topk", 6)
    assert both["moep"]["routing_eval_mode"] == "mixed" and both["moep"]["step"] == 6
    assert set(both["lm_eval"]["results"]) == set(both["scores"]) and both["lm_eval"]["versions"]["grammar_pairs"] == 1
    md = results_markdown(both)
    assert "| grammar_pairs | 5 | threshold |" in md and "| wsc | 6 | topk |" in md
    # grammar_pairs again, now with one sub-task only: the group's old sub-tasks go with it
    again = merge_records(both, evaluation(["grammar_pairs"], {"grammar_pairs": 0.9, "grammar_pairs_a": 0.9},
                                           "topk", step=7, subtasks={"grammar_pairs": ["grammar_pairs_a"]}))
    assert {t: m["acc"] for t, m in again["scores"].items()} == {"wsc": 0.4, "grammar_pairs": 0.9,
                                                                 "grammar_pairs_a": 0.9}
    assert again["moep"]["tasks"] == ["wsc", "grammar_pairs"] and again["moep"]["routing_eval_mode"] == "topk"
    assert [again["evaluations"][t]["step"] for t in ("wsc", "grammar_pairs")] == [6, 7]
    assert again["lm_eval"]["group_subtasks"] == {"grammar_pairs": ["grammar_pairs_a"]}
    # a sub-task evaluated alone, then its group: the group's evaluation covers it
    alone = merge_records(None, evaluation(["grammar_pairs_b"], {"grammar_pairs_b": 0.1}, "topk"))
    assert merge_records(alone, first)["moep"]["tasks"] == ["grammar_pairs"]


def test_comparison_puts_runs_beside_references_and_against_the_baseline(tmp_path):
    runs = [record("dense", 1.0, 1000), record("moe", 1.1, 250)]
    md = comparison_markdown(runs + load_reference(REFERENCE), baseline="dense")
    header = md.splitlines()[4]
    assert header.split(" | ")[6:] == ["blimp_filtered acc", "lambada_openai acc", "lambada_openai perplexity ↓",
                                       "piqa acc |"]
    assert "| dense | 1K | 1K | 10K | 6.00e+07 | threshold | 60.00 | 25.00 | 40.50 | 61.00 |" in md
    assert "| Pythia-1B (published) | 1.01B | 1.01B | 300B | 1.88e+21 | – | – | 56.20 | 7.92 | 70.73 |" in md
    assert ("| BabyLM 2025 GPT-2 small, strict-small (10M words) (published) | 124M | 124M | – | – | – | 67.29 | – | – "
            "| – |") in md
    assert "| moe | 1.000 | 0.250 | +6.00 | +2.50 | +4.05 | +6.10 |" in md


def test_compare_script_writes_markdown_and_png(tmp_path, capsys):
    paths = []
    for r in (record("dense", 1.0, 1000), record("moe", 1.1, 250)):
        (tmp_path / r["name"]).mkdir()
        paths.append(tmp_path / r["name"] / "results.json")
        paths[-1].write_text(json.dumps(r))
    assert [r["name"] for r in load_records(paths)] == ["dense", "moe"]
    spec = importlib.util.spec_from_file_location("compare", REPO / "eval" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    assert compare.main([*map(str, paths), "--out", str(tmp_path / "report")]) == 0
    assert "## Against dense" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.main([str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.startswith("error: results file(s) not found")


def test_reference_numbers_match_the_published_pythia_file(shared_data):
    published = json.loads((shared_data / "reference" / "pythia" /
                            "pythia-v1__pythia-1b-bf16__zero-shot__1b-bf16_step143000.json").read_text())["results"]
    pythia = json.loads(REFERENCE.read_text())["models"][0]
    assert pythia["source"]["path"].endswith("1b-bf16_step143000.json")
    for task, metrics in pythia["scores"].items():
        for metric, value in metrics.items():
            source = published[task]["ppl" if metric == "perplexity" else metric]
            assert value == pytest.approx(source, abs=6e-4), (task, metric)


def load_compare():
    spec = importlib.util.spec_from_file_location("compare", REPO / "eval" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare


STEP_TOKENS = 1024 * 2048


def test_compare_puts_pythia_beside_a_run_at_equal_tokens(tmp_path, capsys):
    run = record("moe", 1.0, 250)
    run["moep"]["tokens"] = 13_000 * STEP_TOKENS
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "results.json").write_text(json.dumps(run))
    assert load_compare().main([str(tmp_path / "moe" / "results.json"), "--out", str(tmp_path / "report")]) == 0
    md = capsys.readouterr().out
    # columns: lambada acc, lambada perplexity, piqa acc (blimp first: no Pythia number)
    assert ("| Pythia-1B @ 27.3B tokens (step 13000) (published) | 1.01B | 1.01B | 27.3B | 1.71e+20 | – | – | "
            "44.56 | 15.20 | 66.05 |") in md
    assert ("| Pythia-1B-deduped @ 27.3B tokens (step 13000) (published) | 1.01B | 1.01B | 27.3B | 1.71e+20 | – | "
            "– | 43.68 | 15.89 | 65.83 |") in md
    assert "| Pythia-1B (published) | 1.01B | 1.01B | 300B | 1.88e+21 | – | – | 56.20 | 7.92 | 70.73 |" in md


def test_equal_token_rows_interpolate_in_log_tokens_and_stop_at_the_last_checkpoint():
    compare = load_compare()
    curve = json.loads(compare.CURVE.read_text())
    bf16 = {p["step"]: p["scores"] for p in curve["models"][0]["points"]}
    between = round(math.sqrt(3000 * 13000) * STEP_TOKENS)  # the log-midpoint of steps 3000 and 13000
    late = 150_000 * STEP_TOKENS
    rows = compare.equal_token_records([{"moep": {"tokens": between}}, {"moep": {"tokens": late}}], compare.CURVE)
    at = {3000: 3000 * STEP_TOKENS / 1e9, 13000: 13000 * STEP_TOKENS / 1e9, None: between / 1e9}
    # the nearest published steps as published, the interpolation between them; nothing past step 143000
    assert [r["name"] for r in rows] == [
        f"Pythia-1B @ {at[3000]:.3g}B tokens (step 3000, the nearest published below)",
        f"Pythia-1B-deduped @ {at[3000]:.3g}B tokens (step 3000, the nearest published below)",
        f"Pythia-1B @ {at[None]:.3g}B tokens (interpolated in log-tokens between steps 3000 and 13000)",
        f"Pythia-1B-deduped @ {at[None]:.3g}B tokens (interpolated in log-tokens between steps 3000 and 13000)",
        f"Pythia-1B @ {at[13000]:.3g}B tokens (step 13000, the nearest published above)",
        f"Pythia-1B-deduped @ {at[13000]:.3g}B tokens (step 13000, the nearest published above)"]
    piqa = (bf16[3000]["piqa"]["acc"] + bf16[13000]["piqa"]["acc"]) / 2
    assert rows[2]["scores"]["piqa"]["acc"] == pytest.approx(piqa, abs=1e-9)
    assert rows[2]["moep"]["tokens"] == between and rows[2]["reference"]
    assert (rows[0]["scores"], rows[0]["moep"]["tokens"]) == (bf16[3000], 3000 * STEP_TOKENS)
    assert (rows[4]["scores"], rows[4]["moep"]["tokens"]) == (bf16[13000], 13000 * STEP_TOKENS)


def test_equal_token_rows_between_steps_0_and_1_say_they_interpolate_linearly_in_tokens():
    """log(0) has no value: below step 1 the rows interpolate linearly in tokens, and say so."""
    compare = load_compare()
    bf16 = {p["step"]: p["scores"] for p in json.loads(compare.CURVE.read_text())["models"][0]["points"]}
    quarter = compare.equal_token_records([{"moep": {"tokens": STEP_TOKENS // 4}}], compare.CURVE)[2]
    assert quarter["name"] == (f"Pythia-1B @ {STEP_TOKENS / 4 / 1e9:.3g}B tokens (interpolated linearly in tokens "
                               "between steps 0 and 1)")
    expected = 0.75 * bf16[0]["piqa"]["acc"] + 0.25 * bf16[1]["piqa"]["acc"]
    assert quarter["scores"]["piqa"]["acc"] == pytest.approx(expected, abs=1e-12)


def test_a_branched_run_stands_beside_pythias_nearest_steps_and_its_dense_control(tmp_path, capsys):
    """A run branched from Pythia's step 13000 and trained 1,000 steps records (13000 + 1000) x 2,097,152 tokens:
    the report puts it beside Pythia at the published steps around that count, and against the dense branch."""
    paths = []
    for name, scale in (("branch_dense", 1.0), ("branch_moe", 1.1)):
        run = record(name, scale, 1000)
        run["moep"]["tokens"] = (13_000 + 1_000) * STEP_TOKENS
        (tmp_path / name).mkdir()
        paths.append(str(tmp_path / name / "results.json"))
        (tmp_path / name / "results.json").write_text(json.dumps(run))
    assert load_compare().main([*paths, "--baseline", "branch_dense", "--out", str(tmp_path / "report")]) == 0
    md = capsys.readouterr().out
    rows = [line.split(" | ")[0][2:] for line in md.splitlines() if line.startswith("| Pythia-1B @")]
    assert rows == ["Pythia-1B @ 27.3B tokens (step 13000, the nearest published below) (published)",
                    "Pythia-1B @ 29.4B tokens (interpolated in log-tokens between steps 13000 and 23000) (published)",
                    "Pythia-1B @ 48.2B tokens (step 23000, the nearest published above) (published)"]
    assert "| branch_dense | 1K | 1K | 29.4B |" in md and "## Against branch_dense" in md
    assert "| branch_moe | 1.000 | 1.000 |" in md


def test_references_without_a_comparable_score_are_left_out(tmp_path, capsys):
    """A run scored on BLiMP alone: Pythia has no BLiMP number, so its rows (final and equal-token) would be all
    dashes; they are left out, the BabyLM row (a BLiMP score) stays."""
    run = record("blimp_only", 1.0, 1000)
    run["scores"] = {"blimp_filtered": run["scores"]["blimp_filtered"]}
    run["moep"]["tasks"] = ["blimp_filtered"]
    run["moep"]["tokens"] = 13_000 * STEP_TOKENS
    (tmp_path / "r.json").write_text(json.dumps(run))
    assert load_compare().main([str(tmp_path / "r.json"), "--out", str(tmp_path / "report")]) == 0
    md = capsys.readouterr().out
    assert "Pythia" not in md
    assert "| BabyLM 2025 GPT-2 small, strict-small (10M words) (published) |" in md


def test_chart_legend_stands_beside_the_axes(tmp_path, monkeypatch):
    """The legend used to sit on the axes, over the top of a bar and the y axis: now it is right of them, and the
    y range leaves room above the highest bar."""
    import matplotlib.pyplot as plt

    from moep_ds.evaluation.report import comparison_chart

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    records = [record("dense", 1.0, 1000), record("moe", 1.5, 250)] + load_reference(REFERENCE)
    comparison_chart(records, tmp_path / "report.png")
    (fig,) = figures
    (ax,) = fig.axes
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1
    highest = max(v for bars in ax.containers for v in bars.datavalues if not math.isnan(v))
    assert highest == pytest.approx(100 * 0.61 * 1.5) and ax.get_ylim()[1] > highest
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["dense", "moe", "Pythia-1B", "BabyLM 2025 GPT-2 small, strict-small (10M words)"]
    close(fig)


def test_shipped_curve_is_derived_from_the_published_files(shared_data):
    spec = importlib.util.spec_from_file_location("pythia_curve", REPO / "eval" / "reference" / "pythia_curve.py")
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    derived = curve.derive(shared_data / "reference" / "pythia" / "curve")
    assert derived == json.loads((REPO / "eval" / "reference" / "pythia-1b-curve.json").read_text())
    assert [len(m["points"]) for m in derived["models"]] == [27, 27]
    assert derived["models"][0]["points"][-1]["tokens"] == 143_000 * STEP_TOKENS


# ---- eval/compare.py on bad input: one line, exit status 2, no --out folder -----------------------------------


def assert_one_line_error(code, err, message):
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {message}"], err


def snapshot(root):
    """Every path under `root` with its bytes (None for folders): what a refused comparison must leave alone."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


GOOD = json.dumps(record("dense", 1.0, 1000))
CURVE_POINT = {"step": 1, "tokens": STEP_TOKENS, "scores": {"piqa": {"acc": 0.5}}}


@pytest.mark.parametrize("files,options,message", [
    ({"r.json": '{"name": "x", "scores": \n'}, [], "results file '{r.json}' is not valid JSON (Expecting value: "
                                                   "line 2 column 1)"),
    ({"r.json": ""}, [], "results file '{r.json}' is empty"),
    ({"r.json": "[1, 2, 3]"}, [], "results file '{r.json}' must hold a JSON object, not [1, 2, 3]"),
    ({"r.json": '{"name": "noscores"}'}, [],
     "results file '{r.json}': no 'scores' (moep-eval's results.json has {task: {metric: number}} there)"),
    ({"r.json": '{"name": "s", "scores": {"piqa": {"acc": "high"}}}'}, [],
     "results file '{r.json}': scores.piqa.acc (\"high\") must be a number"),
    ({"r.json": '{"scores": {}, "moep": {"tokens": "1B"}}'}, [],
     "results file '{r.json}': moep.tokens (\"1B\") must be a number"),
    ({"r.json": GOOD}, ["--reference", "{tmp}/nope.json"], "--reference '{tmp}/nope.json' does not exist"),
    ({"r.json": GOOD}, ["--curve", "{tmp}/nope.json"], "--curve '{tmp}/nope.json' does not exist"),
    ({"r.json": GOOD, "ref.json": '{"foo": 1}'}, ["--reference", "{ref.json}"],
     "--reference '{ref.json}': no 'models' (a list of models with their scores)"),
    ({"r.json": GOOD, "ref.json": '{"models": [{"name": "P"}]}'}, ["--reference", "{ref.json}"],
     "--reference '{ref.json}': models[0] has no 'scores'"),
    ({"r.json": GOOD, "c.json": json.dumps({"models": [{"name": "C", "points": [{**CURVE_POINT, "tokens": "abc"}]}]})},
     ["--curve", "{c.json}"], "--curve '{c.json}': models[0].points[0].tokens (\"abc\") must be a number >= 0"),
    ({"r.json": GOOD, "c.json": json.dumps({"models": [{"name": "C", "points": [CURVE_POINT, CURVE_POINT]}]})},
     ["--curve", "{c.json}"],
     f"--curve '{{c.json}}': models[0].points[1].tokens ({STEP_TOKENS}) must exceed the previous point's "
     f"({STEP_TOKENS})"),
    ({"r.json": GOOD}, ["--baseline", "nosuchrun"], "--baseline ('nosuchrun') names no run; the runs are 'dense'"),
    # two runs of one name: --baseline took the first of them, and their rows could not be told apart
    ({"r.json": GOOD, "r2.json": GOOD}, ["{r2.json}"],
     "results file '{r2.json}': name ('dense') is also that of '{r.json}'; runs need names of their own "
     "(moep-eval --name)"),
    ({"r.json": GOOD}, ["{r.json}"], "results file '{r.json}' is given twice"),
    ({"r.json": GOOD}, ["{tmp}/./r.json"], "results file '{tmp}/./r.json' is given twice"),  # one file, two spellings
    # an empty list gave a report without the rows and no word why
    ({"r.json": GOOD, "ref.json": '{"models": []}'}, ["--reference", "{ref.json}"],
     "--reference '{ref.json}': models ([]) lists no model (--reference '' leaves the file out)"),
    ({"r.json": GOOD, "c.json": '{"models": []}'}, ["--curve", "{c.json}"],
     "--curve '{c.json}': models ([]) lists no model (--curve '' leaves the file out)"),
    ({"r.json": GOOD, "afile": "x"}, ["--out", "{afile}"], "--out ('{afile}') exists and is not a directory"),
    ({"r.json": GOOD, "afile": "x"}, ["--out", "{afile}/sub"],
     "--out ('{afile}/sub') cannot be created: '{afile}' is not a directory"),
])
def test_compare_refuses_bad_input_in_one_line_before_writing(tmp_path, capsys, files, options, message):
    def fill(text):  # {tmp} is tmp_path, {r.json} that file's path
        for name in files:
            text = text.replace(f"{{{name}}}", str(tmp_path / name))
        return text.replace("{tmp}", str(tmp_path))

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    options = [fill(o) for o in options]
    if "--out" not in options:
        options += ["--out", str(tmp_path / "report")]
    before = snapshot(tmp_path)
    code = load_compare().main([str(tmp_path / "r.json"), *options])
    assert_one_line_error(code, capsys.readouterr().err, fill(message))
    assert snapshot(tmp_path) == before


def test_compare_that_fails_writing_leaves_no_out_folder_and_old_reports_alone(tmp_path, capsys, monkeypatch):
    (tmp_path / "r.json").write_text(GOOD)
    compare = load_compare()

    def full_disk(records, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compare, "comparison_chart", full_disk)
    code = compare.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "new" / "report")])
    assert_one_line_error(code, capsys.readouterr().err,
                          f"--out ('{tmp_path}/new/report') cannot be written: No space left on device")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.md").write_text("earlier report")
    assert compare.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "old")]) == 2
    assert snapshot(tmp_path / "old") == {"report.md": b"earlier report"}


# ---- eval/reference/pythia_curve.py on bad input: one line, exit status 2, --out left as it was -----------------


def load_pythia_curve():
    spec = importlib.util.spec_from_file_location("pythia_curve", REPO / "eval" / "reference" / "pythia_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


POINT_FILE = "pythia-v1__pythia-1b-bf16__zero-shot__1b-bf16_step1000.json"
POINT = {"config": {"num_fewshot": 0}, "results": {"piqa": {"acc": 0.6}}}


@pytest.mark.parametrize("text,message", [
    ('{"config":{\n', "--curve file '{file}' is not valid JSON (Expecting property name enclosed in double quotes: "
                      "line 2 column 1)"),
    ('{"config": {}}', "--curve file '{file}': no 'results' (not an lm-eval results file)"),
    (json.dumps({**POINT, "config": {"num_fewshot": 5}}),
     "--curve file '{file}': num_fewshot 5, the curve is zero-shot"),
    (json.dumps({**POINT, "results": {"piqa": {"acc": "0.6"}}}),
     "--curve file '{file}': results.piqa.acc (\"0.6\") must be a number"),
    (None, "--curve ('{dir}') has no result files of pythia-1b-bf16, pythia-1b-deduped "
           "(pythia-v1__<model>__zero-shot__<name>_step<N>.json)"),
])
def test_pythia_curve_refuses_bad_result_files_and_keeps_the_old_curve(tmp_path, capsys, text, message):
    curve_dir = tmp_path / "curve"
    curve_dir.mkdir()
    if text is not None:
        (curve_dir / POINT_FILE).write_text(text)
    (tmp_path / "out.json").write_text("old curve")
    before = snapshot(tmp_path)
    code = load_pythia_curve().main(["--curve", str(curve_dir), "--out", str(tmp_path / "out.json")])
    expected = message.replace("{file}", str(curve_dir / POINT_FILE)).replace("{dir}", str(curve_dir))
    assert_one_line_error(code, capsys.readouterr().err, expected)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("out,message", [
    ("nodir/out.json", "--out ('{tmp}/nodir/out.json') cannot be written: folder '{tmp}/nodir' does not exist"),
    ("curve", "--out ('{tmp}/curve') is a folder; name the JSON file to write"),
])
def test_pythia_curve_refuses_an_out_it_cannot_write(tmp_path, capsys, out, message):
    (tmp_path / "curve").mkdir()
    (tmp_path / "curve" / POINT_FILE).write_text(json.dumps(POINT))
    before = snapshot(tmp_path)
    code = load_pythia_curve().main(["--curve", str(tmp_path / "curve"), "--out", str(tmp_path / out)])
    assert_one_line_error(code, capsys.readouterr().err, message.replace("{tmp}", str(tmp_path)))
    assert snapshot(tmp_path) == before


def test_pythia_curve_that_fails_writing_leaves_the_old_file_whole(tmp_path, capsys, monkeypatch):
    for name in (POINT_FILE, POINT_FILE.replace("1b-bf16", "1b-deduped")):
        (tmp_path / name).write_text(json.dumps(POINT))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "curve.json").write_text("old curve")
    curve = load_pythia_curve()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(curve.os, "replace", full_disk)
    code = curve.main(["--curve", str(tmp_path), "--out", str(tmp_path / "out" / "curve.json")])
    assert_one_line_error(code, capsys.readouterr().err,
                          f"--out ('{tmp_path}/out/curve.json') cannot be written: No space left on device")
    assert snapshot(tmp_path / "out") == {"curve.json": b"old curve"}
    monkeypatch.undo()
    assert curve.main(["--curve", str(tmp_path), "--out", str(tmp_path / "out" / "curve.json")]) == 0
    written = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert [[p["step"] for p in m["points"]] for m in written["models"]] == [[1000], [1000]]


def test_an_unreadable_results_file_is_one_line(tmp_path, monkeypatch):
    import pathlib

    from moep_ds.errors import UserError
    from moep_ds.evaluation.report import read_json_object

    path = tmp_path / "results.json"
    path.write_text("{}")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "read_text", denied)
    with pytest.raises(UserError, match=rf"results file '{path}' cannot be read: Permission denied$"):
        read_json_object(path, "results file")
