"""moep-prepare: packed splits that decode back to the source documents, idempotent reuse, atomic
output, and one-line errors for bad input."""
import json
import os
import pathlib

import numpy as np
import pytest

from moep_ds.data.builtin import generate_corpus
from moep_ds.data.config import DataConfig, TokenizerConfig
from moep_ds.data.dataset import PackedDataset
from moep_ds.data.errors import DataError
from moep_ds.cli.prepare import main
from moep_ds.data.prepare import bin_dtype, check_meta, prepare
from moep_ds.data.sampler import BatchLoader
from moep_ds.data.tokenizer import load_tokenizer
from moep_ds.schema import ConfigError, parse


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """The moep_ds cache (builtin corpus, locks, default prepared folders) in a temporary folder."""
    cache = tmp_path_factory.getbasetemp() / "moep_cache"
    monkeypatch.setenv("MOEP_CACHE_DIR", str(cache))
    return cache


def config(source, out, **kw):
    tok = TokenizerConfig(**{"kind": "bpe", "vocab_size": 300, **kw.pop("tokenizer", {})})
    return DataConfig(**{"source": str(source), "prepared_dir": str(out) if out else None, "tokenizer": tok,
                         "seq_len": 16, "val_fraction": 0.1, **kw})


def split_documents(prepared, split):
    """Decode a .bin back into its documents (text between end-of-text tokens)."""
    meta = json.loads((prepared / "meta.json").read_text())
    tok = load_tokenizer(prepared)
    ids = np.fromfile(prepared / f"{split}.bin", dtype=meta["dtype"])
    assert ids.size == meta[f"{split}_tokens"] and (ids.size == 0 or ids[-1] == tok.eot_id)
    ends = np.flatnonzero(ids == tok.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(generate_corpus(60_000, seed=4) + "\n\n\n\nCafé 日本 🙂 tail.\n")
    return path


def test_splits_decode_to_the_source_documents(tmp_path, corpus_file):
    out = prepare(config(corpus_file, tmp_path / "prep"))
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "tokenizer_config.json", "train.bin", "val.bin"]
    meta = check_meta(out, vocab_size=300)
    source_docs = [d.strip("\n") for d in corpus_file.read_text().split("\n\n") if d.strip()]
    train, val = split_documents(out, "train"), split_documents(out, "val")
    assert len(train) == meta["train_documents"] and len(val) == meta["val_documents"] > 0
    assert sorted(train + val) == sorted(source_docs)
    assert [d for d in source_docs if d not in set(val)] == train  # document order kept within a split
    assert 0.05 < len(val) / len(source_docs) < 0.15
    assert meta["dtype"] == "uint16" and meta["mask_id"] == 299 and meta["invalid_utf8_bytes"] == 0


def test_bins_do_not_depend_on_the_write_batch(tmp_path, corpus_file, monkeypatch):
    """Documents are streamed into the bins in batches of WRITE_BATCH: each batch must use its own documents'
    train/validation draws, so that a corpus of many batches is split as one of a single batch is."""
    import moep_ds.data.prepare as prep

    whole = prepare(config(corpus_file, tmp_path / "one_batch"))
    monkeypatch.setattr(prep, "WRITE_BATCH", 7)
    batched = prepare(config(corpus_file, tmp_path / "batches_of_7"))
    for name in ("train.bin", "val.bin"):
        assert (batched / name).read_bytes() == (whole / name).read_bytes(), name


def test_reuse_is_fast_and_source_edits_rebuild(tmp_path, corpus_file, caplog):
    cfg = config(corpus_file, tmp_path / "prep")
    out = prepare(cfg)
    first = (out / "meta.json").read_text()
    caplog.set_level("INFO")
    assert prepare(cfg) == out and (out / "meta.json").read_text() == first
    assert "reusing" in caplog.text
    twin = prepare(config(corpus_file, tmp_path / "twin"))  # determinism: same bytes elsewhere
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (twin / name).read_bytes() == (out / name).read_bytes()
    with open(corpus_file, "a") as f:
        f.write("\n\nA new story about a fox.\n")
    prepare(cfg)
    assert json.loads((out / "meta.json").read_text())["sources"] != json.loads(first)["sources"]
    assert any("A new story about a fox." in d for d in split_documents(out, "train") + split_documents(out, "val"))


