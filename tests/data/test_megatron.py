"""megatron:PREFIX sources: the MMIDIDX reader against hand-packed index files, sequence samples in file order
over data-parallel ranks and across a resume, the prepared folder (reused tokenizer, held-out range or
val_source), and the one-line errors for missing or malformed data."""
import json
import os
import re
import struct

import numpy as np
import pytest

from moep_ds.data.config import DataConfig, TokenizerConfig
from moep_ds.data.dataset import open_split
from moep_ds.data.errors import DataError
from moep_ds.data.megatron import IndexedDataset, SequenceDataset, write_indexed
from moep_ds.data.prepare import check_meta, prepare
from moep_ds.cli.prepare import main as prepare_main
from moep_ds.data.sampler import BatchLoader
from moep_ds.data.tokenizer import train_tokenizer
from moep_ds.schema import ConfigError, parse

from repo_paths import REPO

# Megatron-LM's DType codes as its preprocessing writes them (and GPT-NeoX's table)
MEGATRON_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MOEP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "moep_cache"))


def pack_by_hand(prefix, sequences, code):
    """PREFIX.bin/.idx laid out field by field as Megatron-LM's MMapIndexedDatasetBuilder writes them."""
    dtype = np.dtype(MEGATRON_CODES[code])
    sizes = [len(s) for s in sequences]
    pointers = np.cumsum([0] + sizes)[:-1] * dtype.itemsize  # one per sequence: none for an empty dataset
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(sizes) + 1))
        f.write(np.array(sizes, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.arange(len(sizes) + 1, dtype=np.int64).tobytes(order="C"))


@pytest.mark.parametrize("code", sorted(MEGATRON_CODES))
def test_reader_decodes_every_megatron_dtype_code(tmp_path, code):
    rng = np.random.default_rng(code)
    sequences = [rng.integers(0, 120, size=n) for n in (5, 1, 9, 4)]
    pack_by_hand(tmp_path / "d", sequences, code)
    data = IndexedDataset(tmp_path / "d")
    assert data.dtype == np.dtype(MEGATRON_CODES[code]) and len(data) == 4
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(data.sequence(i).astype(np.int64), seq)


def test_writer_matches_the_megatron_layout(tmp_path):
    sequences = [np.arange(7) + 40_000, np.arange(3), np.arange(5) + 65_000]  # above int16: uint16 is needed
    pack_by_hand(tmp_path / "ref", sequences, 8)
    write_indexed(tmp_path / "ours", sequences, np.uint16)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes()[17] == 8  # the dtype byte after magic and version


def test_an_empty_dataset_is_written_as_megatron_writes_it_and_reads_back(tmp_path):
    """Megatron's builder with no sequences writes no sizes or pointers, doc_idx [0]: a 42-byte index."""
    pack_by_hand(tmp_path / "ref", [], 8)
    write_indexed(tmp_path / "ours", [])
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "ours.idx").stat().st_size == 42 and (tmp_path / "ours.bin").stat().st_size == 0
    data = SequenceDataset(tmp_path / "ours", 4)
    assert len(data) == 0 and len(data.data) == 0 and data.get_batch([]).shape == (0, 5)


def test_samples_are_the_first_seq_len_plus_one_tokens_of_each_sequence(tmp_path):
    sequences = [np.arange(i, i + 6) for i in range(0, 40, 10)] + [np.arange(40, 45)]
    write_indexed(tmp_path / "d", sequences)
    data = SequenceDataset(tmp_path / "d", 4, start=1, stop=4)
    assert len(data) == 3
    np.testing.assert_array_equal(data.get_batch([2, 0]).numpy(), [np.arange(30, 35), np.arange(10, 15)])
    assert data[1].tolist() == list(range(20, 25))
    with pytest.raises(DataError, match=r"sequence 4 of .* has 5 tokens, fewer than data.seq_len \+ 1 = 6"):
        SequenceDataset(tmp_path / "d", 5).get_batch([0, 4])
    with pytest.raises(DataError, match=r"token ids 20..25 outside the tokenizer's vocabulary \(0..19\)"):
        SequenceDataset(tmp_path / "d", 5, vocab_size=20).get_batch([2])


def test_malformed_index_files_fail_with_one_line(tmp_path):
    write_indexed(tmp_path / "d", [np.arange(4)] * 3)
    idx = (tmp_path / "d.idx").read_bytes()
    cases = {
        "magic": (b"MMIDXXX\x00\x00" + idx[9:], r"magic b'MMIDXXX\\x00\\x00', expected b'MMIDIDX\\x00\\x00'"),
        "version": (idx[:9] + struct.pack("<Q", 2) + idx[17:], "index version 2 is not supported"),
        "code": (idx[:17] + bytes([9]) + idx[18:], r"unknown dtype code 9 \(known: \[1, 2, 3, 4, 5, 6, 7, 8\]\)"),
        "truncated": (idx[:-8], "its header says"),
        "short": (idx[:10], "shorter than its header"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / f"{name}.idx").write_bytes(content)
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "d.bin").read_bytes())
        with pytest.raises(DataError, match=message):
            IndexedDataset(tmp_path / name)


