"""The native export's special tokens (issue 45): an imported model keeps its source's (config.json's bos / eos / pad
ids, eos possibly a list, and its generation_config.json), so that transformers' generate on the export stops where
the source's stops; a model trained here has its tokenizer's (end of text as bos and eos, the tokenizer's pad).

# T tokens
"""
from __future__ import annotations

import json

import pytest
import torch

from hf_models import hf_config, perturbed, recipe
from moep_ds.cli.export import main as export_main
from moep_ds.cli.import_model import main as import_main

transformers = pytest.importorskip("transformers")

BOS, EOS, PAD, MAX_NEW = 1, 92, 0, 20
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def stops_at_92() -> torch.nn.Module:
    """A tiny Llama whose greedy continuation of PROMPT reaches id 92 within a few tokens: the head's row 92 is a
    little more than the row of the third token it generates otherwise."""
    config = hf_config("llama_gqa")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS, EOS, PAD
    model = perturbed("LlamaForCausalLM", config, seed=0)
    free = model.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    third = int(free[0, PROMPT.shape[1] + 2])
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.5 * model.lm_head.weight[third]
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS], pad_token_id=PAD,
                                                            max_new_tokens=MAX_NEW, do_sample=False)
    return model


PROMPT = torch.tensor([[5, 17, 33, 101]])


def test_an_imported_models_export_keeps_its_sources_tokens_and_stops_where_it_stops(tmp_path):
    source = stops_at_92()
    source.save_pretrained(tmp_path / "hf")
    assert import_main([str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "hf2"), "--hf", "--native"]) == 0

    def read(name: str, folder: str) -> dict:
        return json.loads((tmp_path / folder / name).read_text())

    config = read("config.json", "hf2")
    assert {k: config[k] for k in IDS} == {k: read("config.json", "hf")[k] for k in IDS} == {
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    assert read("generation_config.json", "hf2") == read("generation_config.json", "hf")  # as published
    assert (tmp_path / "hf2" / "generation_config.json").read_text() == (
        tmp_path / "hf" / "generation_config.json").read_text()  # and as transformers writes it
    expected = source.generate(PROMPT)
    assert expected[0, -1] == EOS and expected.shape[1] < PROMPT.shape[1] + MAX_NEW  # the source stops early
    export = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager")
    assert torch.equal(export.eval().generate(PROMPT), expected)  # its own generation_config: no arguments


def test_a_model_trained_here_exports_its_tokenizers_ids(tmp_path):
    from moep_ds.checkpointing.model_dir import save_model_dir
    from moep_ds.config import config_from_dict
    from moep_ds.data.builtin import generate_corpus
    from moep_ds.data.config import TokenizerConfig
    from moep_ds.data.tokenizer import train_tokenizer
    from moep_ds.models.causal_lm import build_model

    tok = train_tokenizer(generate_corpus(5_000, seed=0).split("\n\n"), TokenizerConfig(kind="bpe", vocab_size=300),
                          tmp_path / "tok")
    cfg = config_from_dict(recipe("llama_gqa"))
    save_model_dir(build_model(cfg.model), cfg, tmp_path / "model", tokenizer_dir=tmp_path / "tok", meta={"step": 3})
    assert export_main([str(tmp_path / "model"), "--out", str(tmp_path / "hf"), "--hf", "--native"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    pad = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").pad_token_id  # <|endoftext|>, as saved here
    assert pad is not None
    expected = {"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id, "pad_token_id": pad}
    assert {k: config[k] for k in IDS} == expected
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert {k: getattr(generation, k) for k in IDS} == expected


def test_a_special_token_that_is_no_id_is_one_line(tmp_path, capsys):
    perturbed("LlamaForCausalLM", hf_config("llama_gqa"), seed=0).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "eos_token_id": "</s>"}))
    assert import_main([str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {str(tmp_path / 'hf' / 'config.json')!r}: eos_token_id = '</s>' is no token id (an id, a list of "
        "ids, or null)")
    assert not (tmp_path / "run").exists()
