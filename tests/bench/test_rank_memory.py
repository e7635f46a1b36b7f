"""bench/rank_memory.py at toy size: every row runs, the streamed export holds less than building the model and an
expert-parallel import less than the whole one
(at this size DeepSpeed's ZeRO-3 bookkeeping and one parameter's draw over all experts weigh as much as the
model: RESULTS.md has the full-width numbers)."""
import json

import pytest

from benchlib import run


@pytest.mark.slow
def test_toy_run_prints_every_row(tmp_path):
    out = tmp_path / "rows.json"
    # model.max_seq_len=16: the evaluate rows score 16 tokens, whose expert activations (each of the 8 experts takes
    # all 16 equal tokens: 8 x 16 x 2048 elements) stay under glu.FUSED_MIN_NUMEL, so no rank compiles the fused
    # gated activation (about 4 s of CPU in each of the 6 ranks that evaluate); the parameters are unchanged
    proc = run("rank_memory.py", "--json", str(out), "--set", "model.d_model=128", "model.vocab_size=512",
               "model.max_seq_len=16", "model.layers[0].repeat=1",
               "model.layers[0].layers[0].ffn.hidden_size=512", "--import_set", "model.d_model=64",
               "model.vocab_size=512", "data.tokenizer.vocab_size=512", timeout=600)
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["build, ZeRO-3, 2 ranks", "build, expert parallel 2 (ZeRO-2)",
                                         "export, 1 process", "evaluate, ZeRO-3, 2 ranks",
                                         "evaluate, expert parallel 2", "import, expert parallel 2"]
    assert "| step | whole model MiB | sharded / streamed MiB | sharded / whole |" in proc.stdout
    zero3, ep, export, evaluate, evaluate_ep, imported = rows
    assert ep["sharded"] > 0 and 0 < export["sharded"] < export["whole"]
    assert evaluate["sharded"] > 0 and evaluate_ep["sharded"] > 0 and evaluate["whole"] == evaluate_ep["whole"]
    assert zero3["sharded"] > 0 and zero3["whole"] == ep["whole"]  # one whole-model measurement for both
    assert 0 < imported["sharded"] < imported["whole"] and imported["held"] > 0
    assert "import (mixtral_tiny.yaml model.d_model=64 model.vocab_size=512 data.tokenizer.vocab_size=512): a rank " \
           "holds" in proc.stdout
