"""`moep-prepare`: corpus preparation (moep_ds/data/prepare.py) from a recipe's `data` section and/or flags.

    moep-prepare --source shared:corpus --vocab_size 16384 --seq_len 512 --num_proc 2 --out prepared/corpus
    python -m moep_ds.cli.prepare --config configs/msit_babylm.yaml          # its `data` section

Flags are spelled with underscores; the dashed spelling (`--num-proc`) is accepted too.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from moep_ds.data.config import DataConfig
from moep_ds.data.errors import DataError
from moep_ds.data.prepare import MEGATRON_SUMMARY, META, SUMMARY, check_meta, prepare
from moep_ds.distributed.commands import Parser, run_guarded


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="moep-prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a recipe YAML; its `data` section is the starting point")
    p.add_argument("--source", nargs="+",
                   help="paths, globs, folders, builtin[:MB], shared:NAME, hf:NAME[:CONFIG], megatron:PREFIX")
    p.add_argument("--val_source", nargs="+", help="validation documents from these sources (same forms as "
                   "--source; hf:NAME reads its validation split) instead of holding out --val_fraction")
    p.add_argument("--out", dest="prepared_dir", help="output folder (default: a cache folder)")
    p.add_argument("--tokenizer", dest="kind", choices=["bpe", "sentencepiece_unigram", "sentencepiece_bpe"])
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--tokenizer_path", help="reuse this tokenizer: a folder, a tokenizer.json or hf:REPO_ID")
    p.add_argument("--seq_len", type=int)
    p.add_argument("--val_fraction", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--num_proc", type=int)
    p.add_argument("--sample_by", choices=["line", "paragraph", "document"])
    p.add_argument("--text_field")
    p.add_argument("--force", action="store_true", help="rebuild even if a matching output exists")
    p.add_argument("--check", action="store_true",
                   help="only check the prepared folder's meta.json against --vocab_size and its tokenizer")
    p.add_argument("--log_level", default="INFO")
    return p.parse_args(argv)


def recipe_sections(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `data` and `model` sections of the recipe given as --config (read as pretrain.py reads it)."""
    from moep_ds.recipe_yaml import read_yaml
    from moep_ds.schema import fail

    recipe = read_yaml(path, what="--config")
    for name in ("data", "model"):
        if not isinstance(recipe.get(name) or {}, dict):
            fail(name, recipe[name], f"must be a mapping (--config {path!r})")
    return dict(recipe.get("data") or {}), dict(recipe.get("model") or {})


def config_from_args(args: argparse.Namespace) -> DataConfig:
    from moep_ds.schema import parse

    data: dict[str, Any] = {}
    model: dict[str, Any] = {}
    if args.config:
        data, model = recipe_sections(args.config)
    tokenizer = dict(data.get("tokenizer") or {})
    for key, value in (("kind", args.kind), ("vocab_size", args.vocab_size), ("path", args.tokenizer_path)):
        if value is not None:
            tokenizer[key] = value
    if tokenizer:
        data["tokenizer"] = tokenizer
    for key in ("prepared_dir", "seq_len", "val_fraction", "seed", "num_proc", "sample_by", "text_field"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    for key in ("source", "val_source"):
        if getattr(args, key):
            data[key] = getattr(args, key) if len(getattr(args, key)) > 1 else getattr(args, key)[0]
    if "seq_len" not in data and model.get("max_seq_len") is not None:
        data["seq_len"] = model["max_seq_len"]  # a recipe's context length, when its data section omits it
    return parse(DataConfig, data, "data")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_guarded(_main, args)  # one-line errors (status 2); SIGINT / SIGTERM remove the partial output


def _main(args: argparse.Namespace) -> int:
    try:
        if args.check:
            if not args.prepared_dir or args.vocab_size is None:
                raise DataError("--check needs --out DIR and --vocab_size N")
            meta = check_meta(args.prepared_dir, vocab_size=args.vocab_size)
            print(json.dumps({"prepared_dir": args.prepared_dir, "ok": True, "vocab_size": meta["vocab_size"]}))
            return 0
        out = prepare(config_from_args(args), force=args.force)
    except OSError as err:  # a source or output the file system refuses, named by the OSError
        raise DataError(str(err)) from None
    meta = json.loads((out / META).read_text())
    summary = {k: meta[k] for k in (MEGATRON_SUMMARY if "megatron" in meta else SUMMARY)}
    print(json.dumps({"prepared_dir": str(out), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
