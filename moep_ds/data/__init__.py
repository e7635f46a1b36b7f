"""Data pipeline: tokenizers, corpus preparation, packed datasets, Megatron / GPT-NeoX indexed datasets,
resumable sharded batching, and the embedded grammar corpus.

Names are imported on first use, so `import moep_ds.data` stays cheap and `python -m moep_ds.data.prepare`
does not find its module already imported.
"""
import importlib

_EXPORTS = {
    "BatchLoader": "sampler", "eval_batches": "sampler", "rank_epoch_indices": "sampler",
    "DataConfig": "config", "TokenizerConfig": "config",
    "DataError": "errors",
    "PackedDataset": "dataset", "open_split": "dataset",
    "IndexedDataset": "megatron", "SequenceDataset": "megatron", "write_indexed": "megatron",
    "check_meta": "prepare", "prepare": "prepare",
    "load_tokenizer": "tokenizer", "tokenizer_sha256": "tokenizer", "train_tokenizer": "tokenizer",
    "minimal_pairs": "builtin",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moep_ds.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moep_ds.data.{_EXPORTS[name]}"), name)
