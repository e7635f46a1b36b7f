"""Task YAML templates rendered against a data directory; moep-eval's one-line errors."""
import json

import pytest
import yaml

from moep_ds.data.builtin import PHENOMENA, pairs_per_phenomenon

from moep_ds.errors import UserError
from moep_ds.checkpointing.model_dir import save_model_dir
from moep_ds.cli.eval import main as eval_main
from moep_ds.evaluation.tasks import GRAMMAR_PAIRS, GRAMMAR_PAIRS_SEED, TEMPLATES, render_tasks, resolve_data_dir

from eval_models import tiny_model

TOP_LEVEL = ["arc_challenge", "arc_easy", "blimp_filtered", "blimp_supplement", "grammar_pairs", "lambada_openai",
             "logiqa", "piqa", "sciq", "winogrande", "wsc"]
NOT_OFFLINE = {"sciq", "winogrande"}  # no local copy in the shared data: --hub, or files placed in the data folder


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_each_rendered_subtask_reads_its_own_phenomenon(tmp_path):
    """_each.yaml is rendered once per line of subtasks.txt: task <family>_<line> reads <line>.jsonl, and the
    group lists the sub-tasks in that file's order."""
    rendered = render_tasks(tmp_path / "data", tmp_path / "tasks")
    for family in ("blimp_filtered", "blimp_supplement", "grammar_pairs"):
        lines = (TEMPLATES / family / "subtasks.txt").read_text().split()
        assert list(rendered.specs[family].subtasks) == [f"{family}_{line}" for line in lines]
        for line in lines:
            (data_file,) = rendered.specs[f"{family}_{line}"].data_files
            assert data_file.name == f"{line}.jsonl", (family, line, data_file)


def test_render_gives_every_task_absolute_data_paths(tmp_path):
    rendered = render_tasks(tmp_path / "data", tmp_path / "tasks")
    assert rendered.top_level == TOP_LEVEL
    assert len(rendered.specs["blimp_filtered"].subtasks) == 67
    assert len(rendered.specs["blimp_supplement"].subtasks) == 5
    files = sorted((tmp_path / "tasks").rglob("*.yaml"))
    assert len(files) == 67 + 5 + 2 + 8 + 7 + 1
    for f in files:
        cfg = yaml.load(f.read_text(), Loader=_Loader)  # noqa: S506
        home = tmp_path / "tasks" / "grammar_pairs" if f.parent.name == "grammar_pairs" else tmp_path / "data"
        for path in (cfg.get("dataset_kwargs") or {}).get("data_files", {}).values():
            assert path.startswith(str(home.resolve()) + "/"), (f, path)
    group = yaml.safe_load((tmp_path / "tasks" / "blimp_filtered" / "blimp_filtered.yaml").read_text())
    assert group["task"][0] == "blimp_filtered_adjunct_island"
    assert group["aggregate_metric_list"] == [{"metric": "acc", "aggregation": "mean", "weight_by_size": False}]
    assert (tmp_path / "tasks" / "wsc" / "utils.py").is_file()
    assert not (tmp_path / "tasks" / "blimp_filtered" / "_each.yaml").exists()


def test_lm_eval_indexes_the_rendered_folder(tmp_path):
    from lm_eval.tasks import TaskManager

    rendered = render_tasks(tmp_path / "data", tmp_path / "tasks")
    manager = TaskManager(include_defaults=False, include_path=str(rendered.path))
    assert set(rendered.specs) <= set(manager.all_tasks)
    assert "blimp_filtered" in manager.all_groups


def test_resolve_checks_names_and_data(tmp_path):
    rendered = render_tasks(tmp_path, tmp_path / "tasks")
    with pytest.raises(UserError, match=r"^unknown task 'blimp'; known: arc_challenge, arc_easy, blimp_filtered, "):
        rendered.resolve(["blimp"])
    with pytest.raises(UserError, match=rf"^task 'piqa' needs {tmp_path}/lm_eval_sets/piqa/piqa_validation.jsonl, "
                                        rf"which does not exist \(data directory {tmp_path}\)$"):
        rendered.resolve(["piqa"])
    with pytest.raises(UserError, match=r"^data directory '.*/nowhere' does not exist \(set --data_dir"):
        resolve_data_dir(tmp_path / "nowhere")


def test_every_local_task_has_its_data_in_the_shared_folder(shared_data, tmp_path):
    rendered = render_tasks(shared_data, tmp_path / "tasks")
    local = [t for t in TOP_LEVEL if t not in NOT_OFFLINE]
    assert rendered.resolve(local) == local
    assert sorted(p.stem for p in (shared_data / "babylm_eval" / "blimp_filtered").glob("*.jsonl")) == \
        sorted((TEMPLATES / "blimp_filtered" / "subtasks.txt").read_text().split())


