"""One-line errors of the command-line entries under a launcher (the ranks of tests/ranks.py): rank 0 prints what every
rank is given alike."""
from types import SimpleNamespace

import pytest
import yaml

from moep_ds.distributed.commands import run_guarded
from moep_ds.config import config_from_dict
from moep_ds.errors import SharedUserError
from moep_ds.evaluation.harness import check_dtype, check_model_args
from moep_ds.cli.lm_eval import unknown_tasks_error
from moep_ds.training.ds_config import read_ds_config, reconcile
from moep_ds.distributed.expert_parallel import check_parallel_layout

from ranks import run_command


MODEL = {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
         "layers": [{"type": "dense", "attention": {"num_heads": 4}}]}


@pytest.mark.slow  # two ranks per case
@pytest.mark.parametrize("command, message", [
    (["moep_ds.cli.eval", "{tmp}", "--batch_size", "0"], "--batch_size (0) must be >= 1"),
    (["moep_ds.cli.eval", "{tmp}", "--device", "gpu0"],
     "--device ('gpu0') is not a torch device (e.g. cpu, cuda, cuda:1)"),
    (["moep_ds.cli.generate", "{tmp}", "--top_p", "2"], "--top_p (2.0) must be in (0, 1]"),
    (["moep_ds.cli.pretrain", "--config", "{tmp}/recipe.yaml", "--dry_run"], "model.d_model (-1) must be > 0"),
])
def test_an_argument_error_under_a_launcher_is_printed_by_rank_0_only(tmp_path, command, message):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": {**MODEL, "d_model": -1}}))
    ranks = run_command(2, *(part.replace("{tmp}", str(tmp_path)) for part in command), check=False)
    (out0, err0), (out1, err1) = ((r.stdout, r.stderr) for r in ranks)
    assert [r.exitcode for r in ranks] == [2, 2], (err0, err1)
    assert err0.startswith(f"error: {message}") and err0.count("\n") == 1, err0
    assert (out0, out1, err1) == ("", "", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.slow  # two ranks per case
@pytest.mark.parametrize("command", [
    ["moep_ds.cli.pretrain", "--config", "r.yaml", "--bogus"],
    ["moep_ds.cli.eval", "ckpt", "--batch_size", "two"],
    ["moep_ds.cli.generate", "ckpt", "--max_new_tokens", "x"],
])
def test_a_usage_error_under_a_launcher_is_printed_by_rank_0_only(command):
    """argparse's own refusals (unknown option, wrong type): usage and the error on rank 0, exit 2 on both."""
    ranks = run_command(2, *command, check=False)
    (out0, err0), (out1, err1) = ((r.stdout, r.stderr) for r in ranks)
    assert [r.exitcode for r in ranks] == [2, 2], (err0, err1)
    assert err0.startswith("usage: ") and "error: " in err0, err0
    assert (out0, out1, err1) == ("", "", "")


@pytest.mark.parametrize("body, message", [
    (lambda: read_ds_config("/nonexistent/ds.json"), "--ds_config '/nonexistent/ds.json' does not exist"),
    (lambda: unknown_tasks_error(ValueError("Tasks not found: my_task")), "--tasks: unknown lm-eval task(s) ['my_task']"),
])
def test_errors_about_files_a_node_may_lack_are_printed_by_every_rank(monkeypatch, capsys, body, message):
    """A path that is missing on one node fails on its ranks only: were rank 0 the only printer, that node's ranks
    would exit silently while rank 0 waits for them."""
    def raise_it():
        error = body()
        if error is not None:
            raise error

    monkeypatch.delenv("SLURM_PROCID", raising=False)
    for rank, prefix in (("1", "[rank 1] "), ("0", "")):
        monkeypatch.setenv("RANK", rank)
        assert run_guarded(raise_it) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{prefix}error: {message}") and err.count("\n") == 1, (rank, err)


def ds_config_conflict():
    cfg = config_from_dict({"model": MODEL, "train": {"micro_batch_size": 4}})
    reconcile(read_ds_config({"train_micro_batch_size_per_gpu": 8}), cfg.train, 2)


def parallel_layout_conflict():
    check_parallel_layout(SimpleNamespace(train=SimpleNamespace(expert_parallel_size=2)), {}, 3)


@pytest.mark.parametrize("body, message", [
    (ds_config_conflict, "train.micro_batch_size (4) conflicts with ds_config train_micro_batch_size_per_gpu (8)"),
    (parallel_layout_conflict, "train.expert_parallel_size (2) must divide the world size (3)"),
    (lambda: check_model_args({"dtpye": "bfloat16"}), "moep_ds model_args: unknown argument(s) ['dtpye']"),
    (lambda: check_dtype("int8"), "dtype ('int8') must be one of float32, bfloat16, float16"),
])
def test_errors_in_what_every_rank_is_given_are_shared(monkeypatch, capsys, body, message):
    """ds_config content, parallel layout and model_args errors (before or after the ranks join, or inside lm-eval):
    rank 0 reports them by the launcher's rank in the environment, as it does the command line's."""
    with pytest.raises(SharedUserError) as err:
        body()
    assert str(err.value).startswith(message)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert run_guarded(body) == 2
        err = capsys.readouterr().err
        assert (err.startswith(f"error: {message}") and err.count("\n") == 1) if printed else err == "", rank


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_whose_error_another_rank_reported_exits_2_without_a_word(monkeypatch, capsys, rank):
    from moep_ds.errors import ReportedElsewhere

    monkeypatch.setenv("RANK", rank)

    def body():
        raise ReportedElsewhere("rank 0 failed")

    assert run_guarded(body) == 2
    assert capsys.readouterr().err == ""


def test_an_interrupt_before_training_is_one_line(capsys):
    def body():
        raise KeyboardInterrupt

    assert run_guarded(body) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_command_turns_sigterm_and_sighup_into_an_exception_unless_ignored(capsys):
    """Issue 46 item 6: SIGTERM and SIGHUP ended a command at once, leaving its temporaries; now they raise (the
    clean-up runs, test_interrupted_writes.py) while the command runs, except a SIGHUP that `nohup` ignores."""
    import signal

    seen = {}

    def body():
        seen.update({sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)})

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert run_guarded(body) == 0
        assert callable(seen[signal.SIGTERM]) and seen[signal.SIGHUP] == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]  # as it was once the command is done
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_stopping_advice_names_this_run_only():
    """`pkill -USR1 -f pretrain.py` stopped every user's runs on a shared machine."""
    from moep_ds.cli.pretrain import pretrain_parser

    text = pretrain_parser().format_help()
    assert "touch RUN_DIR/STOP" in text and 'pkill -USR1 -u "$USER" -f -- "--config configs/x.yaml"' in text
    assert "pkill -USR1 -f pretrain.py" not in text
    assert "--overwrite" in text and "--allow_batch_change" in text
