"""The lm-eval model `moep_ds`: scoring against naive references, batch-size invariance for every block type,
rolling log-likelihood, generate_until, and simple_evaluate on local BLiMP tasks (offline)."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moep_ds.data.builtin import generate_corpus, minimal_pairs
from moep_ds.data.config import TokenizerConfig
from moep_ds.data.tokenizer import load_tokenizer, train_tokenizer
from moep_ds.errors import UserError
from moep_ds.evaluation.generate import generate
from moep_ds.checkpointing.model_dir import save_model_dir
from moep_ds.evaluation.harness import MoepLM, batch_by_length, continuation_logprobs, continuation_windows, right_pad

from eval_models import TINY_LAYERS, tiny_model
from eval_trained import train_tiny, write_blimp_dir


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    docs = generate_corpus(40_000, seed=0).split("\n\n")
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(docs, TokenizerConfig(kind="bpe", vocab_size=300), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    return train_tiny(root / "model", steps=60, vocab=512), write_blimp_dir(root / "data")


def naive_logprob(model, ids, n_cont):
    """log p(last n_cont tokens | the ones before), from one unpadded forward."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = F.log_softmax(model(x[:, :-1]).logits.float(), -1)[0]
    return float(logp[-n_cont:].gather(-1, x[0, -n_cont:, None]).sum())


def pair_requests(n=12):
    contexts = ["", "Anna is here."]
    return [Instance("loglikelihood", {}, (ctx, " " + p[k]), i)
            for i, p in enumerate(minimal_pairs(n, seed=3)) for k in ("sentence_good", "sentence_bad") for ctx in contexts]


def test_batching_helpers():
    assert batch_by_length([3, 5, 3, 9, 5], 2) == [[3, 1], [4, 0], [2]]
    assert right_pad([[1, 2], [3]], 0).tolist() == [[1, 2], [3, 0]]
    logits = torch.randn(2, 4, 7, dtype=torch.float64)
    got = continuation_logprobs(logits, [[1, 2, 3, 4], [5, 6]], [[2, 3], [1]])
    logp = F.log_softmax(logits, -1)
    assert got[0][0] == pytest.approx(float(logp[0, 2, 2] + logp[0, 3, 3]))
    assert got[1][0] == pytest.approx(float(logp[1, 1, 1]))
    assert got[0][1] == (logits[0, 2].argmax() == 2 and logits[0, 3].argmax() == 3)


@pytest.mark.parametrize("name", sorted(TINY_LAYERS))
def test_loglikelihoods_match_naive_and_do_not_depend_on_batch_size(name, tokenizer):
    model, _ = tiny_model(name, vocab_size=tokenizer.vocab_size, max_seq_len=40)
    requests = pair_requests()
    one = MoepLM(model=model, tokenizer=tokenizer, batch_size=1).loglikelihood(requests, disable_tqdm=True)
    sixteen = MoepLM(model=model, tokenizer=tokenizer, batch_size=16).loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in one] == [g for _, g in sixteen]
    # equal up to fp32 rounding: MoE experts see batches of other sizes, attention other padded lengths
    torch.testing.assert_close(torch.tensor([s for s, _ in sixteen]), torch.tensor([s for s, _ in one]),
                               rtol=1e-6, atol=1e-4)
    for req, (score, _) in zip(requests, one):
        ctx, cont = req.args
        ctx_ids = tokenizer.encode(ctx) if ctx else [tokenizer.eot_id]
        cont_ids = tokenizer.encode(ctx + cont)[len(ctx_ids):] if ctx else tokenizer.encode(cont)
        assert score == pytest.approx(naive_logprob(model, (ctx_ids + cont_ids)[-41:], len(cont_ids)), abs=1e-4)


