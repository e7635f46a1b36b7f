"""Task YAML templates rendered against a data directory; moep-eval's one-line errors."""
import pytest
import yaml

from moep_ds.errors import UserError
from moep_ds.checkpointing.model_dir import save_model_dir
from moep_ds.evaluation.run_eval import main as eval_main
from moep_ds.evaluation.tasks import TEMPLATES, render_tasks, resolve_data_dir

from eval_models import tiny_model

TOP_LEVEL = ["arc_challenge", "arc_easy", "blimp_filtered", "blimp_supplement", "lambada_openai", "logiqa", "piqa", "wsc"]


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_render_gives_every_task_absolute_data_paths(tmp_path):
    rendered = render_tasks(tmp_path / "data", tmp_path / "tasks")
    assert rendered.top_level == TOP_LEVEL
    assert len(rendered.specs["blimp_filtered"].subtasks) == 67
    assert len(rendered.specs["blimp_supplement"].subtasks) == 5
    files = sorted((tmp_path / "tasks").rglob("*.yaml"))
    assert len(files) == 67 + 5 + 2 + 6
    for f in files:
        cfg = yaml.load(f.read_text(), Loader=_Loader)  # noqa: S506
        for path in (cfg.get("dataset_kwargs") or {}).get("data_files", {}).values():
            assert path.startswith(str((tmp_path / "data").resolve()) + "/"), (f, path)
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
    assert rendered.resolve(TOP_LEVEL) == TOP_LEVEL
    assert sorted(p.stem for p in (shared_data / "babylm_eval" / "blimp_filtered").glob("*.jsonl")) == \
        sorted((TEMPLATES / "blimp_filtered" / "subtasks.txt").read_text().split())


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


def test_moep_eval_lists_tasks(capsys):
    assert eval_main(["--list_tasks"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "blimp_filtered  (67 sub-tasks)" and out[3] == "blimp_supplement  (5 sub-tasks)"
    assert [line.split()[0] for line in out] == TOP_LEVEL
