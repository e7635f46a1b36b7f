"""Evaluation on two ranks, each holding half of the model (evaluation/partitioned.py: ZeRO-3, or half of the
experts): the same scores and generations as one process, from every checkpoint format, in fp32 and bf16, padded
partitions included; `moep-eval` under a launcher writes the single-process results once; `moep-generate` under a
launcher samples what one process samples. The ranks run in the test (tests/ranks.py)."""
import copy
import json
import os
import pathlib
import sys

import pytest
import torch
from lm_eval.api.instance import Instance

from moep_ds.checkpointing import model_dir, model_state
from moep_ds.config import config_from_dict
from moep_ds.data.builtin import generate_corpus
from moep_ds.data.config import TokenizerConfig
from moep_ds.data.tokenizer import train_tokenizer
from moep_ds.cli import convert, eval as run_eval, export, generate, lm_eval as lm_eval_cli
from moep_ds.evaluation.harness import MoepLM
from moep_ds.errors import UserError
from moep_ds.models.causal_lm import build_model
from moep_ds.distributed.expert_parallel import expert_stages
from moep_ds.distributed.inference import inference_ds_config

from ranks import command, joined, run_command, run_ranks  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import LAYERS  # noqa: E402

CONTEXTS = ["the dog", "a cat sees the", "every bird"]


def mixed_recipe() -> dict:
    """Every routed block type; expert choice scores tokens by thresholds at evaluation (causal)."""
    layers = copy.deepcopy(LAYERS["mixed"])
    layers[1]["moe"]["router"]["eval_mode"] = "threshold"
    return {"model": {"flavour": "llama", "vocab_size": 320, "d_model": 32, "max_seq_len": 32, "init_std": 0.2,
                      "tie_embeddings": True, "layers": layers}}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The same weights as a sharded checkpoint, and as a model directory and a Hugging Face export converted back."""
    root = tmp_path_factory.mktemp("partitioned")
    docs = generate_corpus(40_000, seed=0).split("\n\n")
    train_tokenizer(docs, TokenizerConfig(kind="bpe", vocab_size=300), root / "tok")
    cfg = config_from_dict(mixed_recipe())
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():  # routers see a training batch: thresholds and the lifecycle's counts move
        model.train()(torch.randint(0, 320, (4, 32)))
    ckpt = root / "sharded"
    model_state.save_module(model, ckpt)
    model_dir.write_recipe_files(cfg, ckpt, root / "tok", {"step": 1})
    # the exports, converted back (moep-convert): the loaders read sharded checkpoints only
    assert export.main([str(ckpt), "--out", str(root / "plain_export")]) == 0
    assert export.main([str(ckpt), "--out", str(root / "hf_export"), "--hf"]) == 0
    for name in ("plain", "hf"):
        assert convert.main([str(root / f"{name}_export"), "--out", str(root / name)]) == 0
    # odd widths (GPT-2: learned positions, d_model 33 in 3 heads): most parameters do not divide by 2, so their
    # last partitions are padded; as a sharded checkpoint and converted back from the plain export
    odd_cfg = config_from_dict(odd_recipe())
    odd = root / "odd_sharded"
    model_state.save_module(build_model(odd_cfg.model), odd)
    model_dir.write_recipe_files(odd_cfg, odd, root / "tok", {"step": 1})
    assert export.main([str(odd), "--out", str(root / "odd_export")]) == 0
    assert convert.main([str(root / "odd_export"), "--out", str(root / "odd_plain")]) == 0
    return {name: root / name for name in ("sharded", "plain", "hf", "odd_sharded", "odd_plain")}


def odd_recipe() -> dict:
    return {"model": {"flavour": "gpt2", "vocab_size": 321, "d_model": 33, "max_seq_len": 32, "init_std": 0.2,
                      "layers": [{"type": "dense", "repeat": 2, "attention": {"num_heads": 3}}]}}


def requests(vocab: int = 300) -> list[tuple[list[int], list[int]]]:
    """Nine requests, one with a continuation longer than the window (scored in two windows): ten windows, five
    batches of two, so the second rank also runs the model for the first's last batch."""
    g = torch.Generator().manual_seed(3)
    lengths = [(1, 3), (5, 2), (12, 9), (20, 11), (3, 40), (8, 1), (30, 2), (2, 2), (17, 6)]
    return [(torch.randint(1, vocab, (c,), generator=g).tolist(), torch.randint(1, vocab, (n,), generator=g).tolist())
            for c, n in lengths]