def test_default_folder_is_in_the_cache_and_builtin_source_works(isolated_cache):
    out = prepare(DataConfig(source="builtin:0.2", tokenizer=TokenizerConfig(vocab_size=400), seq_len=64))
    assert out.parent == isolated_cache / "prepared" and out.name.startswith("builtin_0_2-")
    assert check_meta(out, vocab_size=400)["train_tokens"] > 20_000
    loader = BatchLoader(PackedDataset(out / "train.bin", 64), micro_batch_size=4, grad_accum=1, dp_rank=0,
                         dp_size=1, seed=0)
    x, y = loader.next_micro_batch()
    assert x.shape == (4, 64) and 0 <= int(x.min()) and int(y.max()) < 399  # never the mask id


def test_json_parquet_and_text_sources_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = generate_corpus(20_000, seed=8).strip().split("\n\n")
    third = len(docs) // 3
    rows = [json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[:third])]
    (tmp_path / "a.jsonl").write_text("".join(rows))
    pq.write_table(pa.table({"body": docs[third:2 * third]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("\n\n".join(docs[2 * third:]))
    cfg = config(tmp_path / "*.*", tmp_path / "out" / "prep", text_field="body", val_fraction=0.0)
    out = prepare(cfg)
    assert split_documents(out, "train") == docs and split_documents(out, "val") == []


@pytest.mark.slow
def test_num_proc_2_writes_identical_bins(tmp_path, corpus_file):
    one = prepare(config(corpus_file, tmp_path / "one"))
    two = prepare(config(corpus_file, tmp_path / "two", num_proc=2))
    assert (one / "train.bin").read_bytes() == (two / "train.bin").read_bytes()
    assert (one / "val.bin").read_bytes() == (two / "val.bin").read_bytes()


@pytest.mark.parametrize("kind", ["sentencepiece_unigram", "sentencepiece_bpe"])
def test_sentencepiece_kinds_prepare(tmp_path, corpus_file, kind):
    out = prepare(config(corpus_file, tmp_path / "sp", tokenizer={"kind": kind, "vocab_size": 500}))
    assert check_meta(out, vocab_size=500)["mask_id"] == 499
    assert "Café 日本 🙂 tail." in split_documents(out, "train") + split_documents(out, "val")


def test_large_vocabulary_uses_uint32(tmp_path, corpus_file):
    assert bin_dtype(65535).name == "uint16" and bin_dtype(65536).name == "uint32"
    out = prepare(config(corpus_file, tmp_path / "big", tokenizer={"vocab_size": 70_000}))
    assert check_meta(out, vocab_size=70_000)["dtype"] == "uint32"
    assert len(split_documents(out, "train")) > 10


def test_reused_tokenizer(tmp_path, corpus_file):
    first = prepare(config(corpus_file, tmp_path / "first"))
    again = prepare(config(corpus_file, tmp_path / "again", tokenizer={"path": str(first)}))
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    assert (again / "train.bin").read_bytes() == (first / "train.bin").read_bytes()
    with pytest.raises(DataError, match="has vocab_size 300, data.tokenizer.vocab_size is 512"):
        prepare(config(corpus_file, tmp_path / "bad", tokenizer={"path": str(first), "vocab_size": 512}))
    assert not (tmp_path / "bad").exists()


def test_shared_source_resolves_against_moep_data_dir(tmp_path, monkeypatch, corpus_file):
    (tmp_path / "shared" / "mine").mkdir(parents=True)
    (tmp_path / "shared" / "mine" / "x.txt").write_text(corpus_file.read_text())
    monkeypatch.setenv("MOEP_DATA_DIR", str(tmp_path / "shared"))
    out = prepare(config("shared:mine", tmp_path / "prep"))
    assert check_meta(out, vocab_size=300)["sources"][0]["path"].endswith("mine/x.txt")
    with pytest.raises(DataError, match=r"shared data 'shared:other' not found .* MOEP_DATA_DIR"):
        prepare(config("shared:other", tmp_path / "prep2"))


@pytest.mark.slow
def test_shared_tinystories(tmp_path, shared_data):
    if not (shared_data / "tinystories").is_dir():
        pytest.skip(f"no tinystories folder in {shared_data}")
    out = prepare(config("shared:tinystories", tmp_path / "ts", tokenizer={"vocab_size": 1024}, seq_len=256))
    meta = check_meta(out, vocab_size=1024)
    assert meta["train_tokens"] > 100_000 and meta["val_documents"] > 0


# ---- bad input: one line on stderr, exit status 2, nothing left at the output path ----------------------


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, pattern):
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and pattern in lines[0], err


def test_missing_path(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "prep"
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "nope.txt"), "--seq-len", "16", "--out", str(out))
    assert_one_line_error(code, err, f"source path not found: {tmp_path / 'nope.txt'}")
    assert not (tmp_path / "a").exists()
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "*.none"), "--seq-len", "16", "--out", str(out))
    assert_one_line_error(code, err, "matches no files")


