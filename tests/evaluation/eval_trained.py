"""A tiny model trained for a few seconds on the builtin grammar corpus, saved as a model directory."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moep_ds.data.builtin import PHENOMENA, generate_corpus, minimal_pairs
from moep_ds.data.config import TokenizerConfig
from moep_ds.data.tokenizer import train_tokenizer
from moep_ds.checkpointing.model_dir import save_model_dir
from moep_ds.models.causal_lm import build_model

from eval_models import tiny_config

# builtin phenomenon -> the BabyLM BLiMP file it stands in for in the fake data directory
BLIMP_STAND_INS = {
    "determiner_noun_agreement": "determiner_noun_agreement_1",
    "subject_verb_agreement": "regular_plural_subject_verb_agreement_1",
    "agreement_across_prepositional_phrase": "distractor_agreement_relational_noun",
    "agreement_across_relative_clause": "distractor_agreement_relative_clause",
    "anaphor_number_agreement": "anaphor_number_agreement",
    "anaphor_gender_agreement": "anaphor_gender_agreement",
    "question_auxiliary_agreement": "matrix_question_npi_licensor_present",
}
assert set(BLIMP_STAND_INS) == set(PHENOMENA)


def train_tiny(out_dir: Path, steps: int = 100, name: str = "dense_llama_window", vocab: int = 1024) -> Path:
    docs = generate_corpus(300_000, seed=0).split("\n\n")
    tok_dir = out_dir.parent / f"{out_dir.name}_tokenizer"
    tok = train_tokenizer(docs, TokenizerConfig(kind="bpe", vocab_size=vocab), tok_dir)
    ids = [i for doc in docs for i in [tok.eot_id] + tok.encode(doc)]
    cfg = tiny_config(name, vocab_size=tok.vocab_size, max_seq_len=64, init_std=0.02)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, gen = torch.tensor(ids), torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (16,), generator=gen)
        x_BT = torch.stack([data[s:s + 65] for s in starts])
        loss = model(x_BT[:, :-1], labels=x_BT[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model_dir(model, cfg, out_dir, tokenizer_dir=tok_dir, meta={"step": steps, "tokens": steps * 16 * 64})


def write_blimp_dir(data_dir: Path, pairs_per_file: int = 3) -> Path:
    """A BabyLM-layout data directory whose 67 filtered-BLiMP files hold builtin grammar pairs (the stand-ins
    hold their own phenomenon; the rest cycle through all of them)."""
    folder = data_dir / "babylm_eval" / "blimp_filtered"
    folder.mkdir(parents=True, exist_ok=True)
    names = (Path(__file__).resolve().parents[2] / "eval" / "tasks" / "blimp_filtered" / "subtasks.txt").read_text().split()
    pairs = minimal_pairs(len(PHENOMENA) * 8, seed=1)
    stand_in_of = {v: k for k, v in BLIMP_STAND_INS.items()}
    for n, name in enumerate(names):
        if name in stand_in_of:
            chosen = [p for p in pairs if p["phenomenon"] == stand_in_of[name]][:pairs_per_file]
        else:
            chosen = [pairs[(n * pairs_per_file + j) % len(pairs)] for j in range(pairs_per_file)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in chosen))
    return data_dir
