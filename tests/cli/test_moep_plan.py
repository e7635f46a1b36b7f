"""`moep-plan` end to end, in-process on tiny recipes: the plan's tables, JSON, --search, the PNG, exit statuses and
the one-line errors; and that planning never imports deepspeed (one subprocess)."""
import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import DS_CONFIGS, REPO, env, write_recipe  # noqa: E402

from moep_ds.cli.plan import main  # noqa: E402


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    return str(write_recipe(tmp / "tiny.yaml", "nova_moe", tmp / "run", max_steps=1000, global_batch_size=32))


def plan(recipe, *args, ds="zero1_bf16"):
    return main([recipe, "--ds_config", str(DS_CONFIGS / f"{ds}.json"), *args])


def test_the_plan_prints_memory_communication_and_time(recipe, capsys):
    assert plan(recipe, "--gpus", "8", "--gpus_per_node", "4", "--set", "train.expert_parallel_size=2") == 0
    out = capsys.readouterr().out
    for line in ("## memory per rank", "## communication per step per rank", "## step time", "| **peak** |",
                 "expert parallel 2 (once per rank, 2 chunks overlapped), ZeRO-1 bf16, micro-batch 4 x 1 accumulation",
                 "% of the step) = step ",
                 "| all_to_all | blocks.1.moe: tokens to experts and back |", "assumed: compute efficiency 0.45",
                 "1,000 steps: "):
        assert line in out, line
    assert "between nodes" in out and "MFU" in out


def test_json_holds_the_same_plan(recipe, capsys):
    assert plan(recipe, "--gpus", "4", "--json", "--gpu", "a100", "--assume", "overlap=0", "--hardware",
                "hbm_gbps=1000") == 0
    run = json.loads(capsys.readouterr().out)
    assert run["layout"]["gpus"] == 4 and run["layout"]["gpus_per_node"] == 4
    assert run["gpu"]["name"] == "a100" and run["gpu"]["hbm_gbps"] == 1000 and run["assumptions"]["overlap"] == 0
    assert run["memory"]["fits"] and run["memory"]["peak_bytes"] >= sum(
        i["bytes"] for i in run["memory"]["items"] if i["phase"] == "static")
    assert run["memory"]["peak_phase"] in ("backward", "reduce", "step")
    assert set(run["communication"]["bytes_by_kind"]) == {"all_reduce", "all_gather"}
    assert run["time"]["steps"] == 1000 and run["time"]["gpu_hours"] > 0


