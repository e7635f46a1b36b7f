"""One flag style for every console command: underscores (`--batch_size`), each long option also accepted with dashes."""
from __future__ import annotations

import pytest

from moep_ds.cli import analyze, convert, eval as eval_cli, export, generate, import_model, plan, prepare, pretrain


def test_moep_prepare_takes_both_spellings_of_a_flag():
    for flag in ("--num_proc", "--num-proc"):
        args = prepare.parse_args(["--source", "builtin", flag, "3", "--vocab-size", "300", "--val_fraction", "0.1"])
        assert (args.num_proc, args.vocab_size, args.val_fraction) == (3, 300, 0.1)


def test_the_trainer_takes_both_spellings_of_a_flag():
    args = pretrain.pretrain_parser().parse_args(["--config", "x.yaml", "--ds-config", "ds.json", "--dry-run"])
    assert (args.ds_config, args.dry_run) == ("ds.json", True)


@pytest.mark.parametrize("parser", [pretrain.pretrain_parser, eval_cli.parser, export.parser, generate.parser,
                                    import_model.parser, convert.parser, plan.plan_parser])
def test_help_shows_underscores_and_every_dashed_alias_parses_alike(parser):
    p = parser()
    for action in p._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if any("_" in s or "-" in s[2:] for s in long):
            style = [s for s in long if "-" not in s[2:]]
            dashed = [s for s in long if "_" not in s]
            assert style and dashed, (parser.__name__, action.option_strings)


def test_moep_analyze_takes_both_spellings(tmp_path, capsys):
    """--no-plots reaches the command as --no_plots does (an empty folder is then refused in one line)."""
    for flag in ("--no_plots", "--no-plots"):
        assert analyze.main([str(tmp_path / "missing"), flag]) == 2
        assert capsys.readouterr().err.startswith("error: ")