def naive_window_logprob(model, ctx_ids, cont_ids, max_len):
    """The documented rule, one token at a time: continuation token j lies in chunk j // max_len; that chunk's
    forward sees the max_len tokens before the chunk's last token (fewer at the start of the text)."""
    full, total, greedy = ctx_ids + cont_ids, 0.0, True
    for j in range(len(cont_ids)):
        pos = len(ctx_ids) + j
        end = min(len(ctx_ids) + (j // max_len + 1) * max_len, len(full))
        first = max(0, end - 1 - max_len)
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([full[first:end - 1]])).logits.float(), -1)[0, pos - 1 - first]
        total += float(logp[full[pos]])
        greedy = greedy and int(logp.argmax()) == full[pos]
    return total, greedy


@pytest.mark.parametrize("name", ["dense_llama_window", "msit"])
def test_continuations_longer_than_the_window_match_the_naive_rule(name, tokenizer):
    max_len = 12
    model, _ = tiny_model(name, vocab_size=tokenizer.vocab_size, max_seq_len=max_len)
    story = generate_corpus(300, seed=7).split("\n\n")[0]
    cut = story.index(" ", 40)
    requests = [Instance("loglikelihood", {}, (ctx, cont), i) for i, (ctx, cont) in enumerate([
        ("", " " + story), ("Anna is here.", " " + story), (story, " She sleeps."), ("The dog", " runs."),
        (story[:cut], story[cut:])])]
    one = MoepLM(model=model, tokenizer=tokenizer, batch_size=1).loglikelihood(requests, disable_tqdm=True)
    five = MoepLM(model=model, tokenizer=tokenizer, batch_size=5).loglikelihood(requests, disable_tqdm=True)
    longest = 0
    for req, (score, greedy), (score5, greedy5) in zip(requests, one, five):
        ctx, cont = req.args
        ctx_ids = tokenizer.encode(ctx) if ctx else [tokenizer.eot_id]
        cont_ids = tokenizer.encode(ctx + cont)[len(ctx_ids):] if ctx else tokenizer.encode(cont)
        longest = max(longest, len(cont_ids))
        expected, expected_greedy = naive_window_logprob(model, ctx_ids, cont_ids, max_len)
        assert score == pytest.approx(expected, abs=1e-4) and score5 == pytest.approx(expected, abs=1e-4)
        assert greedy == greedy5 == expected_greedy
    assert longest > 3 * max_len  # at least four chunks
    # a max_length beyond the model's window is capped at it (model_args max_length=...)
    capped = MoepLM(model=model, tokenizer=tokenizer, batch_size=5, max_length=10 * max_len)
    assert capped.max_length == max_len
    assert [s for s, _ in capped.loglikelihood(requests, disable_tqdm=True)] == pytest.approx([s for s, _ in one], abs=1e-4)


def test_continuation_windows_fit_and_cover_the_continuation():
    ctx, cont = [1, 2, 3], list(range(10, 30))
    windows = continuation_windows(ctx, cont, 8)
    assert [c for _, c in windows] == [cont[:8], cont[8:16], cont[16:]]
    assert all(len(x) + len(c) <= 9 for x, c in windows)
    # a full chunk keeps one token of context; the shorter last one gets the rest of the window
    assert windows[0][0] == [3] and windows[1][0] == [cont[7]] and windows[2][0] == cont[11:16]
    assert continuation_windows(ctx, [7, 8], 8) == [([1, 2, 3], [7, 8])]
    assert continuation_windows(ctx, [], 8) == []


def test_rolling_loglikelihood(tokenizer):
    model, _ = tiny_model("dense_pythia", vocab_size=tokenizer.vocab_size, max_seq_len=16)
    lm = MoepLM(model=model, tokenizer=tokenizer, batch_size=4)
    short, long = "The dog sleeps.", generate_corpus(400, seed=5)
    ids = tokenizer.encode(long)
    assert len(ids) > 3 * 16
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([short, long])],
                                   disable_tqdm=True)
    short_ids = [tokenizer.eot_id] + tokenizer.encode(short)
    assert got[0] == pytest.approx(naive_logprob(model, short_ids, len(short_ids) - 1), abs=1e-4)
    windows = map(make_disjoint_window, get_rolling_token_windows(ids, tokenizer.eot_id, 16, 1))
    expected = sum(naive_logprob(model, ctx + cont, len(cont)) for ctx, cont in windows)
    assert got[1] == pytest.approx(expected, abs=1e-3)