@pytest.mark.parametrize("content,pattern", [(b"", "empty corpus: 1 source file(s), 0 bytes"),
                                             (b"\n\n  \n\n\t\n", "all blank")])
def test_empty_corpus(tmp_path, capsys, content, pattern):
    (tmp_path / "empty.txt").write_bytes(content)
    out = tmp_path / "out" / "prep"
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "empty.txt"), "--seq-len", "16", "--vocab-size", "300",
                           "--out", str(out))
    assert_one_line_error(code, err, pattern)
    assert not (tmp_path / "out").exists()


def test_corpus_shorter_than_one_window(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("A short story.\n\nAnother one.\n")
    (tmp_path / "out").mkdir()
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "short.txt"), "--seq-len", "512", "--vocab-size", "300",
                           "--val-fraction", "0", "--out", str(tmp_path / "out" / "prep"))
    assert_one_line_error(code, err, "corpus too short: the train split has")
    assert "(data.seq_len + 1 = 513)" in err
    assert os.listdir(tmp_path / "out") == []  # no partial or temporary output


def test_invalid_utf8_is_replaced_counted_and_warned(tmp_path, capsys, caplog):
    text = generate_corpus(20_000, seed=9).encode()
    (tmp_path / "bad.txt").write_bytes(text[:5000] + b"caf\xe9 \xff\xfe ok" + text[5000:])
    code, out, _ = run_cli(capsys, "--source", str(tmp_path / "bad.txt"), "--seq-len", "16", "--vocab-size", "300",
                           "--out", str(tmp_path / "prep"))
    assert code == 0 and json.loads(out)["invalid_utf8_bytes"] == 3
    assert "3 invalid UTF-8 byte(s) replaced" in caplog.text
    docs = split_documents(tmp_path / "prep", "train") + split_documents(tmp_path / "prep", "val")
    assert any("caf\ufffd \ufffd\ufffd ok" in d for d in docs)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "caf\xe9 ' + text[:3000].replace(b"\n", b" ") + b'"}\n')
    code, out, _ = run_cli(capsys, "--source", str(tmp_path / "bad.jsonl"), "--seq-len", "16", "--vocab-size", "300",
                           "--val-fraction", "0", "--out", str(tmp_path / "prep_json"))
    assert code == 0 and json.loads(out)["invalid_utf8_bytes"] == 1
    assert split_documents(tmp_path / "prep_json", "train")[0].startswith("caf\ufffd ")


