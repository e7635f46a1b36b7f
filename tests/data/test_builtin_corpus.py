"""The embedded grammar corpus and its minimal pairs."""
import re
import time

import pytest

from moep_ds.data.builtin import PHENOMENA, corpus_path, generate_corpus, minimal_pairs


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """The moep_ds cache (builtin corpus, locks, default prepared folders) in a temporary folder."""
    cache = tmp_path_factory.getbasetemp() / "moep_cache"
    monkeypatch.setenv("MOEP_CACHE_DIR", str(cache))
    return cache


def sentences(text):
    return set(re.split(r"(?<=[.?]) |\n+", text))


def test_deterministic_from_seed_and_about_the_requested_size():
    a, b, c = generate_corpus(50_000, seed=1), generate_corpus(50_000, seed=1), generate_corpus(50_000, seed=2)
    assert a == b and a != c
    assert 50_000 <= len(a.encode()) < 52_000 and a.isascii()
    stories = a.strip("\n").split("\n\n")
    assert len(stories) > 100 and all(s.strip() for s in stories)


def test_cached_file_generated_quickly_then_reused(isolated_cache):
    start = time.perf_counter()
    path = corpus_path(4, seed=0)
    assert time.perf_counter() - start < 20
    assert path.is_relative_to(isolated_cache) and path.stat().st_size >= 4 * 2**20
    mtime = path.stat().st_mtime_ns
    assert corpus_path(4, seed=0) == path and path.stat().st_mtime_ns == mtime


def test_minimal_pairs_differ_in_one_agreeing_word():
    pairs = minimal_pairs(70, seed=11)
    assert pairs == minimal_pairs(70, seed=11) and pairs != minimal_pairs(70, seed=12)
    assert [p["phenomenon"] for p in pairs[:len(PHENOMENA)]] == list(PHENOMENA)
    for p in pairs:
        assert set(p) == {"sentence_good", "sentence_bad", "phenomenon"}
        good, bad = p["sentence_good"].split(), p["sentence_bad"].split()
        assert len(good) == len(bad) and sum(g != b for g, b in zip(good, bad)) == 1, p


def test_corpus_contains_good_sentences_and_never_bad_ones():
    seen = sentences(generate_corpus(3_000_000, seed=0))
    pairs = minimal_pairs(700, seed=1)
    assert not [p["sentence_bad"] for p in pairs if p["sentence_bad"] in seen]
    found = {p["phenomenon"] for p in pairs if p["sentence_good"] in seen}
    assert {"subject_verb_agreement", "anaphor_gender_agreement", "question_auxiliary_agreement"} <= found
