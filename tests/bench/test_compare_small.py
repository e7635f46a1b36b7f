"""bench/compare_small.py: parameter matching, the BLiMP scorer against an unbatched reference, the missing-data
message, and a toy end-to-end run."""
import json

import pytest
import torch
import torch.nn.functional as F

from benchlib import load, run, table_rows

cs = load("compare_small")


def test_every_model_matches_the_reference_budget_within_3_percent():
    sections = cs.model_sections(list(cs.MODELS), cs.SIZES["small"])
    totals = {name: cs.total_params(section) for name, section in sections.items()}
    reference = totals[cs.REFERENCE]
    assert 5e6 <= reference <= 10e6
    for name, total in totals.items():
        assert abs(total - reference) <= 0.03 * reference, (name, total, reference)


@pytest.mark.parametrize("name", ["gpt2", "msit", "moep_llama", "nova_moe", "moe_stream", "deepseek"])
def test_batched_sentence_scores_equal_one_sentence_at_a_time(name):
    from moep_ds.models.causal_lm import build_model

    torch.manual_seed(0)
    model = build_model(cs.model_config(cs.MODELS[name](cs.SIZES["toy"], 4))).double().eval()
    rows = [[0] + torch.randint(1, 512, (n,)).tolist() for n in (5, 11, 2, 8, 17)]
    batched = cs.sentence_logprobs(model, rows, batch=3)
    with torch.no_grad():
        for row, score in zip(rows, batched):
            logp_TV = F.log_softmax(model(torch.tensor([row])).logits[0], dim=-1)
            expected = sum(float(logp_TV[t, row[t + 1]]) for t in range(len(row) - 1))
            assert score == pytest.approx(expected, abs=1e-9)


def test_blimp_pairs_takes_the_first_pairs_of_each_file_in_name_order(tmp_path):
    folder = tmp_path / "babylm_eval" / "blimp_filtered"
    folder.mkdir(parents=True)
    for name in ("b_phenomenon", "a_phenomenon"):
        lines = [json.dumps({"sentence_good": f"{name} good {i}", "sentence_bad": f"{name} bad {i}"}) for i in range(4)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    assert cs.blimp_pairs(tmp_path, 2) == [("a_phenomenon good 0", "a_phenomenon bad 0"),
                                           ("a_phenomenon good 1", "a_phenomenon bad 1"),
                                           ("b_phenomenon good 0", "b_phenomenon bad 0"),
                                           ("b_phenomenon good 1", "b_phenomenon bad 1")]


def test_missing_corpus_skips_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEP_DATA_DIR", str(tmp_path))
    assert cs.main(["--size", "toy", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "shared:corpus" in out and str(tmp_path) in out


@pytest.mark.slow
def test_toy_run_prints_the_table_and_writes_curves(tmp_path):
    proc = run("compare_small.py", "--size", "toy", "--source", "builtin", "--steps", "3", "--blimp_pairs", "2",
               "--val_windows", "8", "--out_dir", str(tmp_path))
    rows = {row[0]: row for row in table_rows(proc.stdout)}
    assert set(rows) == set(cs.MODELS)
    for row in rows.values():
        assert 0 < float(row[4]) < 10 and float(row[7]) > 0  # val loss (random init: ~ln 512), tokens/s
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(r["steps"] == 3 and len(r["curve"]) == 3 for r in results.values())
    assert len({r["tokens"] for r in results.values()}) == 1  # the same tokens for every model


def test_validation_loss_averages_windows_spread_over_the_whole_split(tmp_path):
    import numpy as np

    from moep_ds.models.causal_lm import build_model

    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    tokens = np.random.default_rng(0).integers(0, 512, 10 * 8 + 1).astype(np.uint16)  # 10 windows of 8
    tokens.tofile(tmp_path / "val.bin")
    torch.manual_seed(0)
    model = build_model(cs.model_config(cs.MODELS["llama"](cs.SIZES["toy"], 4))).double().eval()
    picked = [0, 3, 6, 9]  # 4 windows spread from the first to the last
    with torch.no_grad():
        expected = sum(float(model(torch.tensor(tokens[i * 8:i * 8 + 8][None].astype(np.int64)),
                                   labels=torch.tensor(tokens[i * 8 + 1:i * 8 + 9][None].astype(np.int64))).ce_loss)
                       for i in picked) / len(picked)
    got = cs.validation_loss(model, tmp_path / "val.bin", 8, windows=4, batch=3)
    assert got == pytest.approx(expected, rel=1e-6)  # the model's cross-entropy is computed in fp32