def test_generate_until_stops_at_the_stop_string(tokenizer):
    model, cfg = tiny_model("msit", vocab_size=tokenizer.vocab_size, max_seq_len=40)
    lm = MoepLM(model=model, tokenizer=tokenizer)
    context = "The dog"
    ids = tokenizer.encode(context)
    greedy = generate(model, torch.tensor([ids]), 12)[0, len(ids):].tolist()
    full = tokenizer.decode(greedy[: greedy.index(tokenizer.eot_id)] if tokenizer.eot_id in greedy else greedy)
    stop = full[3:5]
    out = lm.generate_until([Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 12}), 0)],
                            disable_tqdm=True)
    assert out == [full[: full.index(stop)]]
    assert lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 12}), 0)],
                             disable_tqdm=True) == [full]


def test_model_dir_without_tokenizer_is_refused(tmp_path):
    model, cfg = tiny_model("dense_gpt2")
    out = save_model_dir(model, cfg, tmp_path / "m")
    with pytest.raises(UserError, match="has no tokenizer"):
        MoepLM(str(out))


def naive_blimp_accuracy(model, tokenizer, jsonl):
    pairs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    def score(s):
        ids = [tokenizer.eot_id] + tokenizer.encode(" " + s)
        return naive_logprob(model, ids, len(ids) - 1)
    return sum(score(p["sentence_good"]) > score(p["sentence_bad"]) for p in pairs) / len(pairs)


@pytest.mark.slow
def test_simple_evaluate_on_local_blimp_offline(trained, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from moep_ds.evaluation.tasks import render_tasks

    model_dir, data_dir = trained
    rendered = render_tasks(data_dir, tmp_path / "tasks")
    lm = MoepLM(str(model_dir), batch_size=16)
    results = simple_evaluate(model=lm, tasks=["blimp_filtered"], task_manager=TaskManager(
        include_defaults=False, include_path=str(rendered.path)), bootstrap_iters=0, log_samples=False)
    scores = results["results"]
    subtasks = rendered.specs["blimp_filtered"].subtasks
    assert len(subtasks) == 67 and all(s in scores for s in subtasks)
    accs = {s: scores[s]["acc,none"] for s in subtasks}
    assert scores["blimp_filtered"]["acc,none"] == pytest.approx(sum(accs.values()) / 67)
    assert results["config"]["routing_eval_mode"] == "none" and results["config"]["moep_step"] == 60
    for s in ("blimp_filtered_anaphor_gender_agreement", "blimp_filtered_determiner_noun_agreement_1"):
        expected = naive_blimp_accuracy(lm.model, lm.tokenizer, data_dir / "babylm_eval" / "blimp_filtered" /
                                        f"{s.removeprefix('blimp_filtered_')}.jsonl")
        assert accs[s] == pytest.approx(expected)


@pytest.mark.slow
def test_moep_eval_grammar_pairs_without_a_data_directory(trained, tmp_path, capsys):
    from moep_ds.data.builtin import PHENOMENA
    from moep_ds.cli.eval import main as eval_main
    from moep_ds.evaluation.tasks import grammar_pairs_jsonl

    model_dir, _ = trained
    assert eval_main([str(model_dir), "--tasks", "grammar_pairs", "--limit", "12", "--data_dir",
                      str(tmp_path / "nowhere"), "--output", str(tmp_path / "out"), "--bootstrap_iters", "0"]) == 0
    table = capsys.readouterr().out
    scores = json.loads((tmp_path / "out" / "results.json").read_text())["scores"]
    accs = {name: scores[f"grammar_pairs_{name}"]["acc"] for name in PHENOMENA}
    assert scores["grammar_pairs"]["acc"] == pytest.approx(sum(accs.values()) / len(accs))
    for name, acc in accs.items():  # the per-phenomenon table
        assert f"| grammar_pairs_{name} | acc | {100 * acc:.2f} |" in table
    lm = MoepLM(str(model_dir))
    jsonl = tmp_path / "first.jsonl"
    jsonl.write_text("".join(grammar_pairs_jsonl()["agreement_across_relative_clause"].splitlines(True)[:12]))
    expected = naive_blimp_accuracy(lm.model, lm.tokenizer, jsonl)
    assert accs["agreement_across_relative_clause"] == pytest.approx(expected)


@pytest.mark.slow
def test_moep_eval_writes_results_with_routing_mode(tmp_path, tokenizer, tokenizer_dir, capsys, caplog, monkeypatch):
    from moep_ds.cli.eval import main as eval_main

    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    caplog.set_level(logging.INFO, logger="moep_ds")

    model, cfg = tiny_model("ffn_moe_nova", vocab_size=tokenizer.vocab_size)
    ckpt = save_model_dir(model, cfg, tmp_path / "run" / "checkpoints" / "step_5", tokenizer_dir=tokenizer_dir,
                          meta={"step": 5, "tokens": 5000})
    (ckpt / "COMPLETE").touch()
    data_dir = write_blimp_dir(tmp_path / "data", pairs_per_file=2)
    task = "blimp_filtered_anaphor_number_agreement"
    assert eval_main([str(tmp_path / "run"), "--tasks", task, "--data_dir", str(data_dir), "--batch_size", "4"]) == 0
    record = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert record["name"] == "run" and record["moep"]["step"] == 5
    assert record["moep"]["routing_eval_mode"] == "threshold"
    assert record["moep"]["routing_eval_modes"] == {"blocks.1.moe.router": "threshold"}
    assert record["moep"]["train_flops"] == record["moep"]["flops_per_token"] * 5000
    assert 0.0 <= record["scores"][task]["acc"] <= 1.0
    assert "routing eval mode: threshold" in capsys.readouterr().out
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("using checkpoint")] == [
        f"using checkpoint step_5 (step 5) of run {tmp_path / 'run'}"]


