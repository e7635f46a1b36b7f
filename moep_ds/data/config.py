"""The `data` section of a recipe: where the text comes from, how it is tokenized and packed.

Source specs (one string or a list, read in the given order; files of a glob or folder sorted by path):
  path, glob or folder   local .txt/.text/.md/.train/.dev/.test (text), .json/.jsonl (json lines), .parquet files
  builtin[:MB]           the embedded grammar corpus (moep_ds/data/builtin.py), generated into the cache
  shared:NAME            $MOEP_DATA_DIR/NAME, default <repo>/../shared/data/NAME (e.g. shared:corpus)
  hf:NAME[:CONFIG]       a Hugging Face hub dataset, train split (as a val_source: its validation split; network,
                         or the Hugging Face cache offline)
  megatron:PREFIX        a pre-tokenised Megatron / GPT-NeoX indexed dataset PREFIX.bin + PREFIX.idx (PREFIX may
                         itself start with shared:), read by memory map; needs data.tokenizer.path (its tokenizer)
                         and is the only source of its run

`order: sequential` reads samples in file order (a Megatron source: one stored sequence per sample, as
Pythia's batches); `shuffled` (default) permutes them per epoch with `seed`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from moep_ds.schema import Between, Ge, PositiveInt, fail

MEGATRON = "megatron:"
TokenizerKind = Literal["bpe", "sentencepiece_unigram", "sentencepiece_bpe"]

# byte-level BPE starts from 256 byte symbols plus the end-of-text and mask tokens; sentencepiece with
# byte fallback needs <unk>, the 256 byte pieces and the two specials before its first learned piece
MIN_VOCAB = {"bpe": 258, "sentencepiece_unigram": 300, "sentencepiece_bpe": 300}


@dataclass(kw_only=True)
class TokenizerConfig:
    kind: TokenizerKind = "bpe"
    vocab_size: Annotated[int, Ge(2)] = 16384
    # an existing tokenizer to reuse unchanged instead of training one (no mask token is added): a directory,
    # its tokenizer.json, or hf:REPO_ID (the hub repository's tokenizer.json, e.g. hf:EleutherAI/pythia-1b);
    # the model's vocab_size may then be larger than the tokenizer's (padded, as Pythia pads 50,277 to 50,304)
    path: str | None = None

    def validate(self, path: str) -> None:
        if self.path is None and self.vocab_size < MIN_VOCAB[self.kind]:
            fail(f"{path}.vocab_size", self.vocab_size,
                 f"must be >= {MIN_VOCAB[self.kind]} for a trained {self.kind} tokenizer")


@dataclass(kw_only=True)
class DataConfig:
    source: str | list[str] = "builtin"
    prepared_dir: str | None = None  # None: $MOEP_CACHE_DIR/prepared/<hash of source + settings>
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    seq_len: PositiveInt
    val_fraction: Annotated[float, Between(0.0, 0.5)] = 0.01
    seed: int = 1234
    num_proc: PositiveInt = 1
    text_field: str = "text"  # column read from json/parquet/hub sources
    sample_by: Literal["line", "paragraph", "document"] = "paragraph"  # what one text-file document is
    order: Literal["shuffled", "sequential"] = "shuffled"
    # validation data from elsewhere (e.g. BabyLM's dev set; a hub dataset's validation split): specs as for
    # `source`, a megatron:PREFIX for a megatron: source. With it every document of `source` is trained on and
    # val_fraction is not used; without it a seeded val_fraction of the documents (of a megatron: source, the
    # last ceil(val_fraction x sequences) sequences) is held out and not trained on
    val_source: str | list[str] | None = None

    def validate(self, path: str) -> None:
        sources = [self.source] if isinstance(self.source, str) else self.source
        if not sources or any(not s.strip() for s in sources):
            fail(f"{path}.source", self.source, "must name at least one non-empty source")
        megatron = [s for s in sources if s.startswith(MEGATRON)]
        if megatron and len(sources) > 1:
            fail(f"{path}.source", self.source, f"a {MEGATRON}PREFIX source must be the only source")
        if megatron and self.tokenizer.path is None:
            fail(f"{path}.tokenizer.path", None, f"must name the tokenizer a {MEGATRON} source was tokenised with")
        if self.val_source is None:
            return
        val = self.val_sources
        if not val or any(not s.strip() for s in val):
            fail(f"{path}.val_source", self.val_source, "must name at least one non-empty source, or be null")
        val_megatron = [s for s in val if s.startswith(MEGATRON)]
        if megatron and (len(val) > 1 or not val_megatron):
            fail(f"{path}.val_source", self.val_source, f"needs a {MEGATRON}PREFIX here and in {path}.source")
        if val_megatron and not megatron:
            fail(f"{path}.val_source", self.val_source, f"a {MEGATRON}PREFIX needs a {MEGATRON}PREFIX {path}.source")

    @property
    def megatron_prefix(self) -> str | None:
        """PREFIX of a megatron:PREFIX source, else None."""
        source = self.sources[0]
        return source[len(MEGATRON):] if source.startswith(MEGATRON) else None

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) else list(self.source)

    @property
    def val_sources(self) -> list[str]:
        """The validation source specs; empty when validation is held out of `source`."""
        if self.val_source is None:
            return []
        return [self.val_source] if isinstance(self.val_source, str) else list(self.val_source)
