"""Corpus preparation: sources -> tokenizer -> packed train.bin / val.bin + meta.json (`moep-prepare`).

# N tokens, D documents

Pipeline: resolve and hash the sources (missing or empty input fails here, before anything is written);
read them with `datasets`; split documents into train/validation by a seeded draw per document (or read the
validation documents from `data.val_source`); train a tokenizer on the train documents (or reuse one); tokenize
with `datasets.map(num_proc=...)`; write each split as the concatenation of its documents, each followed by
end-of-text. Everything is built in a temporary folder beside the output and moved in only when complete
(meta.json last), so a failure leaves no partial output. A complete output with matching settings and source
hashes is reused as is.
A `megatron:PREFIX` source is already tokenised: its folder holds only the reused tokenizer and a meta.json that
fixes the train and validation sequence ranges (moep_ds/data/megatron.py reads the tokens in place).

The command line is moep_ds/cli/prepare.py (`moep-prepare`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moep_ds.data.builtin import default_cache_dir
from moep_ds.data.config import MEGATRON, DataConfig
from moep_ds.data.errors import DataError
from moep_ds.data.sources import Part, load_documents, megatron_prefix, resolve_sources, scan_sources
from moep_ds.data.tokenizer import (TOKENIZER_FILE, HubTokenizerMissing, TextTokenizer, copy_tokenizer, load_tokenizer,
                                    save_tokenizer, tokenizer_file, tokenizer_sha256, train_tokenizer)
from moep_ds.fsutil import atomic_dir, write_error, writing_to

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META, TRAIN_BIN, VAL_BIN = "meta.json", "train.bin", "val.bin"
MAP_BATCH, WRITE_BATCH = 1000, 20_000
# the meta.json keys moep-prepare prints; a megatron: folder counts stored sequences and has no timing phases
SUMMARY = ("vocab_size", "train_tokens", "val_tokens", "train_documents", "val_documents", "invalid_utf8_bytes",
           "seconds", "phase_seconds", "tokens_per_second")
MEGATRON_SUMMARY = ("vocab_size", "train_sequences", "val_sequences", "train_tokens", "val_tokens")


def prepare(cfg: DataConfig, *, force: bool = False) -> Path:
    """Prepare (or reuse) the packed corpus described by `cfg`; returns the folder holding train.bin,
    val.bin, meta.json and the tokenizer files."""
    lock_dir()
    if cfg.megatron_prefix is not None:
        return prepare_megatron(cfg, force=force)
    parts = resolve_sources(cfg.sources)
    val_parts = resolve_sources(cfg.val_sources, hub_split="validation")
    if cfg.tokenizer.path is not None:
        check_reusable_tokenizer(cfg)
    scans, val_scans = scan_sources(parts), scan_sources(val_parts) if val_parts else []
    settings = prepare_settings(cfg, scans, val_scans)
    out = Path(cfg.prepared_dir).expanduser() if cfg.prepared_dir else default_prepared_dir(cfg, scans, val_scans)
    with output_lock(out):
        meta = None if force else reusable_meta(out, settings)
        if meta is not None:
            check_windows(meta, cfg)
            logger.info("reusing prepared data in %s", out)
            return out
        build_atomically(out, lambda work: build(cfg, parts, val_parts, scans + val_scans, settings, work))
    return out


def check_meta(prepared_dir: str | os.PathLike, *, vocab_size: int) -> dict[str, Any]:
    """meta.json of a prepared folder, after checking it against the model's vocabulary and the tokenizer
    file beside it; raises DataError naming the field and both values."""
    meta_path = Path(prepared_dir) / META
    meta = read_meta(Path(prepared_dir))
    if meta is None:
        raise DataError(f"no complete {META} in {prepared_dir}; run moep-prepare first")
    # a reused tokenizer may be padded by the model (Pythia: 50,277 ids, 50,304 rows); a trained one is built at
    # the model's size (its last id is the mask token MoEP-MSIT uses), so any difference there is a mistake
    padded = meta.get("tokenizer_reused_from") is not None and meta["vocab_size"] < vocab_size
    if meta["vocab_size"] != vocab_size and not padded:
        raise DataError(f"{meta_path} vocab_size ({meta['vocab_size']}) differs from the model's vocab_size "
                        f"({vocab_size})" + (" (a reused tokenizer may only be smaller)"
                                             if meta.get("tokenizer_reused_from") is not None else ""))
    if not tokenizer_file(prepared_dir).is_file():
        raise DataError(f"no {TOKENIZER_FILE} in {prepared_dir}")
    sha = tokenizer_sha256(prepared_dir)
    if sha != meta["tokenizer_sha256"]:
        raise DataError(f"{Path(prepared_dir) / TOKENIZER_FILE} sha256 ({sha[:16]}...) differs from {META} "
                        f"tokenizer_sha256 ({meta['tokenizer_sha256'][:16]}...)")
    return meta


def check_windows(meta: dict[str, Any], cfg: DataConfig) -> None:
    """Both splits must hold at least one window of seq_len + 1 tokens."""
    need = cfg.seq_len + 1
    if meta["train_tokens"] < need:
        raise DataError(f"corpus too short: the train split has {meta['train_tokens']} tokens, fewer than one "
                        f"window (data.seq_len + 1 = {need})")
    if cfg.val_source is not None and meta["val_tokens"] < need:
        raise DataError(f"validation split too short: {meta['val_tokens']} tokens in {meta['val_documents']} "
                        f"document(s) of data.val_source {cfg.val_source!r}, fewer than one window "
                        f"(data.seq_len + 1 = {need})")
    if cfg.val_source is None and cfg.val_fraction > 0 and meta["val_tokens"] < need:
        raise DataError(f"validation split too short: {meta['val_tokens']} tokens in {meta['val_documents']} "
                        f"document(s), fewer than one window (data.seq_len + 1 = {need}); raise "
                        f"data.val_fraction ({cfg.val_fraction}) or set it to 0")


def check_tokenizer_fits(cfg: DataConfig, model_vocab_size: int) -> None:
    """A tokenizer larger than the model, refused before preparing: tokenizing a large corpus with a tokenizer whose
    ids the model's embedding cannot hold would take hours before check_meta refused the result."""
    if cfg.tokenizer.path is not None:
        tok = check_reusable_tokenizer(cfg)
        if tok.vocab_size > model_vocab_size:
            raise DataError(f"data.tokenizer.path ({cfg.tokenizer.path!r}) has {tok.vocab_size} ids, more than "
                            f"model.vocab_size ({model_vocab_size}); a reused tokenizer may only be smaller")
    elif cfg.tokenizer.vocab_size > model_vocab_size:  # a smaller one: check_meta names the prepared folder
        raise DataError(f"data.tokenizer.vocab_size ({cfg.tokenizer.vocab_size}) is larger than model.vocab_size "
                        f"({model_vocab_size}); a trained tokenizer is built at the model's size")