@pytest.mark.parametrize("damage, size, need, dtype", [
    ("truncated", 50, 72, "uint16, dtype code 8"),
    ("empty", 0, 72, "uint16, dtype code 8"),
    ("dtype code 4 on uint16 ids", 72, 90, "int32, dtype code 4"),  # the last pointer is 54, its 9 ids take 36
])
def test_a_bin_shorter_than_its_index_needs_fails_when_opened(tmp_path, damage, size, need, dtype):
    write_indexed(tmp_path / "d", [np.arange(9)] * 4)
    if damage == "dtype code 4 on uint16 ids":
        idx = (tmp_path / "d.idx").read_bytes()
        (tmp_path / "d.idx").write_bytes(idx[:17] + bytes([4]) + idx[18:])
    else:
        (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:size])
    message = f"{tmp_path / 'd.bin'} has {size} bytes, its index d.idx needs {need} (4 sequences of {dtype})"
    with pytest.raises(DataError, match=f"^{re.escape(message)}$"):
        SequenceDataset(tmp_path / "d", 8)


def test_sequential_order_is_file_order_over_two_ranks_and_across_a_resume(tmp_path):
    # sequence i holds the value i: what a rank reads says which sequences it got
    write_indexed(tmp_path / "d", [np.full(9, i) for i in range(30)])
    data = SequenceDataset(tmp_path / "d", 8)

    def loaders():
        return [BatchLoader(data, micro_batch_size=2, grad_accum=2, dp_rank=r, dp_size=2, seed=0, shuffle=False)
                for r in range(2)]

    def step(ranks):  # one optimizer step: each rank's micro-batches in consumption order, rank 0 first
        return [int(x) for loader in ranks for _ in range(2) for x in loader.next_micro_batch()[0][:, 0]]

    ranks = loaders()
    steps = [step(ranks) for _ in range(5)]
    assert steps[:3] == [list(range(8 * s, 8 * s + 8)) for s in range(3)]  # step s = sequences 8s .. 8s+7
    assert steps[3] == list(range(0, 8))  # 30 sequences hold 3 steps: the next epoch starts again at sequence 0
    resumed = loaders()
    state = {"epoch": 0, "global_batch": 2}
    for loader in resumed:
        loader.load_state_dict(state)
    assert [step(resumed) for _ in range(3)] == steps[2:5]
    shuffled = BatchLoader(data, micro_batch_size=2, grad_accum=2, dp_rank=0, dp_size=2, seed=0)
    assert [int(x) for x in shuffled.next_micro_batch()[0][:, 0]] != [0, 1]


def pythia_like_tokenizer(tmp_path):
    """A small byte-level BPE saved as tokenizer.json (with end-of-text), standing in for a released one."""
    train_tokenizer(["the cat sat on the mat. " * 50, "a dog ran. " * 50], TokenizerConfig(vocab_size=300),
                    tmp_path / "tok")
    return tmp_path / "tok" / "tokenizer.json"


def megatron_config(tmp_path, **kw):
    return parse(DataConfig, {"source": f"megatron:{tmp_path / 'd'}", "seq_len": 8, "order": "sequential",
                              "tokenizer": {"path": str(pythia_like_tokenizer(tmp_path)), "vocab_size": 300},
                              **kw}, "data")


def test_prepared_folder_holds_the_tokenizer_and_fixes_the_ranges(tmp_path):
    write_indexed(tmp_path / "d", [np.full(9, i) for i in range(40)])
    cfg = megatron_config(tmp_path, val_fraction=0.1, prepared_dir=str(tmp_path / "prep"))
    out = prepare(cfg)
    meta = check_meta(out, vocab_size=320)  # a reused tokenizer may be smaller than the model's vocabulary
    assert (meta["train_sequences"], meta["val_sequences"], meta["train_tokens"]) == (36, 4, 36 * 9)
    train, val = open_split(out, "train", 8), open_split(out, "val", 8)
    assert (len(train), len(val)) == (36, 4) and val[0].tolist() == [36] * 9
    assert prepare(cfg) == out and (out / "tokenizer.json").is_file()
    with pytest.raises(DataError, match=r"vocab_size \(300\) differs from the model's vocab_size \(200\) "
                                        r"\(a reused tokenizer may only be smaller\)"):
        check_meta(out, vocab_size=200)
    write_indexed(tmp_path / "v", [np.full(9, 99)] * 3)
    out = prepare(megatron_config(tmp_path, val_source=f"megatron:{tmp_path / 'v'}"))
    assert (len(open_split(out, "train", 8)), open_split(out, "val", 8)[2].tolist()) == (40, [99] * 9)


