"""The commands a launcher starts on every rank accept what the deepspeed launcher passes them (`--local_rank=i`,
`deepspeed --num_gpus N --module moep_ds.cli.X ...`) and read it as no option of theirs."""
from __future__ import annotations

import pytest

from moep_ds.cli import eval as eval_cli, generate, import_model, pretrain


@pytest.mark.parametrize("parser,argv", [
    (import_model.parser, ["hf:org/model", "--out", "runs/x", "--expert_parallel"]),
    (eval_cli.parser, ["runs/x", "--tasks", "grammar_pairs"]),
    (generate.parser, ["runs/x", "--prompt", "Once"]),
    (pretrain.pretrain_parser, ["--config", "configs/quickstart.yaml"]),
])
def test_the_deepspeed_launchers_local_rank_is_accepted(parser, argv):
    args = parser().parse_args([*argv, "--local_rank=1"])
    assert args.local_rank == 1