def test_winogrande_and_sciq_read_local_files_with_lm_evals_prompts(tmp_path):
    from lm_eval.tasks import TaskManager

    from moep_ds.evaluation.tasks import HUB_TASKS

    wino = {"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
            "option1": "Sarah", "option2": "Maria", "answer": "1"}
    sciq = {"question": "What gas do plants absorb?", "distractor1": "oxygen", "distractor2": "helium",
            "distractor3": "neon", "correct_answer": "carbon dioxide", "support": " Plants take in carbon dioxide."}
    for folder, name, doc in (("winogrande", "winogrande_validation", wino), ("sciq", "sciq_test", sciq)):
        (tmp_path / "data" / "lm_eval_sets" / folder).mkdir(parents=True)
        (tmp_path / "data" / "lm_eval_sets" / folder / f"{name}.jsonl").write_text(json.dumps(doc) + "\n")
    rendered = render_tasks(tmp_path / "data", tmp_path / "tasks")
    assert rendered.resolve(["winogrande", "sciq"]) == ["winogrande", "sciq"]
    tasks = TaskManager(include_defaults=False, include_path=str(rendered.path)).load(["winogrande", "sciq"])["tasks"]
    w, s = tasks["winogrande"], tasks["sciq"]
    doc = next(iter(w.eval_docs))
    assert w.doc_to_choice(doc) == ["Sarah was a much better surgeon than Maria so Sarah",
                                    "Sarah was a much better surgeon than Maria so Maria"]
    assert (w.doc_to_text(doc), w.doc_to_target(doc)) == (0, "always got the harder cases.")
    doc = next(iter(s.eval_docs))
    assert s.doc_to_text(doc) == "Plants take in carbon dioxide.\nQuestion: What gas do plants absorb?\nAnswer:"
    assert s.doc_to_choice(doc)[s.doc_to_target(doc)] == "carbon dioxide"
    assert HUB_TASKS["winogrande"] == "winogrande" and HUB_TASKS["sciq"] == "sciq"