@pytest.mark.slow
def test_a_second_moep_eval_keeps_the_first_ones_tasks(tmp_path, tokenizer, tokenizer_dir, capsys):
    """Two evaluations of one run, of different tasks and under different routing eval modes, end in one record
    with both tasks, each beside what produced it; the second replaced the first's results (issue #46 item 7). A
    results.json that cannot be merged with is refused before the model is loaded."""
    from moep_ds.cli.eval import main as eval_main

    model, cfg = tiny_model("ffn_moe_nova", vocab_size=tokenizer.vocab_size)
    ckpt = save_model_dir(model, cfg, tmp_path / "run" / "checkpoints" / "step_5", tokenizer_dir=tokenizer_dir,
                          meta={"step": 5, "tokens": 5000})
    (ckpt / "COMPLETE").touch()
    data_dir = write_blimp_dir(tmp_path / "data", pairs_per_file=2)
    first, second = "blimp_filtered_anaphor_number_agreement", "blimp_filtered_anaphor_gender_agreement"
    common = [str(tmp_path / "run"), "--data_dir", str(data_dir), "--batch_size", "4", "--bootstrap_iters", "0"]
    assert eval_main([*common, "--tasks", first]) == 0
    assert eval_main([*common, "--tasks", second, "--set", "model.layers[1].moe.router.eval_mode=topk"]) == 0
    out = tmp_path / "run" / "eval"
    record = json.loads((out / "results.json").read_text())
    assert record["moep"]["tasks"] == [first, second] and set(record["scores"]) == {first, second}
    assert {t: e["routing_eval_mode"] for t, e in record["evaluations"].items()} == {first: "threshold",
                                                                                     second: "topk"}
    assert record["moep"]["routing_eval_mode"] == "mixed"
    table = capsys.readouterr().out  # the second's last, with what produced each task
    assert table.endswith((out / "results.md").read_text() + "\n")
    assert f"| {first} | acc |" in table and f"| {first} | 5 | threshold |" in table and f"| {second} | 5 | topk |" in table
    (out / "results.json").write_text("{")
    assert eval_main([*common, "--tasks", first]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: results file '{out / 'results.json'}' is not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2); this evaluation's results merge into it: move it away, or pass --output another "
        "folder")