def check_reusable_tokenizer(cfg: DataConfig) -> TextTokenizer:
    try:
        tok = load_tokenizer(cfg.tokenizer.path)
    except HubTokenizerMissing as err:
        if cfg.megatron_prefix is not None:  # its token ids are that tokenizer's: no other one will do
            raise DataError(f"{err} (a {MEGATRON} source needs the tokenizer it was tokenised with)") from None
        raise DataError(f"{err}, or train one: --set data.tokenizer.path=null "
                        f"data.tokenizer.vocab_size=<model.vocab_size>") from None
    if tok.vocab_size != cfg.tokenizer.vocab_size:
        raise DataError(f"tokenizer {cfg.tokenizer.path} has vocab_size {tok.vocab_size}, "
                        f"data.tokenizer.vocab_size is {cfg.tokenizer.vocab_size}")
    return tok


# ---- identity of a preparation --------------------------------------------------------------------------


def prepare_settings(cfg: DataConfig, scans: list[dict[str, Any]], val_scans: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the bytes of the output depend on (not num_proc, seq_len or the output folder)."""
    tok = cfg.tokenizer

    def identity(scans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: s.get(k) for k in ("path", "sha256", "hub", "config") if k in s} for s in scans]

    settings = {
        "format": FORMAT_VERSION,
        "sources": identity(scans),
        "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size,
                      "reused_sha256": tokenizer_sha256(tok.path) if tok.path else None},
        "val_fraction": cfg.val_fraction, "seed": cfg.seed, "sample_by": cfg.sample_by, "text_field": cfg.text_field,
    }
    if val_scans:  # only then: folders prepared before val_source existed keep their identity
        settings.update(val_sources=identity(val_scans), val_fraction=None)
    return settings


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def default_prepared_dir(cfg: DataConfig, scans: list[dict[str, Any]], val_scans: list[dict[str, Any]]) -> Path:
    """`$MOEP_CACHE_DIR/prepared/<first source>-<hash>`: the hash covers source paths and settings but not
    file contents, so edited sources are rebuilt in the same folder."""
    key = {"sources": [s.get("path") or s.get("hub") for s in scans], "tokenizer": vars(cfg.tokenizer),
           "val_fraction": cfg.val_fraction, "seed": cfg.seed, "sample_by": cfg.sample_by,
           "text_field": cfg.text_field, "format": FORMAT_VERSION}
    if val_scans:
        key.update(val_sources=[s.get("path") or s.get("hub") for s in val_scans], val_fraction=None)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", cfg.sources[0]).strip("_")[-40:] or "data"
    return default_cache_dir() / "prepared" / f"{slug}-{sha256_json(key)[:12]}"


def lock_path(out: Path) -> Path:
    # kept in the cache, not beside the output, so that a failed run leaves nothing at the output path
    return lock_dir() / f"{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}.lock"


def lock_dir() -> Path:
    """$MOEP_CACHE_DIR/locks, made if needed: first thing, since every preparation takes a lock there (and a builtin
    source is written to the cache); a cache that cannot be made is one line naming $MOEP_CACHE_DIR."""
    locks = default_cache_dir() / "locks"
    with cache_errors():
        locks.mkdir(parents=True, exist_ok=True)
    return locks


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """The lock of `out` (lock_path) held: data-parallel ranks may all call prepare(); one builds."""
    from filelock import FileLock

    lock = FileLock(str(lock_path(out)))
    with cache_errors():
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def cache_errors() -> Iterator[None]:
    """A cache folder that cannot be written (read-only, under a file, full) is one line naming $MOEP_CACHE_DIR."""
    try:
        yield
    except OSError as err:
        raise DataError(write_error("$MOEP_CACHE_DIR", default_cache_dir(), err)) from None


def read_meta(prepared_dir: Path) -> dict[str, Any] | None:
    """meta.json as a dict; None when absent or unreadable (an interrupted or foreign folder)."""
    try:
        meta = json.loads((Path(prepared_dir) / META).read_text())
    except (OSError, ValueError):
        return None
    required = {"vocab_size", "dtype", "train_tokens", "val_tokens", "tokenizer_sha256"}
    return meta if isinstance(meta, dict) and required <= meta.keys() else None


def reusable_meta(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The existing meta.json if `out` is complete and was built from exactly these settings and sources."""
    meta = read_meta(out)
    if meta is None:
        return None
    if meta.get("settings_sha256") != sha256_json(settings):
        logger.info("%s was prepared from other settings or source contents; rebuilding", out)
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, tokens in ((TRAIN_BIN, meta["train_tokens"]), (VAL_BIN, meta["val_tokens"])):
        if not (out / name).is_file() or (out / name).stat().st_size != tokens * itemsize:
            logger.warning("%s in %s is missing or truncated; rebuilding", name, out)
            return None
    if not tokenizer_file(out).is_file() or tokenizer_sha256(out) != meta["tokenizer_sha256"]:
        logger.warning("tokenizer in %s differs from %s; rebuilding", out, META)
        return None
    return meta


# ---- a pre-tokenised Megatron source ---------------------------------------------------------------------


def prepare_megatron(cfg: DataConfig, *, force: bool = False) -> Path:
    """A folder with the reused tokenizer and a meta.json that fixes the train and validation sequence ranges
    of a megatron:PREFIX source; the tokens stay where they are (nothing is re-tokenised or copied)."""
    from moep_ds.data.megatron import check_sequence_lengths

    ranges = megatron_ranges(cfg)
    train = ranges["train"][0]
    tok = check_reusable_tokenizer(cfg)
    layout = {split: {"prefix": data.prefix, "start": start, "stop": stop, "dtype_code": data.dtype_code,
                      "idx_bytes": data.idx_path.stat().st_size} for split, (data, start, stop) in ranges.items()}
    settings = {"format": FORMAT_VERSION, "megatron": layout, "tokenizer_sha256": tokenizer_sha256(cfg.tokenizer.path)}
    if cfg.prepared_dir:
        out = Path(cfg.prepared_dir).expanduser()
    else:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", cfg.megatron_prefix).strip("_")[-40:]
        out = default_cache_dir() / "prepared" / f"megatron_{slug}-{sha256_json(settings)[:12]}"
    with output_lock(out):
        meta = None if force else read_meta(out)
        if meta is not None and meta.get("settings_sha256") == sha256_json(settings) and \
                tokenizer_file(out).is_file() and tokenizer_sha256(out) == meta["tokenizer_sha256"]:
            logger.info("reusing %s for %s", out, cfg.sources[0])
            return out

        def write(work: Path) -> None:
            # here, not before the reuse test: the check reads the whole sizes array (Pythia's: 585 MB), which
            # every rank of every start would otherwise do; a reused folder was checked when it was built
            check_sequence_lengths(train, cfg.seq_len, "data.source")
            if cfg.val_source is not None:
                check_sequence_lengths(ranges["val"][0], cfg.seq_len, "data.val_source")
            obtain_tokenizer(cfg, None, None, work)
            tokens = {split: int(data.sizes_S[start:stop].sum(dtype=np.int64))
                      for split, (data, start, stop) in ranges.items()}
            meta = {"format": FORMAT_VERSION, "vocab_size": tok.vocab_size, "dtype": train.dtype.name,
                    "eot_id": tok.eot_id, "mask_id": tok.mask_id, "tokenizer_kind": "reused",
                    "tokenizer_reused_from": cfg.tokenizer.path, "tokenizer_sha256": tokenizer_sha256(work),
                    "train_tokens": tokens["train"], "val_tokens": tokens["val"],
                    "train_sequences": layout["train"]["stop"] - layout["train"]["start"],
                    "val_sequences": layout["val"]["stop"] - layout["val"]["start"],
                    "source": cfg.sources, "val_source": cfg.val_source, "megatron": layout,
                    "settings_sha256": sha256_json(settings)}
            (work / META).write_text(json.dumps(meta, indent=1) + "\n")

        build_atomically(out, write)
    logger.info("%s: %d train / %d validation sequences (%s)", cfg.sources[0], layout["train"]["stop"] -
                layout["train"]["start"], layout["val"]["stop"] - layout["val"]["start"], out)
    return out


def megatron_ranges(cfg: DataConfig) -> dict[str, tuple[Any, int, int]]:
    """(dataset, start, stop) of the train and validation sequences: data.val_source's file, or the trailing
    val_fraction of the source. Checked here, from the .idx header alone, so that a source no run can use fails
    before anything is written: each split must hold some sequences (their lengths: when the folder is built)."""
    from moep_ds.data.megatron import IndexedDataset, held_out

    def open_checked(prefix: str, field: str) -> IndexedDataset:
        data = IndexedDataset(megatron_prefix(prefix, field))
        if len(data) == 0:
            raise DataError(f"{field}: {data.idx_path} holds no sequences")
        return data

    train = open_checked(cfg.megatron_prefix, "data.source")
    if cfg.val_source is not None:
        val = open_checked(cfg.val_sources[0][len(MEGATRON):], "data.val_source")
        return {"train": (train, 0, len(train)), "val": (val, 0, len(val))}
    stop = len(train) - held_out(len(train), cfg.val_fraction)
    if stop == 0:
        raise DataError(f"data.val_fraction ({cfg.val_fraction}) holds out all {len(train)} sequence(s) of "
                        f"{train.prefix}, leaving none to train on; lower it or set data.val_source")
    return {"train": (train, 0, stop), "val": (train, stop, len(train))}


# ---- building ------------------------------------------------------------------------------------------


def build_atomically(out: Path, build_into: Callable[[Path], Any]) -> None:
    """`build_into(work)` fills a fresh folder beside `out`, which is then published as `out`; nothing is left
    behind on failure. A full disk is named as such, with `out` and the space left there (not as a source that
    could not be read: the `datasets` cache of the sources is written in `work`)."""
    with writing_to(out), atomic_dir(out, publish=publish) as work:  # a full disk: one line naming `out`
        build_into(work)


def publish(work: Path, out: Path) -> None:
    """Move the finished files into `out`; meta.json goes last, so its presence means complete."""
    if not out.exists():
        try:
            os.replace(work, out)
            return
        except OSError:  # another node published first (locks are per machine); replace its files in turn
            pass
    (out / META).unlink(missing_ok=True)
    for f in sorted(work.iterdir(), key=lambda p: p.name == META):
        os.replace(f, out / f.name)


def build(cfg: DataConfig, parts: list[Part], val_parts: list[Part], scans: list[dict[str, Any]],
          settings: dict[str, Any], work: Path) -> dict[str, Any]:
    import datasets

    clock = PhaseClock()
    docs = load_documents(parts, cfg, work / "hf_cache")
    if docs.num_rows == 0:
        raise DataError(f"empty corpus: {parts[0].describe()} ... hold no documents")
    if val_parts:  # validation documents follow the train ones
        val_docs = load_documents(val_parts, cfg, work / "hf_cache")
        val_mask = np.arange(docs.num_rows + val_docs.num_rows) >= docs.num_rows
        docs = datasets.concatenate_datasets([docs, val_docs])
    else:
        val_mask = split_mask(docs.num_rows, cfg.val_fraction, cfg.seed)
    clock.lap("read", f"{docs.num_rows} documents")
    tok = obtain_tokenizer(cfg, docs, val_mask, work)
    clock.lap("tokenizer", f"{cfg.tokenizer.kind}, vocab_size {tok.vocab_size}")
    tokenized = docs.map(DocumentEncoder(str(work / TOKENIZER_FILE), cfg.sample_by, cfg.num_proc == 1),
                         batched=True, batch_size=MAP_BATCH, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                         remove_columns=["text"], cache_file_name=str(work / "hf_cache" / "tokens.arrow"),
                         desc="tokenizing")
    clock.lap("tokenize", f"num_proc {cfg.num_proc}")
    dtype = bin_dtype(tok.vocab_size)
    counts = write_bins(tokenized, val_mask, tok.eot_id, dtype, work)
    if counts["train_documents"] + counts["val_documents"] == 0:
        raise DataError(f"empty corpus: {docs.num_rows} document(s), all blank ({parts[0].describe()})")
    del docs, tokenized
    shutil.rmtree(work / "hf_cache")
    clock.lap("write", f"{counts['train_tokens'] + counts['val_tokens']} tokens as {dtype.name}")
    warn_lopsided_split(counts, cfg)
    seconds = clock.total()
    meta = {
        "format": FORMAT_VERSION, "vocab_size": tok.vocab_size, "dtype": dtype.name,
        "eot_id": tok.eot_id, "mask_id": tok.mask_id,
        "tokenizer_kind": cfg.tokenizer.kind, "tokenizer_reused_from": cfg.tokenizer.path,
        "tokenizer_sha256": tokenizer_sha256(work), **counts, "seed": cfg.seed,
        "val_fraction": cfg.val_fraction, "sample_by": cfg.sample_by, "text_field": cfg.text_field,
        "source": cfg.sources, "val_source": cfg.val_source, "sources": scans,
        "invalid_utf8_bytes": sum(s.get("invalid_utf8_bytes", 0) for s in scans),
        "settings_sha256": sha256_json(settings), "seconds": round(seconds, 3), "phase_seconds": clock.phases,
        "tokens_per_second": round((counts["train_tokens"] + counts["val_tokens"]) / seconds),
    }
    check_windows(meta, cfg)
    (work / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def warn_lopsided_split(counts: dict[str, int], cfg: DataConfig) -> None:
    """Documents go to one split whole: a corpus of a few long documents (text files without blank lines, read
    by paragraph, are one document each) can lose far more than val_fraction of its tokens to validation."""
    share = counts["val_tokens"] / max(1, counts["train_tokens"] + counts["val_tokens"])
    if cfg.val_source is None and share > 2 * cfg.val_fraction + 0.005:
        logger.warning("validation holds %.1f%% of the tokens (%d of %d documents), data.val_fraction is %g: "
                       "documents are split whole; with data.sample_by %r this corpus has few, long ones. "
                       "Set data.sample_by=line, data.val_fraction=0 or a data.val_source", 100 * share,
                       counts["val_documents"], counts["train_documents"] + counts["val_documents"],
                       cfg.val_fraction, cfg.sample_by)


class PhaseClock:
    """Wall time per preparation phase, kept in meta.json; the log line adds the CPU time of this process
    and its finished workers, which says more than wall time on a shared machine."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.last_cpu = self.cpu_seconds()
        self.phases: dict[str, float] = {}

    @staticmethod
    def cpu_seconds() -> float:
        import resource

        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)

    def lap(self, name: str, detail: str) -> None:
        now, cpu = time.perf_counter(), self.cpu_seconds()
        self.phases[name] = round(now - self.last, 3)
        logger.info("%s: %.2f s wall, %.2f s cpu (%s)", name, self.phases[name], cpu - self.last_cpu, detail)
        self.last, self.last_cpu = now, cpu

    def total(self) -> float:
        return time.perf_counter() - self.start


def bin_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, uint32 once the vocabulary exceeds 65,535 ids."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def split_mask(num_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Document d goes to validation iff its seeded uniform draw is < val_fraction; with val_fraction > 0
    and at least two documents, each split keeps at least one document."""
    u_D = np.random.default_rng([seed, 1]).random(num_docs)
    val_D = u_D < val_fraction
    if val_fraction > 0 and num_docs > 1:
        val_D[np.argmin(u_D)] = True
        val_D[np.argmax(u_D)] = False
    return val_D


def document_text(text: str | None, sample_by: str) -> str | None:
    """The text a document contributes, or None for a blank one. Paragraphs lose the extra newlines of
    runs of blank lines around them."""
    if text is None:  # a null field (JSON null, a missing parquet value) holds no text: a blank document
        return None
    if sample_by == "paragraph":
        text = text.strip("\n")
    return text if text.strip() else None


def obtain_tokenizer(cfg: DataConfig, docs, val_mask: np.ndarray, work: Path) -> TextTokenizer:
    """Copy the configured tokenizer into `work`, or train one there on the train documents."""
    if cfg.tokenizer.path is not None:
        copy_tokenizer(cfg.tokenizer.path, work)
        tok = load_tokenizer(work)
        if not (work / "tokenizer_config.json").is_file():
            save_tokenizer(tok.tok, work)  # the transformers side files, for exports
        return tok
    train_docs = docs.select(np.flatnonzero(~val_mask))
    texts = (t for batch in train_docs.iter(batch_size=MAP_BATCH) for t in
             (document_text(x, cfg.sample_by) for x in batch["text"]) if t is not None)
    logger.info("training a %s tokenizer (vocab_size %d) on %d documents", cfg.tokenizer.kind,
                cfg.tokenizer.vocab_size, train_docs.num_rows)
    return train_tokenizer(texts, cfg.tokenizer, work, seed=cfg.seed)


class DocumentEncoder:
    """`datasets.map` function: batch of {"text"} -> {"ids"}; blank documents get no ids. Loads the tokenizer
    lazily in each worker process."""

    def __init__(self, tokenizer_path: str, sample_by: str, parallel: bool):
        self.tokenizer_path, self.sample_by, self.parallel = tokenizer_path, sample_by, parallel
        self._tok: TextTokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._tok is None:
            if not self.parallel:  # num_proc workers: one thread each, and no fork-after-threads warning
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._tok = load_tokenizer(self.tokenizer_path)
        texts = [document_text(t, self.sample_by) for t in batch["text"]]
        nonblank = [t for t in texts if t is not None]
        encoded = iter(self._tok.encode_batch(nonblank))
        return {"ids": [next(encoded) if t is not None else [] for t in texts]}


def write_bins(tokenized, val_mask: np.ndarray, eot_id: int, dtype: np.dtype, work: Path) -> dict[str, int]:
    """Stream the tokenized documents into train.bin / val.bin, end-of-text after each document."""
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    counts = {"train_tokens": 0, "val_tokens": 0, "train_documents": 0, "val_documents": 0}
    row = 0
    with open(work / TRAIN_BIN, "wb") as train_f, open(work / VAL_BIN, "wb") as val_f:
        batches = tokenized.with_format("arrow").iter(batch_size=WRITE_BATCH)
        for table in tqdm(batches, total=math.ceil(tokenized.num_rows / WRITE_BATCH), desc="writing bins"):
            ids = table.column("ids").combine_chunks()
            lengths_D = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
            flat_N = ids.flatten().to_numpy(zero_copy_only=False)
            is_val_D = val_mask[row:row + len(lengths_D)]
            row += len(lengths_D)
            for split, f, keep_D in (("train", train_f, ~is_val_D), ("val", val_f, is_val_D)):
                keep_D = keep_D & (lengths_D > 0)
                tokens_N = with_eot(flat_N, lengths_D, keep_D, eot_id)
                tokens_N.astype(dtype).tofile(f)
                counts[f"{split}_tokens"] += int(tokens_N.size)
                counts[f"{split}_documents"] += int(keep_D.sum())
    return counts


def with_eot(flat_N: np.ndarray, lengths_D: np.ndarray, keep_D: np.ndarray, eot_id: int) -> np.ndarray:
    """Tokens of the kept documents in order, each document followed by `eot_id`."""
    kept_N = flat_N[np.repeat(keep_D, lengths_D)]
    return np.insert(kept_N, np.cumsum(lengths_D[keep_D]), eot_id)
