"""The `data` section of a recipe: where the text comes from, how it is tokenized and packed.

Source specs (one string or a list, read in the given order; files of a glob or folder sorted by path):
  path, glob or folder   local .txt/.text/.md (text), .json/.jsonl (json lines), .parquet files
  builtin[:MB]           the embedded grammar corpus (moep_ds/data/builtin.py), generated into the cache
  shared:NAME            $MOEP_DATA_DIR/NAME, default <repo>/../shared/data/NAME (e.g. shared:corpus)
  hf:NAME[:CONFIG]       a Hugging Face hub dataset, train split (needs network)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from moep_ds.schema import Between, Ge, PositiveInt, fail

TokenizerKind = Literal["bpe", "sentencepiece_unigram", "sentencepiece_bpe"]

# byte-level BPE starts from 256 byte symbols plus the end-of-text and mask tokens; sentencepiece with
# byte fallback needs <unk>, the 256 byte pieces and the two specials before its first learned piece
MIN_VOCAB = {"bpe": 258, "sentencepiece_unigram": 300, "sentencepiece_bpe": 300}


@dataclass(kw_only=True)
class TokenizerConfig:
    kind: TokenizerKind = "bpe"
    vocab_size: Annotated[int, Ge(2)] = 16384
    # an existing tokenizer directory (or its tokenizer.json) to reuse instead of training one
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

    def validate(self, path: str) -> None:
        sources = [self.source] if isinstance(self.source, str) else self.source
        if not sources or any(not s.strip() for s in sources):
            fail(f"{path}.source", self.source, "must name at least one non-empty source")

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) else list(self.source)