@pytest.mark.slow
def test_real_blimp_subset_from_shared_data(shared_data, tmp_path, tokenizer):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from moep_ds.evaluation.tasks import render_tasks

    model, _ = tiny_model("msit", vocab_size=tokenizer.vocab_size, max_seq_len=64)
    rendered = render_tasks(shared_data, tmp_path / "tasks")
    tasks = ["blimp_filtered_anaphor_gender_agreement", "blimp_supplement_qa_congruence_easy"]
    rendered.resolve(tasks)
    results = simple_evaluate(model=MoepLM(model=model, tokenizer=tokenizer, batch_size=16), tasks=tasks, limit=20,
                              task_manager=TaskManager(include_defaults=False, include_path=str(rendered.path)),
                              bootstrap_iters=0, log_samples=False)
    for task in tasks:
        assert 0.0 <= results["results"][task]["acc,none"] <= 1.0
        assert results["n-samples"][task]["effective"] == 20
    assert results["config"]["routing_eval_mode"] == "threshold"


@pytest.mark.slow
def test_lm_eval_hf_model_on_the_export_scores_like_moep_ds(trained, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from moep_ds.cli.export import main as export_main
    from moep_ds.evaluation.tasks import render_tasks

    model_dir, data_dir = trained
    assert export_main([str(model_dir), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    manager = TaskManager(include_defaults=False, include_path=str(render_tasks(data_dir, tmp_path / "tasks").path))
    tasks = ["blimp_filtered_anaphor_gender_agreement", "blimp_filtered_transitive"]
    hf = simple_evaluate(model="hf", model_args={"pretrained": str(tmp_path / "hf"), "trust_remote_code": True},
                         tasks=tasks, task_manager=manager, batch_size=4, device="cpu", bootstrap_iters=0)
    ours = simple_evaluate(model=MoepLM(str(model_dir)), tasks=tasks, task_manager=manager, bootstrap_iters=0)
    for task in tasks:
        theirs = [s["resps"] for s in sorted(hf["samples"][task], key=lambda s: s["doc_id"])]
        mine = [s["resps"] for s in sorted(ours["samples"][task], key=lambda s: s["doc_id"])]
        for a, b in zip(theirs, mine):
            assert [r[0][0] for r in a] == pytest.approx([r[0][0] for r in b], abs=1e-4)
        assert hf["results"][task]["acc,none"] == ours["results"][task]["acc,none"]


def test_registered_for_lm_eval_beside_its_own_models(tmp_path, tokenizer_dir):
    from lm_eval.api.registry import get_model

    assert get_model("moep_ds") is MoepLM
    assert get_model("hf").__name__ == "HFLM"  # registering ours first must not hide lm-eval's models
    model, cfg = tiny_model("dense_gpt2", vocab_size=300)
    out = save_model_dir(model, cfg, tmp_path / "m", tokenizer_dir=tokenizer_dir)
    lm = get_model("moep_ds").create_from_arg_string(f"pretrained={out},trust_remote_code=True",  # --trust_remote_code
                                                     {"batch_size": 4, "max_batch_size": 8, "device": "cuda"})
    assert lm.batch_size == 4 and lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


# ---- bad model_args: one line, exit status 2, nothing written ----------------------------------------------

KNOWN_ARGS = "pretrained, overrides, batch_size, device, max_length, dtype, expert_parallel"


@pytest.mark.parametrize("model_args, message", [
    ("max_length=abc", "max_length ('abc') must be a positive integer"),
    ("max_length=0", "max_length (0) must be a positive integer"),
    ("max_length=1.5", "max_length (1.5) must be a positive integer"),
    ("dtype=foo", "dtype ('foo') must be one of float32, bfloat16, float16"),
    ("dtype=int8", "dtype ('int8') must be one of float32, bfloat16, float16"),
    ("dtype=float64", "dtype ('float64') must be one of float32, bfloat16, float16"),
    ("dtpye=bfloat16", f"moep_ds model_args: unknown argument(s) ['dtpye']; known: {KNOWN_ARGS}"),
])
def test_bad_model_args_are_refused_before_loading(tmp_path, monkeypatch, model_args, message):
    import moep_ds.evaluation.harness as harness
    from lm_eval.api.registry import get_model

    monkeypatch.setattr(harness, "load_eval_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UserError) as err:
        get_model("moep_ds").create_from_arg_string(f"pretrained={tmp_path},{model_args}", {"batch_size": 4})
    assert str(err.value) == message


def test_lm_eval_cli_reports_bad_model_args_in_one_line(tmp_path, tokenizer_dir, capsys, monkeypatch):
    """A misspelled argument used to be a warning, and the evaluation ran in fp32."""
    import sys

    from moep_ds.cli import lm_eval as lm_eval_cli
    from moep_ds.evaluation.tasks import render_tasks
    from test_export import assert_one_line_error, snapshot

    model, cfg = tiny_model("dense_gpt2", vocab_size=300)
    out = save_model_dir(model, cfg, tmp_path / "m", tokenizer_dir=tokenizer_dir)
    tasks = render_tasks(tmp_path / "nowhere", tmp_path / "tasks").path
    before = snapshot(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lm_eval_cli", "--model", "moep_ds", "--model_args",
                                      f"pretrained={out},dtpye=bfloat16", "--include_path", str(tasks),
                                      "--tasks", "grammar_pairs", "--limit", "2", "--device", "cpu",
                                      "--output_path", str(tmp_path / "results")])
    code = lm_eval_cli.main()
    assert_one_line_error(code, capsys.readouterr().err,
                          f"moep_ds model_args: unknown argument(s) ['dtpye']; known: {KNOWN_ARGS}")
    assert snapshot(tmp_path) == before


UNKNOWN_TASKS = ("--tasks: unknown lm-eval task(s) {}; `lm-eval ls tasks` lists them (--include_path DIR adds task "
                 "YAMLs, e.g. those of moep-eval --render_tasks DIR)")


def test_lm_eval_cli_refuses_an_unknown_task_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """lm-eval's own "Tasks not found" ValueError ended the command in a traceback."""
    import sys

    import moep_ds.evaluation.harness as harness
    from moep_ds.cli import lm_eval as lm_eval_cli
    from moep_ds.evaluation.tasks import render_tasks
    from test_export import assert_one_line_error, snapshot

    tasks = render_tasks(tmp_path / "nowhere", tmp_path / "tasks").path
    before = snapshot(tmp_path)
    monkeypatch.setattr(harness, "load_eval_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "argv", ["lm_eval_cli", "--model", "moep_ds", "--model_args", f"pretrained={tmp_path}",
                                      "--include_path", str(tasks), "--tasks", "grammar_pairs,grammar_pairz,nope",
                                      "--device", "cpu", "--output_path", str(tmp_path / "results")])
    code = lm_eval_cli.main()
    assert_one_line_error(code, capsys.readouterr().err, UNKNOWN_TASKS.format(['grammar_pairz', 'nope']))
    assert snapshot(tmp_path) == before


def test_lm_eval_cli_reads_the_unknown_tasks_of_either_lm_eval_wording():
    from moep_ds.cli.lm_eval import unknown_tasks_error

    older = ValueError("Tasks not found: a, b_c. Try `lm-eval --tasks {list_groups,list_subtasks,list_tags,list}` "
                       "to list out all available names for task groupings; only (sub)tasks; tags; or all of the above")
    for err, names in ((ValueError("Tasks not found: a, b_c"), ["a", "b_c"]), (older, ["a", "b_c"])):
        assert str(unknown_tasks_error(err)) == UNKNOWN_TASKS.format(names)
    assert unknown_tasks_error(ValueError("No tasks specified")) is None  # other errors stay lm-eval's
    from moep_ds.errors import SharedUserError

    # a task file or --include_path folder one node lacks fails on that node's ranks: each prints it
    assert not isinstance(unknown_tasks_error(ValueError("Tasks not found: a")), SharedUserError)