def test_search_lists_fitting_layouts_and_draws_them(recipe, tmp_path, capsys):
    png = tmp_path / "memory.png"
    assert plan(recipe, "--gpus", "8", "--search", "--png", str(png)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# moep-plan {recipe} --search: ") and "fastest first" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1
    assert "| expert all-to-all |" in out and "| exposed comm. |" in out
    assert "chunks overlapped |" in out  # the all-to-all's options are searched and the chosen ones shown
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plan(recipe, "--gpus", "8", "--search", "--json") == 0
    runs = json.loads(capsys.readouterr().out)
    assert len(runs) > 20 and {r["layout"]["expert_parallel"] for r in runs} == {1, 2, 4}
    options = {tuple(r["layout"]["expert_comm"].values()) for r in runs if r["layout"]["expert_parallel"] > 1}
    assert {chunks for *_, chunks in options} == {1, 2, 4} and {dedup for dedup, *_ in options} == {False, True}
    assert [r["time"]["step_s"] for r in runs] == sorted(r["time"]["step_s"] for r in runs)


def test_a_layout_that_does_not_fit_exits_1_saying_by_how_much(recipe, capsys):
    # 1 MiB usable (a reserve of all the memory is refused: test_bad_input_is_one_line_and_exit_2)
    assert plan(recipe, "--gpus", "2", "--hardware", "memory_gib=3", "--assume", "reserve_gib=2.999") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moep-plan: does not fit: ")
    assert "GiB over the 0 GiB usable of h100 (3 GiB less 2.999 reserved); largest item: " in err[0]


@pytest.mark.parametrize("args, message", [
    (["--gpus", "4", "--gpus_per_node", "8"], "error: --gpus_per_node (8) must be <= --gpus (4)"),
    (["--gpus", "12", "--gpus_per_node", "8"], "error: --gpus (12) must be a multiple of --gpus_per_node (8)"),
    (["--gpus", "6", "--set", "train.expert_parallel_size=3"],
     "error: model.layers[1].moe.num_experts (4) must be divisible by expert_parallel_size (3)"),
    (["--gpus", "4", "--gpu", "v100"], "error: --gpu ('v100') must be one of h100, h200, h800, a100, mi300x"),
    (["--gpus", "4", "--hardware", "hbm=1"], "error: --hardware 'hbm=1': expected KEY=VALUE with KEY one of "
                                              "memory_gib, bf16_tflops, fp32_tflops, hbm_gbps, intra_node_gbps, "
                                              "inter_node_gbps"),
    (["--gpus", "4", "--assume", "overlap=2"], "error: --assume overlap (2) must be <= 1"),
    # a reserve of the whole memory or more leaves nothing (it reported "-20 GiB usable") (issue #46 item 8)
    (["--gpus", "4", "--assume", "reserve_gib=100"],
     "error: --assume reserve_gib (100) must be less than the 80 GiB of h100: it would leave -20 GiB to plan with"),
    (["--gpus", "4", "--gpu", "A100", "--hardware", "memory_gib=3", "--assume", "reserve_gib=3"],
     "error: --assume reserve_gib (3) must be less than the 3 GiB of a100: it would leave 0 GiB to plan with"),
    # counts: one line, not argparse's usage block
    (["--gpus", "0"], "error: --gpus (0) must be a positive integer"),
    (["--gpus", "4", "--gpus_per_node", "-1"], "error: --gpus_per_node (-1) must be a positive integer"),
    (["--gpus", "3"], "error: ds_config train_batch_size (32) is not a multiple of train_micro_batch_size_per_gpu "
                      "(4) x data-parallel size (3)"),
])
def test_bad_input_is_one_line_and_exit_2(recipe, capsys, args, message):
    assert plan(recipe, *args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


def test_olmoe_plan_says_how_much_of_the_step_its_all_to_all_schedule_exposes(capsys):
    # the recipe's layout (expert parallel 8, the default 2 chunks) on 64 H100s; 31.2% in one chunk
    args = [str(REPO / "configs" / "olmoe_1b_7b.yaml"), "--ds_config", str(DS_CONFIGS / "zero2_bf16.json"),
            "--gpus", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "expert parallel 8 (once per rank, 2 chunks overlapped), ZeRO-2 bf16" in out
    assert "; 25.4% of the step) = step " in out
    assert main([*args, "--set", "train.expert_comm.overlap_chunks=1"]) == 0
    assert "; 31.2% of the step) = step " in capsys.readouterr().out


def test_deepseek_v3_batch_on_2048_gpus_is_refused_saying_why(capsys):
    # every rank is data-parallel: 15,360 sequences a step do not divide over 2,048 (7.5 a rank)
    args = [str(REPO / "configs" / "deepseek_v3_671b.yaml"), "--ds_config", str(DS_CONFIGS / "zero2_bf16.json"),
            "--gpus", "2048", "--gpu", "h800", "--search"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == ("error: no layout of 15360 sequences per step on 2048 GPUs is possible: "
                                               "every rank is data-parallel, and 15360 is not a multiple of 2048")


def test_gpu_names_are_case_insensitive(recipe, capsys):
    assert plan(recipe, "--gpus", "2", "--gpu", "H100", "--json") == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["name"] == "h100"
    assert plan(recipe, "--gpus", "2", "--gpu", "Mi300X", "--json") == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["name"] == "mi300x"


def test_a_missing_ds_config_is_one_line(recipe, capsys):
    assert main([recipe, "--ds_config", "nope.json", "--gpus", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ds_config 'nope.json' does not exist"


def test_planning_imports_no_deepspeed(recipe):
    code = ("import sys; from moep_ds.cli.plan import main; "
            f"code = main([{recipe!r}, '--ds_config', {str(DS_CONFIGS / 'zero3_bf16.json')!r}, '--gpus', '2']); "
            "assert code == 0, code; assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    proc = subprocess.run([sys.executable, "-c", code], env=env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