def single_process(directory: pathlib.Path, dtype: str) -> dict:
    lm = MoepLM(pretrained=str(directory), batch_size=2, dtype=dtype)
    generate = [Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 6}), i)
                for i, c in enumerate(CONTEXTS)]
    return {"scores": [list(s) for s in lm._loglikelihood_tokens([(None, *r) for r in requests()])],
            "generated": lm.generate_until(generate)}


SPLIT = [{"name": name, "dir": name, "dtype": "float32"} for name in ("sharded", "plain", "hf")] + [
    {"name": "sharded_bf16", "dir": "sharded", "dtype": "bfloat16"}]
EXPERTS = [{"name": f"{name}_ep", "dir": name, "dtype": "float32", "expert_parallel": True} for name in ("sharded", "hf")]
PADDED = [{"name": name, "dir": name, "dtype": "float32"} for name in ("odd_sharded", "odd_plain")]


@pytest.fixture(scope="module")
def two_ranks(model_dirs):
    """What each of 2 ranks holds of each model and scored and generated with it (evaluate_on_rank)."""
    runs = [{**run, "dir": str(model_dirs[run["dir"]])} for run in SPLIT + EXPERTS + PADDED]
    return [rank.result for rank in run_ranks(2, evaluate_on_rank, runs, requests(), CONTEXTS, 2)]


