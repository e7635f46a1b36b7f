"""Tokenizers: lossless round trips, exact vocabulary size with the mask token last, sentencepiece
conversion equal to sentencepiece itself, files loadable by transformers."""
import hashlib
import os

import pytest

from moep_ds.data.builtin import generate_corpus
from moep_ds.data.config import TokenizerConfig
from moep_ds.data.errors import DataError
from moep_ds.data.tokenizer import (EOT, MASK, load_tokenizer, sentencepiece_to_tokenizer, split_at_line_breaks,
                                    tokenizer_sha256, train_sentencepiece, train_tokenizer)

KINDS = ["bpe", "sentencepiece_unigram", "sentencepiece_bpe"]
ROUND_TRIP = [
    "The dogs near the tree sleep.",
    "Crème brûlée, naïve façade, Ærøskøbing, ﬁ ligature",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀👩‍👩‍👧 and ⚙️",
    "a  b   c\t\td\n\n\ne    \n  \r\n trailing   ",
    "",
    " leading space",
    f"two docs{EOT}glued",
]


def docs(num_bytes=12_000):
    return generate_corpus(num_bytes, seed=3).split("\n\n")


@pytest.fixture(scope="module", params=KINDS)
def trained(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    tok = train_tokenizer(iter(docs()), TokenizerConfig(kind=request.param, vocab_size=400), out)
    return request.param, out, tok


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(trained, text):
    _, out, tok = trained
    for t in (tok, load_tokenizer(out)):
        assert t.decode(t.encode(text)) == text


def test_vocab_exact_and_mask_last(trained):
    _, out, tok = trained
    loaded = load_tokenizer(out)
    assert tok.vocab_size == loaded.vocab_size == 400
    assert loaded.mask_id == 399 and loaded.tok.id_to_token(399) == MASK
    assert loaded.tok.id_to_token(loaded.eot_id) == EOT
    ids = loaded.encode(ROUND_TRIP[1] + ROUND_TRIP[3])
    assert max(ids) < 399 and MASK not in loaded.decode(ids)
    assert loaded.encode(EOT) == [loaded.eot_id]


def test_reload_is_identical_and_hash_is_file_sha(trained):
    _, out, tok = trained
    text = " ".join(docs(3000))
    assert load_tokenizer(out).encode(text) == tok.encode(text)
    assert tokenizer_sha256(out) == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()


def test_long_texts_encode_in_pieces_exactly_as_whole(trained):
    _, _, tok = trained
    lines = generate_corpus(60_000, seed=6).replace("\n\n", "\n").split("\n")
    text = "\n".join(f"{line}  \n\n {ROUND_TRIP[2]}\t{ROUND_TRIP[3]}\n" if i % 7 == 0 else line
                     for i, line in enumerate(lines))
    assert len(split_at_line_breaks(text)) > 3 and "".join(split_at_line_breaks(text)) == text
    assert tok.encode(text) == tok.tok.encode(text, add_special_tokens=False).ids
    assert tok.encode_batch(["", text[:100], text]) == [[], tok.encode(text[:100]), tok.encode(text)]


def test_transformers_loads_the_same_tokenizer(trained):
    from transformers import PreTrainedTokenizerFast

    _, out, tok = trained
    fast = PreTrainedTokenizerFast.from_pretrained(str(out))
    text = ROUND_TRIP[0] + " " + ROUND_TRIP[2]
    assert fast(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert fast.eos_token_id == tok.eot_id and fast.mask_token_id == tok.mask_id == len(fast) - 1


@pytest.mark.parametrize("kind", KINDS)
def test_small_corpus_is_filled_to_the_exact_size(tmp_path, kind):
    tok = train_tokenizer(iter(docs(2000)), TokenizerConfig(kind=kind, vocab_size=1500), tmp_path)
    assert tok.vocab_size == 1500 and tok.mask_id == 1499
    assert load_tokenizer(tmp_path).tok.id_to_token(1498).startswith("<|unused_")


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_conversion_matches_sentencepiece(model_type):
    import sentencepiece as spm

    corpus = generate_corpus(60_000, seed=5).split("\n\n")
    model = train_sentencepiece(iter(corpus[:len(corpus) // 2]), model_type, 600)
    sp = spm.SentencePieceProcessor(model_proto=model)
    hf = sentencepiece_to_tokenizer(model)
    held_out = corpus[len(corpus) // 2:] + ROUND_TRIP[:5]
    mismatched = [t for t in held_out if sp.encode(t) != hf.encode(t, add_special_tokens=False).ids]
    assert not mismatched, mismatched[:3]


def test_sentencepiece_vocab_too_small_is_one_line_error(tmp_path):
    text = ["".join(chr(0x4E00 + i) for i in range(200))] * 3  # 200 distinct required characters
    with pytest.raises(DataError, match=r"vocab_size 300 .*required_chars") as err:
        train_tokenizer(iter(text), TokenizerConfig(kind="sentencepiece_unigram", vocab_size=300), tmp_path)
    assert "\n" not in str(err.value)


def test_load_missing_tokenizer_is_data_error(tmp_path):
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


SAMPLED_SENTENCEPIECE = """
import hashlib, random, sys
from moep_ds.data import tokenizer
tokenizer.SP_MAX_SENTENCES = 101  # sentencepiece's least; the corpus below has 2,000 lines
rng = random.Random(0)
texts = ["\\n".join(" ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 9)))
                             for _ in range(8)) for _ in range(20)) for _ in range(100)]
print(hashlib.sha256(tokenizer.train_sentencepiece(texts, "unigram", 600, int(sys.argv[1]))).hexdigest())
"""


def test_sentencepiece_on_a_sample_is_the_same_for_the_same_seed():
    """Beyond SP_MAX_SENTENCES lines sentencepiece trains on a sample; its own sampling differs from process to
    process whatever its seed: the sample is drawn with the data seed instead, so that two preparations of one
    corpus (e.g. on two nodes) train the same tokenizer. Separate processes, as two nodes are."""
    import subprocess
    import sys

    from repo_paths import REPO

    def trained(seed):
        return subprocess.run([sys.executable, "-c", SAMPLED_SENTENCEPIECE, str(seed)], capture_output=True, text=True,
                              check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout

    first, again, other = trained(7), trained(7), trained(8)
    assert first == again and first != other


def test_sample_lines_is_a_seeded_uniform_sample_or_everything():
    from moep_ds.data.tokenizer import sample_lines

    docs = ["a\nb\n\nc", "d", "e\nf"]
    assert sample_lines(docs, 10, seed=0) == ["a", "b", "c", "d", "e", "f"]
    assert sample_lines(docs, 3, seed=1) == sample_lines(docs, 3, seed=1) and len(sample_lines(docs, 3, seed=1)) == 3
    drawn = [frozenset(sample_lines([str(i) for i in range(10)], 3, seed)) for seed in range(2000)]
    counts = [sum(str(i) in d for d in drawn) for i in range(10)]
    assert all(500 < c < 700 for c in counts), counts  # each line in 3/10 of the samples
