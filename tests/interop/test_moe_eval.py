"""lm-evaluation-harness on an imported MoE: moep_ds's LM on the import scores every BLiMP item as lm-eval's own
`--model hf` scores the source (no remote code), per-item log-likelihoods within 1e-4.

# B batch, T tokens
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hf_moe_models import hf_model
from moep_ds.cli.import_model import main as import_main
from moep_ds.data.builtin import generate_corpus
from moep_ds.data.config import TokenizerConfig
from moep_ds.data.tokenizer import copy_tokenizer, train_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))
from eval_trained import write_blimp_dir  # noqa: E402



def test_moep_eval_of_an_imported_moe_scores_as_lm_eval_hf_on_the_source(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from moep_ds.evaluation.harness import MoepLM
    from moep_ds.evaluation.tasks import render_tasks

    src = tmp_path / "hf"
    hf_model("deepseek_v3").save_pretrained(src)
    train_tokenizer(generate_corpus(40_000, seed=0).split("\n\n"), TokenizerConfig(kind="bpe", vocab_size=300),
                    tmp_path / "tok")
    copy_tokenizer(tmp_path / "tok", src)  # the source's own tokenizer (300 ids, the model's vocabulary)
    assert import_main([str(src), "--out", str(tmp_path / "run")]) == 0
    data_dir = write_blimp_dir(tmp_path / "data")
    manager = TaskManager(include_defaults=False, include_path=str(render_tasks(data_dir, tmp_path / "tasks").path))
    tasks = ["blimp_filtered_anaphor_gender_agreement", "blimp_filtered_transitive"]
    hf = simple_evaluate(model="hf", model_args={"pretrained": str(src), "dtype": "float32"}, tasks=tasks,
                         task_manager=manager, batch_size=4, device="cpu", bootstrap_iters=0)
    ours = simple_evaluate(model=MoepLM(str(tmp_path / "run")), tasks=tasks, task_manager=manager,
                           bootstrap_iters=0)
    for task in tasks:
        theirs = [s["resps"] for s in sorted(hf["samples"][task], key=lambda s: s["doc_id"])]
        mine = [s["resps"] for s in sorted(ours["samples"][task], key=lambda s: s["doc_id"])]
        assert len(theirs) == len(mine) > 0
        for a, b in zip(theirs, mine):
            assert [r[0][0] for r in a] == pytest.approx([r[0][0] for r in b], abs=1e-4)
        assert hf["results"][task]["acc,none"] == ours["results"][task]["acc,none"]