def test_meta_vocab_and_tokenizer_hash_mismatch(tmp_path, corpus_file, capsys):
    out = prepare(config(corpus_file, tmp_path / "prep"))
    with pytest.raises(DataError, match=r"vocab_size \(300\) differs from the model's vocab_size \(512\)"):
        check_meta(out, vocab_size=512)
    code, _, err = run_cli(capsys, "--check", "--out", str(out), "--vocab-size", "512")
    assert_one_line_error(code, err, "differs from the model's vocab_size (512)")
    with open(out / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(DataError, match=r"tokenizer.json sha256 \(\w{16}\.\.\.\) differs from meta.json"):
        check_meta(out, vocab_size=300)
    code, _, err = run_cli(capsys, "--check", "--out", str(out), "--vocab-size", "300")
    assert_one_line_error(code, err, "differs from meta.json tokenizer_sha256")


def test_config_errors_are_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--source", "builtin", "--out", str(tmp_path / "p"))
    assert_one_line_error(code, err, "data.seq_len: required key is missing")
    code, _, err = run_cli(capsys, "--source", "builtin", "--seq-len", "8", "--vocab-size", "100")
    assert_one_line_error(code, err, "data.tokenizer.vocab_size (100) must be >= 258")
    with pytest.raises(ConfigError, match="data.vocab: unknown key"):
        parse(DataConfig, {"vocab": 3, "seq_len": 8}, "data")


def test_a_bad_config_file_names_the_option(tmp_path, capsys):
    out = tmp_path / "p"
    code, _, err = run_cli(capsys, "--config", str(tmp_path / "nope.yaml"), "--out", str(out))
    assert code == 2 and err == f"error: --config '{tmp_path / 'nope.yaml'}' does not exist\n"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data: {seq_len: 8}\ndata: {seq_len: 16}\n")
    code, _, err = run_cli(capsys, "--config", str(recipe), "--out", str(out))
    assert code == 2 and err == (f"error: --config '{recipe}' is not valid YAML: line 2, column 1: duplicate key data "
                                 "(first given at line 1, column 1)\n")
    recipe.write_text("data: builtin\n")
    code, _, err = run_cli(capsys, "--config", str(recipe), "--out", str(out))
    assert code == 2 and err == f"error: data ('builtin') must be a mapping (--config '{recipe}')\n"
    assert sorted(os.listdir(tmp_path)) == ["recipe.yaml"]


def test_malformed_json_is_one_line_error(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "x.jsonl"), "--seq-len", "16", "--vocab-size", "300",
                           "--out", str(tmp_path / "p"))
    assert_one_line_error(code, err, "cannot read 1 json file(s) starting with")
    assert not (tmp_path / "p").exists()


def test_null_text_rows_are_blank_documents(tmp_path, capsys):
    docs = generate_corpus(6_000, seed=5).strip().split("\n\n")
    rows = [{"text": d} if i % 3 else {"text": None} for i, d in enumerate(docs)]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli(capsys, "--source", str(tmp_path / "x.jsonl"), "--seq-len", "16", "--vocab-size", "300",
                             "--val-fraction", "0", "--out", str(tmp_path / "p"))
    assert code == 0, err
    assert split_documents(tmp_path / "p", "train") == [r["text"] for r in rows if r["text"] is not None]


@pytest.mark.parametrize("name, column, kind", [("nested.jsonl", {"body": "A story."}, "struct<body: string>"),
                                                ("numbers.jsonl", 7, "int64"),
                                                ("numbers.parquet", 7, "int64")])