def evaluate_on_rank(runs: list[dict], requests: list, contexts: list[str], batch_size: int) -> dict:
    """Evaluate model directories ({"name", "dir", "dtype": torch dtype name, "expert_parallel"}) with the lm-eval
    model `moep_ds` on this rank of a launch, and record what the rank holds of the model and what it scored and
    generated: {name: {"scores": [[logp, greedy], ...], "generated": [str, ...] (greedy), "sampled": [str, ...]
    (drawn with a different seed on each rank), "held": elements of this rank's partitions, "total": elements of the
    whole model, "whole": names of parameters held whole, "params": number of parameters, "experts_held": elements
    of the expert parameters held here, "different_work": the error when each rank is given different requests,
    "padded": ZeRO-3 parameters whose last partition is padded}}."""
    import torch.distributed as dist

    from moep_ds.checkpointing.model_state import zero3_partition
    from moep_ds.errors import SharedUserError

    record = {}
    for run in runs:
        lm = MoepLM(pretrained=run["dir"], batch_size=batch_size, dtype=run["dtype"],
                    expert_parallel=run.get("expert_parallel", False))
        params = list(lm.model.named_parameters())
        scored = [(None, ctx, cont) for ctx, cont in requests]
        generate = [Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 6}), i)
                    for i, c in enumerate(contexts)]
        sample = [Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 6, "do_sample": True}), i)
                  for i, c in enumerate(contexts)]
        torch.manual_seed(dist.get_rank())  # each rank draws differently: the ranks must follow rank 0's tokens
        record[run["name"]] = {
            "scores": [list(s) for s in lm._loglikelihood_tokens(scored, disable_tqdm=True)],
            "generated": lm.generate_until(generate, disable_tqdm=True),
            "sampled": lm.generate_until(sample, disable_tqdm=True),
            "held": sum(zero3_partition(p)[1] for _, p in params if hasattr(p, "ds_id")),
            "total": sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for _, p in params),
            "whole": [n for n, p in params if not hasattr(p, "ds_id")],
            "params": len(params),
            "padded": sum(p.ds_numel % dist.get_world_size() != 0 for _, p in params if hasattr(p, "ds_id")),
            "experts_held": sum(p.numel() for _, p in params if getattr(p, "allreduce", True) is False),
        }
        try:  # ranks given different requests: refused on every rank before any forward pass
            lm._loglikelihood_tokens(scored[:1 + dist.get_rank()], disable_tqdm=True)
        except SharedUserError as err:
            record[run["name"]]["different_work"] = str(err)
    return record


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_each_holding_half_score_and_generate_as_one_process(model_dirs, two_ranks):
    stages = expert_stages(MoepLM(pretrained=str(model_dirs["sharded"])).model)
    all_experts = sum(p.numel() for stage in stages for p in stage.experts.parameters())
    for run in EXPERTS:  # each rank holds half of every stage's experts and every other parameter whole
        got = [rank[run["name"]] for rank in two_ranks]
        assert [g["experts_held"] for g in got] == [all_experts // 2] * 2 and len(got[0]["whole"]) == got[0]["params"]
        want = single_process(model_dirs[run["dir"]], run["dtype"])
        for g in got:  # each expert's tokens from both ranks' batches in one matmul: equal up to rounding
            assert [s[1] for s in g["scores"]] == [s[1] for s in want["scores"]], run["name"]
            assert [s[0] for s in g["scores"]] == pytest.approx([s[0] for s in want["scores"]], rel=1e-5, abs=1e-5)
            assert g["generated"] == want["generated"], run["name"]
        assert got[0]["sampled"] == got[1]["sampled"], run["name"]
    for run in SPLIT:
        got = [rank[run["name"]] for rank in two_ranks]
        assert got[0]["whole"] == [] and got[1]["whole"] == [], run["name"]  # every parameter partitioned
        assert got[0]["held"] + got[1]["held"] == got[0]["total"] > 0
        assert abs(got[0]["held"] - got[1]["held"]) <= got[0]["params"]  # half each, up to one element a parameter
        want = single_process(model_dirs[run["dir"]], run["dtype"])
        for g in got:  # the scores gathered onto every rank; the same batches as one process runs, exactly
            assert g["scores"] == want["scores"], run["name"]
            assert g["generated"] == want["generated"], run["name"]
        assert got[0]["sampled"] == got[1]["sampled"], run["name"]  # decoded in lockstep, with rank 0's draws
        assert [g["different_work"] for g in got] == [
            "the ranks of a split model were given different work: windows to score per rank [1, 2]"] * 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ranks_load_padded_partitions_as_one_process(model_dirs, two_ranks):
    """Most parameters of the odd-width model do not divide by 2: their last partitions are padded."""
    for run in PADDED:
        got = [rank[run["name"]] for rank in two_ranks]
        assert got[0]["padded"] > 0 and sum(g["held"] for g in got) == got[0]["total"]
        want = single_process(model_dirs[run["dir"]], run["dtype"])
        assert all(g["scores"] == want["scores"] and g["generated"] == want["generated"] for g in got), run["name"]


EVAL_ARGS = ["--tasks", "grammar_pairs", "--limit", "6", "--batch_size", "4"]


@pytest.fixture(scope="module")
def one_process_eval(model_dirs, tmp_path_factory) -> dict:
    """moep-eval's record of the sharded checkpoint in one process."""
    out = tmp_path_factory.mktemp("one_process_eval")
    assert run_eval.main([str(model_dirs["sharded"]), *EVAL_ARGS, "--output", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("split", ["zero3", "expert_parallel"])
def test_moep_eval_under_torchrun_writes_the_single_process_results_once(model_dirs, one_process_eval, tmp_path,
                                                                         split):
    run_command(2, "moep_ds.cli.eval", str(model_dirs["sharded"]), *EVAL_ARGS, "--output", str(tmp_path / "two"),
                *(["--expert_parallel"] if split == "expert_parallel" else []))
    one, two = one_process_eval, json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["scores"] == one["scores"] and one["scores"]  # accuracies: no margin is near a tie
    assert (one["moep"]["ranks"], two["moep"]["ranks"]) == (1, 2)
    assert (one["moep"]["split"], two["moep"]["split"]) == (None, split)
    assert two["moep"]["params_total"] == one["moep"]["params_total"]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["results.json", "results.md"]


def failing_eval(fault: str, argv: list[str]) -> None:
    """On a rank: `moep-eval ARGV` where one rank fails. read: the last rank cannot read the checkpoint
    (DamagedCheckpoint); write: rank 0 cannot write the results (OSError, after every rank evaluated); score: the last
    rank fails alone on its first batch of scores (a RuntimeError, as from a bug or running out of memory) while the
    others go on to their next forward pass."""
    from moep_ds.checkpointing.sharded import DamagedCheckpoint
    from moep_ds.evaluation import harness

    last = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
    read, score = model_dir.load_weights, harness.continuation_logprobs

    def load_weights(model, path, **kwargs):
        if last:
            raise DamagedCheckpoint(f"checkpoint {str(path)!r} could not be read: simulated on this rank")
        return read(model, path, **kwargs)

    def write_record(record, out_dir):
        raise OSError(f"simulated: cannot write {out_dir}")

    def continuation_logprobs(*args, **kwargs):
        if last:
            raise RuntimeError("simulated: this rank cannot score")
        return score(*args, **kwargs)

    if fault == "read":
        model_dir.load_weights = load_weights
    elif fault == "score":
        harness.continuation_logprobs = continuation_logprobs
    else:
        run_eval.write_record = write_record
    raise SystemExit(run_eval.main(argv))


@pytest.mark.slow
def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank_with_one_line_each(model_dirs, tmp_path):
    proc = joined(run_ranks(2, failing_eval, "read", [str(model_dirs["sharded"]), "--tasks", "grammar_pairs",
                                                      "--output", str(tmp_path / "out")], check=False, timeout=300))
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    sharded_dir = str(model_dirs["sharded"])
    stderr = proc.stderr  # two processes' lines, which may interleave
    assert f"[rank 1] error: checkpoint {sharded_dir!r} could not be read: simulated on this rank\n" in stderr
    assert (f"error: checkpoint {sharded_dir!r} could not be read on 1 other rank(s); their errors are above\n"
            in stderr)
    assert stderr.count("error: checkpoint") == 2


@pytest.mark.slow
def test_rank_0_failing_after_the_evaluation_fails_the_command_on_every_rank(model_dirs, tmp_path):
    ranks = run_ranks(2, failing_eval, "write", [str(model_dirs["sharded"]), "--tasks", "grammar_pairs", "--limit",
                                                 "2", "--output", str(tmp_path / "out")], check=False, timeout=300)
    assert "OSError: simulated: cannot write" in ranks[0].stderr
    # both ranks failed and none waited for the other (the launcher may stop rank 1 as rank 0 exits: -15)
    exits = [rank.exitcode for rank in ranks]
    assert exits[0] == 1 and exits[1] != 0, joined(ranks).stderr[-3000:]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_that_fails_alone_while_scoring_ends_the_command_without_waiting(model_dirs, tmp_path):
    """Rank 1 fails (an unexpected error) on its first batch while rank 0 goes on to its next forward pass,
    gathering parameters that rank 1 holds: rank 1 ends at once and the launcher stops rank 0. Agreeing on the exit
    status after a failure (as run_split did) left the two ranks in different collectives until gloo's timeout.
    (A one-line error ends a rank at once too: cli.exit_joined.)"""
    proc = joined(run_ranks(2, failing_eval, "score", [str(model_dirs["sharded"]), "--tasks", "grammar_pairs",
                                                       "--limit", "6", "--batch_size", "2", "--output",
                                                       str(tmp_path / "out")], check=False, timeout=180))
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert "RuntimeError: simulated: this rank cannot score" in proc.stderr, proc.stderr[-3000:]


def test_lm_eval_cli_arguments_on_each_rank_of_a_launch():
    argv = ["--model", "moep_ds", "--local_rank=1", "-o", "out", "--output_path=out2", "--tasks", "x"]
    assert lm_eval_cli.launched_argv(argv, 0) == ["--model", "moep_ds", "-o", "out", "--output_path=out2",
                                                   "--tasks", "x"]
    assert lm_eval_cli.launched_argv(argv, 1) == ["--model", "moep_ds", "--tasks", "x"]


def lm_eval_of_included_tasks(argv: list[str]) -> None:
    """On a rank: `python -m moep_ds.cli.lm_eval ARGV` with lm-eval's task index built from --include_path alone.
    Its ~15,000 built-in task YAMLs take some 14 s of CPU to index on each rank; the command indexes them in one
    process in test_harness.py (test_lm_eval_cli_reports_bad_model_args_in_one_line)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager.__init__
    TaskManager.__init__ = lambda self, *args, **kwargs: index(self, *args, **{**kwargs, "include_defaults": False})
    command("moep_ds.cli.lm_eval", argv)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lm_eval_cli_under_torchrun_writes_one_result_file(model_dirs, tmp_path):
    assert run_eval.main(["--render_tasks", str(tmp_path / "tasks")]) == 0
    run_ranks(2, lm_eval_of_included_tasks, ["--model", "moep_ds", "--model_args",
                                             f"pretrained={model_dirs['sharded']},expert_parallel=true",
                                             "--include_path", str(tmp_path / "tasks"), "--tasks", "grammar_pairs",
                                             "--limit", "3", "--output_path", str(tmp_path / "out")])
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["results"]["grammar_pairs"]


@pytest.mark.slow
def test_lm_eval_cli_refuses_its_cache_under_a_launcher(model_dirs, tmp_path):
    proc = joined(run_command(2, "moep_ds.cli.lm_eval", "--model", "moep_ds", "--model_args",
                              f"pretrained={model_dirs['sharded']}", "--tasks", "grammar_pairs", "--use_cache",
                              str(tmp_path / "c"), check=False))
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert proc.returncode != 0 and errors == [
        "error: --use_cache is not supported under a launcher (each rank would keep its own cache and skip "
        "requests the other ranks compute)"]


@pytest.mark.slow
def test_expert_parallel_evaluation_of_a_model_without_experts_is_one_line(tmp_path):
    cfg = config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 16, "max_seq_len": 16,
                                      "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}})
    model_dir.save_model_dir(build_model(cfg.model), cfg, tmp_path / "dense")
    proc = joined(run_command(2, "moep_ds.cli.generate", str(tmp_path / "dense"), "--expert_parallel", check=False))
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert proc.returncode != 0 and errors == [
        f"error: --expert_parallel: {str(tmp_path / 'dense')!r} has no routed experts to shard over 2 ranks; "
        "without it the model is split with ZeRO-3"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_moep_generate_under_torchrun_samples_as_one_process(model_dirs, capsys):
    args = [str(model_dirs["hf"]), "--prompt", "the dog", "--num_samples", "3", "--max_new_tokens", "10",
            "--temperature", "1.5", "--seed", "7"]
    assert generate.main(args) == 0
    one = capsys.readouterr().out
    two = joined(run_command(2, "moep_ds.cli.generate", *args)).stdout  # with DeepSpeed's log lines
    assert two.count(one) == 1 and one.count("the dog") >= 3  # printed once (rank 0), three samples
    assert len(set(one.split("the dog"))) > 2  # that differ: sampled


def test_inference_config_names_a_bad_dtype():
    assert inference_ds_config("bfloat16") == {"train_micro_batch_size_per_gpu": 1,
                                               "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with pytest.raises(UserError, match=r"^dtype \('half'\) must be one of \['bfloat16', 'float16', 'float32'\]$"):
        inference_ds_config("half")
