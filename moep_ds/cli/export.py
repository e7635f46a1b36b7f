"""`moep-export CHECKPOINT --out DIR [--hf [--native]]`: the command line of moep_ds/evaluation/export.py."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from moep_ds.checkpointing import layout
from moep_ds.distributed.commands import Parser, run_command
from moep_ds.errors import UserError
from moep_ds.fsutil import writing_to
from moep_ds.evaluation.export import check_export_dir, check_outside_runs, checked_tokenizer, export_hf_weights

log = logging.getLogger(__name__)

def parser() -> argparse.ArgumentParser:
    p = Parser(prog="moep-export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="model directory, or run directory (newest complete checkpoint)")
    p.add_argument("--out", required=True, help="directory to write (not in a run directory)")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face (trust_remote_code) directory")
    p.add_argument("--native", action="store_true",
                   help="with --hf: the architecture's own format (GPT-2, Llama, Gemma, GPT-NeoX, Mixtral, Qwen2-MoE, "
                        "Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, GLM-4.5), loaded without trust_remote_code and read back by "
                        "moep-import")
    p.add_argument("--max_shard_size", default="5GB", metavar="SIZE",
                   help="with --native: larger weights are split into shards of at most SIZE with an index, as "
                        "save_pretrained writes them (default 5GB)")
    p.add_argument("--force", action="store_true",
                   help="replace --out as a whole if it exists (once the new export is complete)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recipe overrides stored with the export, e.g. model.layers[1].router.eval_mode=threshold")
    return p


def _main(args: argparse.Namespace) -> int:
    """Streams the weights from the checkpoint to the export one tensor at a time: the model is never built."""
    from moep_ds.checkpointing.model_dir import load_recipe, read_meta, stored_weights
    from moep_ds.evaluation.export import write_model_files

    source, cfg = load_recipe(args.checkpoint, args.set)
    out = Path(args.out)
    check_outside_runs(out, source)
    check_export_dir(out, args.force)  # before the weights are read
    tokenizer_dir = checked_tokenizer(source)
    meta = {**read_meta(source), "exported_from": str(source.resolve())}
    with writing_to(out):  # a full disk: one line naming --out and the space left there
        if args.native:
            export_native(source, cfg, out, args, tokenizer_dir, meta)
        elif args.hf:
            entries, _ = stored_weights(source, cfg, prefix="model.")
            export_hf_weights(entries, cfg, out, tokenizer_dir=tokenizer_dir, meta=meta, overwrite=args.force)
        else:
            entries, extra = stored_weights(source, cfg)
            # not save_weights_dir, which writes into an existing folder file by file: --force replaces the whole
            # folder, and only once the new export is complete
            with layout.output_dir(out) as tmp:
                write_model_files(entries, extra, cfg, tmp, tokenizer_dir, meta)
    log.info("wrote %s", out)
    return 0


def export_native(source: Path, cfg: Any, out: Path, args: argparse.Namespace, tokenizer_dir: Path | None,
                  meta: dict[str, Any]) -> None:
    """--hf --native: interop/export_native.py, written as atomically as the other exports."""
    from moep_ds.checkpointing.model_dir import stored_weights
    from moep_ds.data.tokenizer import load_tokenizer
    from moep_ds.interop.export_native import max_shard_bytes, native_format, write_native_dir

    if not args.hf:
        raise UserError("--native is a form of --hf: pass both")
    max_shard_bytes(args.max_shard_size)
    native_format(cfg.model)  # a model with no native format fails before anything is written
    entries, _ = stored_weights(source, cfg)
    eot_id = load_tokenizer(tokenizer_dir).eot_id if tokenizer_dir is not None else None
    with layout.output_dir(out) as tmp:
        write_native_dir(entries, cfg, tmp, tokenizer_dir, eot_id, meta, args.max_shard_size)


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