def test_a_text_field_that_is_not_text_is_one_line_error(tmp_path, capsys, name, column, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": column, "id": i} for i in range(50)]
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    else:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(capsys, "--source", str(tmp_path / name), "--seq-len", "16", "--vocab-size", "300",
                           "--out", str(tmp_path / "out" / "p"))
    builder = "parquet" if name.endswith(".parquet") else "json"
    message = (f"1 {builder} file(s) starting with {tmp_path / name}: column 'text' holds {kind}, not text; set "
               f"data.text_field to a string column (columns: text, id)")
    assert_one_line_error(code, err, message)
    assert err.endswith(f"error: {message}\n")  # the whole line, nothing after it
    assert os.listdir(tmp_path) == [name]


def test_parquet_text_stored_as_binary_is_read_as_text_when_utf8(tmp_path, capsys):
    """Some writers store strings without parquet's UTF8 annotation: the column loads as binary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"Story number {i} is short." for i in range(60)]
    pq.write_table(pa.table({"text": pa.array([d.encode() for d in docs], pa.binary())}), tmp_path / "b.parquet")
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "b.parquet"), "--seq-len", "16", "--vocab-size", "300",
                           "--val-fraction", "0", "--out", str(tmp_path / "p"))
    assert code == 0, err
    assert split_documents(tmp_path / "p", "train") == docs
    pq.write_table(pa.table({"text": pa.array([b"caf\xe9"] * 60, pa.binary())}), tmp_path / "bad.parquet")
    code, _, err = run_cli(capsys, "--source", str(tmp_path / "bad.parquet"), "--seq-len", "16", "--vocab-size",
                           "300", "--out", str(tmp_path / "q"))
    assert_one_line_error(code, err, f"1 parquet file(s) starting with {tmp_path / 'bad.parquet'}: column 'text' "
                                     "cannot be read as text: ")
    assert not (tmp_path / "q").exists()


def test_hub_source_offline_is_one_line_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "--source", "hf:no-such-user/no-such-dataset", "--seq-len", "16",
                           "--vocab-size", "300", "--out", str(tmp_path / "hub"))
    assert_one_line_error(code, err, "cannot load hub dataset no-such-user/no-such-dataset from the hub or, offline, "
                                     "from the Hugging Face cache")
    assert not (tmp_path / "hub").exists()


def test_cli_reads_a_recipe_data_section_and_flags_override(tmp_path, capsys, corpus_file):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{vocab_size: 320, max_seq_len: 32}}\n"
                      f"data:\n  source: {corpus_file}\n  tokenizer: {{kind: bpe, vocab_size: 320}}\n"
                      f"  val_fraction: 0.2\n")
    code, out, _ = run_cli(capsys, "--config", str(recipe), "--val-fraction", "0.1", "--out", str(tmp_path / "p"))
    assert code == 0
    summary = json.loads(out)
    meta = check_meta(tmp_path / "p", vocab_size=320)
    assert summary["train_tokens"] == meta["train_tokens"] and meta["val_fraction"] == 0.1
    assert set(summary["phase_seconds"]) == {"read", "tokenizer", "tokenize", "write"}


def test_val_source_is_the_validation_split_and_every_source_document_is_trained_on(tmp_path, capsys, corpus_file):
    """BabyLM's protocol: train on all of train_10M, validate on its dev set. The tokenizer is trained on the
    train documents alone, and the identity of the output covers the validation source."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "a.dev").write_text(generate_corpus(6_000, seed=11) + "\n\nZyzzogeton quixotry.\n")
    code, out, _ = run_cli(capsys, "--source", str(corpus_file), "--val-source", str(dev), "--seq-len", "16",
                           "--vocab-size", "300", "--out", str(tmp_path / "p"))
    assert code == 0
    prepared = tmp_path / "p"
    meta = check_meta(prepared, vocab_size=300)
    source_docs = [d.strip("\n") for d in corpus_file.read_text().split("\n\n") if d.strip()]
    dev_docs = [d.strip("\n") for d in (dev / "a.dev").read_text().split("\n\n") if d.strip()]
    assert split_documents(prepared, "train") == source_docs  # val_fraction (0.01 by default) is not used
    assert split_documents(prepared, "val") == dev_docs
    assert meta["val_source"] == str(dev) and json.loads(out)["val_documents"] == len(dev_docs)
    held_out = prepare(config(corpus_file, tmp_path / "held_out"))
    assert (held_out / "tokenizer.json").read_bytes() != (prepared / "tokenizer.json").read_bytes()
    trained_on_source = prepare(config(corpus_file, tmp_path / "all", val_fraction=0.0))
    assert (trained_on_source / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()

    cfg = config(corpus_file, None, val_source=str(dev))
    default_dir = prepare(cfg)
    assert prepare(cfg) == default_dir != prepare(config(corpus_file, None))
    (dev / "a.dev").write_text("Only one short line now.\n")
    with pytest.raises(DataError, match=r"validation split too short: \d+ tokens in 1 document\(s\) of "
                                        r"data.val_source '.*dev', fewer than one window"):
        prepare(config(corpus_file, tmp_path / "p2", val_source=str(dev), seq_len=64))
    assert not (tmp_path / "p2").exists()


def test_val_source_errors(tmp_path, capsys, corpus_file):
    base = {"source": str(corpus_file), "seq_len": 16}
    with pytest.raises(ConfigError, match=r"data.val_source \(''\) must name at least one non-empty source"):
        parse(DataConfig, {**base, "val_source": ""}, "data")
    with pytest.raises(ConfigError, match=r"data.val_source \('megatron:v'\) a megatron:PREFIX needs a megatron:PREFIX "
                                          r"data.source"):
        parse(DataConfig, {**base, "val_source": "megatron:v"}, "data")
    code, _, err = run_cli(capsys, "--source", str(corpus_file), "--val-source", str(tmp_path / "no_dev"),
                           "--seq-len", "16", "--vocab-size", "300", "--out", str(tmp_path / "p"))
    assert_one_line_error(code, err, f"source path not found: {tmp_path / 'no_dev'}")
    assert not (tmp_path / "p").exists()


def test_a_validation_split_far_above_val_fraction_is_warned_about(tmp_path, caplog):
    """Text files without blank lines, read by paragraph, are one document each; with val_fraction > 0 at least
    one goes to validation whole: here a third of the corpus."""
    folder = tmp_path / "files"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.train").write_text(generate_corpus(20_000, seed=i).replace("\n\n", "\n"))
    meta = json.loads((prepare(config(folder, tmp_path / "p", val_fraction=0.01)) / "meta.json").read_text())
    assert meta["val_documents"] == 1 and meta["train_documents"] == 2
    assert "validation holds 3" in caplog.text and "data.val_fraction is 0.01: documents are split whole" in caplog.text
    caplog.clear()
    prepare(config(folder, tmp_path / "lines", val_fraction=0.01, sample_by="line"))
    assert "validation holds" not in caplog.text


def test_eval_every_needs_validation_data():
    from moep_ds.config import load_config

    quickstart = pathlib.Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"train.eval_every \(100\) needs validation data: data.val_fraction > 0 "
                                          r"or a data.val_source"):
        load_config(quickstart, overrides=["data.val_fraction=0"])
    assert load_config(quickstart, overrides=["data.val_fraction=0", "data.val_source=dev.txt"])


def test_a_tokenizer_larger_than_the_model_is_refused_before_preparing(tmp_path):
    """check_tokenizer_fits runs before prepare() (training/trainer.py prepare_data): before, the mismatch was
    found by check_meta once the whole corpus was tokenized."""
    from moep_ds.data.prepare import check_tokenizer_fits
    from moep_ds.data.tokenizer import train_tokenizer

    trained = parse(DataConfig, {"source": "builtin", "seq_len": 8, "tokenizer": {"kind": "bpe", "vocab_size": 1024}},
                    "data")
    with pytest.raises(DataError, match=r"^data.tokenizer.vocab_size \(1024\) is larger than model.vocab_size \(512\); "
                                        r"a trained tokenizer is built at the model's size$"):
        check_tokenizer_fits(trained, 512)
    check_tokenizer_fits(trained, 1024)
    train_tokenizer(["one two three four five six. " * 40], TokenizerConfig(vocab_size=300), tmp_path / "tok")
    path = str(tmp_path / "tok" / "tokenizer.json")
    reused = parse(DataConfig, {"source": "builtin", "seq_len": 8, "tokenizer": {"path": path, "vocab_size": 300}},
                   "data")
    with pytest.raises(DataError, match=rf"^data.tokenizer.path \('{path}'\) has 300 ids, more than model.vocab_size "
                                        r"\(256\); a reused tokenizer may only be smaller$"):
        check_tokenizer_fits(reused, 256)
    check_tokenizer_fits(reused, 320)  # padded, as Pythia pads 50,277 to 50,304


# ---- full disk, unwritable cache, signals (issue 46 item 6) --------------------------------------------------


def test_a_full_disk_names_the_output_and_its_space_not_the_source(tmp_path, capsys, corpus_file, monkeypatch):
    """`datasets` writes its cache of the sources in the temporary output folder: a full disk there was reported as
    "cannot read <source>: [Errno 28] No space left on device", blaming the source."""
    import errno

    from moep_ds import fsutil
    from moep_ds.data import sources

    def full_disk(part, cfg, cache_dir):
        try:  # as datasets reports it: its own error, the OSError as its cause
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            raise RuntimeError("An error occurred while generating the dataset") from err

    monkeypatch.setattr(sources, "_load_part", full_disk)
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 3 << 20)
    out = tmp_path / "out" / "prep"
    code, _, err = run_cli(capsys, "--source", str(corpus_file), "--seq_len", "16", "--vocab_size", "300",
                           "--out", str(out))
    assert code == 2 and err.splitlines()[-1] == (
        f"error: disk full (No space left on device) writing {str(out)!r}, 3 MiB free there"), err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_cache_is_one_line_naming_it(tmp_path, capsys, corpus_file, monkeypatch):
    """$MOEP_CACHE_DIR (the locks, builtin corpora, default output folders) that cannot be written was OSError's
    line without the variable, and a traceback under pretrain.py, which prepares its data through prepare(). A cache
    under a regular file fails also for root, who may write a read-only folder."""
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MOEP_CACHE_DIR", str(tmp_path / "file" / "cache"))
    expected = f"$MOEP_CACHE_DIR ({str(tmp_path / 'file' / 'cache')!r}) is not writable: Not a directory"
    with pytest.raises(DataError) as err:
        prepare(config(corpus_file, tmp_path / "prep"))
    assert str(err.value) == expected
    code, _, err = run_cli(capsys, "--source", "builtin:1", "--seq_len", "16", "--vocab_size", "300")
    assert code == 2 and err.splitlines()[-1] == f"error: {expected}"


def test_sigterm_removes_the_temporary_output(tmp_path, capsys, corpus_file, monkeypatch):
    """SIGTERM (`kill`, `timeout`) while the bins are written: one line, status 143, nothing left beside --out
    (before, the process died at once and left its hidden temporary folder)."""
    import signal
    import time

    from moep_ds.data import prepare as prepare_module

    def write_bins_then_stop(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here

    def not_handled(signum, frame):  # what reaches the test when the command handles no SIGTERM (not a dead pytest)
        raise AssertionError("SIGTERM was not handled by moep-prepare")

    monkeypatch.setattr(prepare_module, "write_bins", write_bins_then_stop)
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        code, _, err = run_cli(capsys, "--source", str(corpus_file), "--seq_len", "16", "--vocab_size", "300",
                               "--out", str(tmp_path / "out" / "prep"))
        assert signal.getsignal(signal.SIGTERM) == not_handled  # the command's handler is gone with it
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and err.splitlines()[-1] == "terminated (SIGTERM)" and "Traceback" not in err
    assert not (tmp_path / "out").exists()