def test_moep_eval_errors_are_one_line(tmp_path, capsys):
    assert eval_main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"error: checkpoint '{tmp_path / 'missing'}' does not exist\n"
    model, cfg = tiny_model("dense_gpt2")
    ckpt = save_model_dir(model, cfg, tmp_path / "ckpt")
    assert eval_main([str(ckpt), "--tasks", "hellaswag", "--data_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown task 'hellaswag'; known: arc_challenge, arc_easy, blimp_filtered,")
    assert err.count("\n") == 1
    assert eval_main([str(ckpt), "--data_dir", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: data directory '{tmp_path / 'nowhere'}' does not exist")
    assert eval_main([]) == 2
    assert "moep-eval needs a checkpoint" in capsys.readouterr().err


def files_under(root):
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("extra, message", [
    (["--tasks", ""], "--tasks ('') names no task"),
    (["--limit", "-1"], "--limit (-1) must be a number > 0 (a fraction of each task if < 1)"),
    (["--limit", "0"], "--limit (0) must be a number > 0 (a fraction of each task if < 1)"),
    (["--limit", "inf"], "--limit (inf) must be a number > 0 (a fraction of each task if < 1)"),
    (["--batch_size", "0"], "--batch_size (0) must be >= 1"),
    (["--batch_size", "-4"], "--batch_size (-4) must be >= 1"),
    (["--num_fewshot", "-1"], "--num_fewshot (-1) must be >= 0"),
    (["--num_fewshot", "2"], "--num_fewshot (2): the local task files hold only the split that is scored, so the "
                             "examples would come from it; few-shot needs the hub tasks (--hub)"),
    (["--bootstrap_iters", "-5"], "--bootstrap_iters (-5) must be >= 0 (0: no stderrs)"),
    (["--device", "gpu0"], "--device ('gpu0') is not a torch device (e.g. cpu, cuda, cuda:1)"),
    (["--output", "{tmp}/a_file"], "--output ('{tmp}/a_file') exists and is not a directory"),
    (["--output", "{tmp}/a_file/out"],
     "--output ('{tmp}/a_file/out') cannot be created: '{tmp}/a_file' is not a directory"),
    ([], "--output ('{tmp}/ckpt/eval') exists and is not a directory"),  # the default, CHECKPOINT/eval
])
def test_moep_eval_refuses_bad_arguments_before_reading_the_checkpoint(tmp_path, capsys, monkeypatch, extra, message):
    import moep_ds.checkpointing.model_dir as model_dir
    import moep_ds.evaluation.partitioned as partitioned

    model, cfg = tiny_model("dense_gpt2")
    ckpt = save_model_dir(model, cfg, tmp_path / "ckpt")
    (tmp_path / "a_file").write_text("not a directory\n")
    if not extra:
        (ckpt / "eval").write_text("not a directory\n")
    before = files_under(tmp_path)
    for module, name in ((model_dir, "load_recipe"), (partitioned, "load_eval_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the checkpoint was read"))
    argv = [str(ckpt), "--tasks", "grammar_pairs", *(a.format(tmp=tmp_path) for a in extra)]
    assert eval_main(argv) == 2
    assert capsys.readouterr().err == f"error: {message.format(tmp=tmp_path)}\n"
    assert files_under(tmp_path) == before


def test_moep_eval_refuses_to_render_tasks_into_a_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory\n")
    before = files_under(tmp_path)
    assert eval_main(["--render_tasks", str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err == f"error: --render_tasks ('{tmp_path / 'a_file'}') exists and is not a directory\n"
    assert eval_main(["--render_tasks", str(tmp_path / "a_file" / "tasks")]) == 2
    assert capsys.readouterr().err == (f"error: --render_tasks ('{tmp_path / 'a_file' / 'tasks'}') cannot be created: "
                                       f"'{tmp_path / 'a_file'}' is not a directory\n")
    assert files_under(tmp_path) == before


def test_moep_eval_lists_tasks(capsys):
    assert eval_main(["--list_tasks"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "blimp_filtered  (67 sub-tasks)" and out[3] == "blimp_supplement  (5 sub-tasks)"
    assert out[4] == "grammar_pairs  (7 sub-tasks)"
    assert [line.split()[0] for line in out] == TOP_LEVEL


def test_grammar_pairs_are_generated_into_the_rendered_folder(tmp_path):
    rendered = render_tasks(tmp_path / "no_data_dir", tmp_path / "tasks")
    subtasks = rendered.specs["grammar_pairs"].subtasks
    assert list(subtasks) == [f"grammar_pairs_{p}" for p in PHENOMENA]
    assert (TEMPLATES / "grammar_pairs" / "subtasks.txt").read_text().split() == list(PHENOMENA)
    assert rendered.resolve(["grammar_pairs"]) == ["grammar_pairs"]  # its data needs no data directory
    folder = tmp_path / "tasks" / "grammar_pairs"
    for name in PHENOMENA:
        rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == GRAMMAR_PAIRS >= 200
        assert [r["pair_id"] for r in rows] == list(range(len(rows))) and {r["UID"] for r in rows} == {name}
        assert len({r["sentence_good"] for r in rows}) == len(rows)  # distinct pairs
        for r in rows:  # a minimal pair: the same length, one word flipped
            good, bad = r["sentence_good"][:-1].split(), r["sentence_bad"][:-1].split()
            assert len(good) == len(bad) and sum(g != b for g, b in zip(good, bad)) == 1, r
    # deterministic from the seed: a second rendering writes the same bytes; another seed other pairs
    again = render_tasks(tmp_path, tmp_path / "again")
    for name in PHENOMENA:
        assert (folder / f"{name}.jsonl").read_bytes() == (again.path / "grammar_pairs" / f"{name}.jsonl").read_bytes()
    other = pairs_per_phenomenon(20, seed=GRAMMAR_PAIRS_SEED + 1)
    fewer = pairs_per_phenomenon(20, seed=GRAMMAR_PAIRS_SEED)
    assert fewer["subject_verb_agreement"] != other["subject_verb_agreement"]
    first = json.loads((folder / "subject_verb_agreement.jsonl").read_text().splitlines()[0])
    assert first["sentence_good"] == fewer["subject_verb_agreement"][0]["sentence_good"]  # more pairs extend fewer


def test_tasks_that_need_the_missing_data_directory_say_so(tmp_path):
    rendered = render_tasks(tmp_path / "nowhere", tmp_path / "tasks")
    with pytest.raises(UserError, match=rf"^data directory '{tmp_path}/nowhere' does not exist \(set --data_dir, "
                                        r"eval.data_dir or MOEP_DATA_DIR\); task 'piqa' reads "):
        rendered.resolve(["grammar_pairs", "piqa"])


@pytest.mark.parametrize("damage", ["truncated_model_dir", "consolidated_export"])
def test_moep_eval_names_a_damaged_model_directory(tmp_path, capsys, damage):
    """A damaged checkpoint and a consolidated directory are one line each; nothing is written (--output stays
    absent)."""
    import eval_models

    ckpt, message = getattr(eval_models, damage)(tmp_path)
    before = files_under(tmp_path)
    assert eval_main([str(ckpt), "--tasks", "grammar_pairs", "--limit", "2", "--data_dir", str(tmp_path / "nowhere"),
                      "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert files_under(tmp_path) == before