def test_config_rules_for_megatron_sources(tmp_path):
    base = {"seq_len": 8, "tokenizer": {"path": "x"}}
    with pytest.raises(ConfigError, match=r"data.source .* a megatron:PREFIX source must be the only source"):
        parse(DataConfig, {**base, "source": ["megatron:a", "b.txt"]}, "data")
    with pytest.raises(ConfigError, match=r"data.tokenizer.path \(None\) must name the tokenizer"):
        parse(DataConfig, {"seq_len": 8, "source": "megatron:a"}, "data")
    with pytest.raises(ConfigError, match=r"data.val_source \('v.txt'\) needs a megatron:PREFIX"):
        parse(DataConfig, {**base, "source": "megatron:a", "val_source": "v.txt"}, "data")
    with pytest.raises(ConfigError, match=r"data.order \('random'\)"):
        parse(DataConfig, {**base, "source": "a.txt", "order": "random"}, "data")


@pytest.mark.parametrize("recipe, where", [
    ("pythia_1b_dense.yaml", "pile-standard-pythia-preshuffled/document.bin not found"),
    ("msit_babylm.yaml", "shared data 'shared:babylm/train_10M' not found at"),
    ("nova_moe.yaml", "cannot load hub dataset roneneldan/TinyStories from the hub or, offline, from the Hugging "
                      "Face cache"),
])
def test_seed_corpora_missing_offline_say_where_and_how_to_fall_back(tmp_path, monkeypatch, capsys, recipe, where):
    monkeypatch.setenv("MOEP_DATA_DIR", str(tmp_path / "shared"))  # an empty shared data folder; hubs offline
    monkeypatch.setenv("MOEP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "shared").mkdir()
    assert prepare_main(["--config", str(REPO / "configs" / recipe)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and where in lines[0], lines
    assert lines[0].endswith("to train on the local corpus instead: --set data.source=shared:corpus"), lines[0]
    assert not list((tmp_path / "cache").rglob("meta.json"))


def test_hub_tokenizer_offline_says_how_to_proceed(monkeypatch):
    from huggingface_hub import constants

    from moep_ds.data.tokenizer import load_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"tokenizer hf:no-such-org/no-such-model: no tokenizer.json in the Hugging "
                                        r"Face cache .* or set data.tokenizer.path to a local tokenizer.json"):
        load_tokenizer("hf:no-such-org/no-such-model")


def test_hub_tokenizer_missing_offline_advice_fits_the_source(tmp_path, monkeypatch):
    """Issue 40 item 13: the advice to train a tokenizer (`--set data.tokenizer.path=null ...`) then failed on a
    megatron: source, whose token ids are its own tokenizer's. It is given for text sources only, where the command
    it names gives a valid recipe; for a megatron: source the message says why no other tokenizer will do."""
    from huggingface_hub import constants

    from moep_ds.config import load_config
    from moep_ds.data.prepare import check_tokenizer_fits

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    hub = {"path": "hf:no-such-org/no-such-model", "vocab_size": 300}
    megatron = megatron_config(tmp_path, tokenizer=hub)
    with pytest.raises(DataError) as err:
        check_tokenizer_fits(megatron, 320)
    text = str(err.value)
    assert "`hf download no-such-org/no-such-model tokenizer.json`" in text and "local_files_only" not in text
    assert "path=null" not in text and text.endswith("(a megatron: source needs the tokenizer it was tokenised with)")
    with pytest.raises(ConfigError, match=r"data.tokenizer.path \(None\) must name the tokenizer"):  # the old advice
        parse(DataConfig, {"source": megatron.source, "seq_len": 8, "tokenizer": {"path": None}}, "data")
    text_source = parse(DataConfig, {"source": "builtin", "seq_len": 8, "tokenizer": hub}, "data")
    with pytest.raises(DataError) as err:
        check_tokenizer_fits(text_source, 320)
    advice = str(err.value).split("or train one: --set ")[1].split()
    assert advice == ["data.tokenizer.path=null", "data.tokenizer.vocab_size=<model.vocab_size>"]
    raw = {"model": {"vocab_size": 320, "d_model": 32, "max_seq_len": 8,
                     "layers": [{"type": "dense", "attention": {"num_heads": 2}}]},
           "data": {"source": "builtin", "seq_len": 8, "tokenizer": hub}}
    (tmp_path / "r.yaml").write_text(json.dumps(raw))
    cfg = load_config(tmp_path / "r.yaml", [a.replace("<model.vocab_size>", "320") for a in advice])
    assert cfg.data.tokenizer.path is None and cfg.data.tokenizer.vocab_size == 320  # the advice works


def test_hub_tokenizer_is_read_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """hf:REPO_ID resolves through huggingface_hub (offline: its cache layout), side files included."""
    from huggingface_hub import constants

    from moep_ds.data.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_sha256

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-lm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    source = pythia_like_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((source.parent / name).read_bytes())
    tok = load_tokenizer("hf:acme/tiny-lm")
    assert tok.vocab_size == 300 and tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert tokenizer_sha256("hf:acme/tiny-lm") == tokenizer_sha256(source)
    copy_tokenizer("hf:acme/tiny-lm", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


# ---- moep-prepare on a megatron: source: a summary of sequences, or one line and nothing written ------------


def run_cli(capsys, *argv):
    code = prepare_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, message):
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {message}"], err


def megatron_cli(tmp_path, source, *more):
    """moep-prepare's arguments for `source`, with the tokenizer pythia_like_tokenizer(tmp_path) made."""
    return ["--source", f"megatron:{source}", "--tokenizer-path", str(tmp_path / "tok" / "tokenizer.json"),
            "--vocab-size", "300", "--seq-len", "8", "--out", str(tmp_path / "out" / "prep"), *more]


def test_cli_prepares_a_megatron_source_and_prints_its_sequences(tmp_path, capsys):
    write_indexed(tmp_path / "d", [np.full(9 + i % 2, i) for i in range(40)])
    pythia_like_tokenizer(tmp_path)
    code, out, err = run_cli(capsys, *megatron_cli(tmp_path, tmp_path / "d"))
    assert code == 0, err
    # val_fraction 0.01 of 40 sequences holds out the last one (10 tokens)
    assert json.loads(out) == {"prepared_dir": str(tmp_path / "out" / "prep"), "vocab_size": 300,
                               "train_sequences": 39, "val_sequences": 1, "train_tokens": 39 * 9 + 19,
                               "val_tokens": 10}
    assert check_meta(tmp_path / "out" / "prep", vocab_size=300)["train_sequences"] == 39


def unusable_sources(tmp_path):
    """(name, the --source prefix, extra flags, the one-line error) for megatron sources no run can use."""
    write_indexed(tmp_path / "short", [np.arange(9)] * 2 + [np.arange(5)] + [np.arange(3)])
    write_indexed(tmp_path / "ok", [np.arange(9)] * 4)
    write_indexed(tmp_path / "one", [np.arange(9)])
    write_indexed(tmp_path / "empty", [])
    write_indexed(tmp_path / "trunc", [np.arange(9)] * 4)
    os.truncate(tmp_path / "trunc.bin", 50)
    fewer = "fewer than data.seq_len + 1 = 9"
    return [
        ("short", "short", [], f"data.source: sequence 2 of {tmp_path / 'short'} has 5 tokens, {fewer}"),
        ("short val", "ok", ["--val-source", f"megatron:{tmp_path / 'short'}"],
         f"data.val_source: sequence 2 of {tmp_path / 'short'} has 5 tokens, {fewer}"),
        ("all held out", "one", ["--val-fraction", "0.5"],
         f"data.val_fraction (0.5) holds out all 1 sequence(s) of {tmp_path / 'one'}, leaving none to train on; "
         f"lower it or set data.val_source"),
        ("empty", "empty", [], f"data.source: {tmp_path / 'empty.idx'} holds no sequences"),
        ("empty val", "ok", ["--val-source", f"megatron:{tmp_path / 'empty'}"],
         f"data.val_source: {tmp_path / 'empty.idx'} holds no sequences"),
        ("truncated", "trunc", [], f"{tmp_path / 'trunc.bin'} has 50 bytes, its index trunc.idx needs 72 "
                                   f"(4 sequences of uint16, dtype code 8)"),
    ]


def test_cli_refuses_megatron_sources_no_run_can_use_and_writes_nothing(tmp_path, capsys):
    tmp_path = tmp_path.resolve()  # megatron_prefix resolves the source path
    cases = unusable_sources(tmp_path)
    pythia_like_tokenizer(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for name, source, flags, message in cases:
        code, _, err = run_cli(capsys, *megatron_cli(tmp_path, tmp_path / source, *flags))
        assert_one_line_error(code, err, message)
        assert sorted(os.listdir(tmp_path)) == before, name  # no out/, no temporary folder beside it


def test_a_reused_folder_does_not_scan_the_sequence_lengths_again(tmp_path, monkeypatch):
    """The length check reads the whole sizes array (Pythia's: 585 MB); every rank of every start calls prepare()."""
    import moep_ds.data.megatron as megatron

    write_indexed(tmp_path / "d", [np.full(9, i) for i in range(40)])
    cfg = megatron_config(tmp_path, val_fraction=0.1, prepared_dir=str(tmp_path / "prep"))
    out = prepare(cfg)
    monkeypatch.setattr(megatron, "check_sequence_lengths", lambda *a: pytest.fail("scanned the sizes again"))
    assert prepare(cfg) == out
