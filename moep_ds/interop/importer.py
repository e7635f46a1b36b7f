"""`moep-import SRC --out RUN_DIR --config RECIPE`: weights from elsewhere as an ordinary moep_ds checkpoint.

    RUN_DIR/checkpoints/step_<N>/     the run-directory format training writes (checkpointing/), model only:
                                      DCP model tensors (true shapes), extra_state.json, config.yaml (the recipe,
                                      init_from and upcycle cleared: the weights are in it), meta.json (step N,
                                      its tokens, where the weights came from, and the source's special tokens:
                                      config.json's bos / eos / pad ids and its generation_config.json, which
                                      the native export writes back), the source's tokenizer files,
                                      MANIFEST.json (every file's checksum), COMPLETE

N is the revision's step (`@stepN`, Pythia's checkpoints), else 0. moep-eval, moep-export and moep-generate read
the run directory as they read a trained one; training starts from it with `model.init_from: RUN_DIR` (it has no
optimizer state to `--resume`). RUN_DIR appears whole or not at all.

Under a launcher (`torchrun --nproc_per_node N -m moep_ds.cli.import_model ...`, WORLD_SIZE > 1) no process holds
the whole model (`import_split`): the model is split over the ranks as moep-eval splits it (distributed/inference.py),
ZeRO-3 partitions by default or, with `expert_parallel`, 1/N of every routed stage's experts per rank and the rest
whole; each rank reads only what it holds from SRC (its experts' own tensors, its partitions' rows) and writes it,
tensors held whole by every rank in even shares (distributed/owned_state.py). The checkpoint is the one a single
process writes, tensor for tensor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from moep_ds.checkpointing import layout, manifest, model_state, sharded
from moep_ds.checkpointing.model_dir import write_recipe_files
from moep_ds.errors import UserError
from moep_ds.fsutil import disk_full_reason, writing_to
from moep_ds.interop.sources import source_weights
from moep_ds.interop.weights import fill_pieces

log = logging.getLogger(__name__)


def check_out_dir(out: Path) -> None:
    """A new or empty folder: an import never writes into another run's directory."""
    layout.check_dir_target("--out", out)
    if out.exists() and not layout.is_empty_dir(out):
        raise UserError(f"--out ({str(out)!r}) exists and is not empty: moep-import writes a new run directory")


def build_imported(src: str, cfg: Any) -> tuple[torch.nn.Module, Any]:
    """The recipe's model with the weights of `src` (the routers of an upcycled one seeded by train.seed, as
    the trainer seeds them), and the resolved source."""
    from moep_ds.models.causal_lm import build_model

    weights, keep, source = source_weights(src, cfg.model, cfg.data.tokenizer, what="SRC")
    model = build_model(cfg.model, initialise=False)
    if keep:
        torch.manual_seed(cfg.train.seed)
        model.init_weights(None)
    fill_pieces(model_state.module_pieces(model), weights, keep, f"SRC ({src!r})")
    return model.eval(), source


def import_checkpoint(src: str, cfg: Any, out: str | Path) -> Path:
    """Write RUN_DIR `out` (see the module docstring); returns the checkpoint's folder."""
    out = Path(out)
    check_out_dir(out)
    model, source = build_imported(src, cfg)
    stored, meta, tag = checkpoint_record(cfg, source)
    tokenizer_dir = source_tokenizer(source.folder)
    with writing_to(out), layout.output_dir(out) as tmp:  # a full disk: one line naming RUN_DIR and the space left
        write_model_checkpoint(model, stored, layout.checkpoint_root(tmp) / tag, tokenizer_dir, meta)
    log.info("imported %s into %s (step %d); its recipe: %s", src, out, meta["step"],
             layout.checkpoint_root(out) / tag / "config.yaml")
    return layout.checkpoint_root(out) / tag


def checkpoint_record(cfg: Any, source: Any) -> tuple[Any, dict[str, Any], str]:
    """(the recipe stored with the weights: init_from and upcycle cleared, as the weights are in it; meta.json;
    the checkpoint's tag), for the source's step."""
    step = source.step or 0
    stored = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None, upcycle=None))
    meta = {"step": step, "tokens": imported_tokens(step, cfg), **source.describe(),
            "upcycled": cfg.model.upcycle is not None, **source_tokens(source.folder)}
    return stored, meta, layout.checkpoint_tag(step)


def source_tokens(folder: Path) -> dict[str, Any]:
    """The source's special tokens as meta.json keeps them (checkpointing/model_dir.py): of a Hugging Face folder the
    bos / eos / pad ids its config.json sets (eos may be a list) and its generation_config.json, of a moep_ds
    checkpoint what its meta.json carries of them. The native export writes them back, so that the export stops
    generating where the source stops (issue 45: an import whose source ended at id 92 exported eos <|endoftext|>)."""
    from moep_ds.checkpointing.model_dir import (GENERATION_CONFIG, SPECIAL_TOKEN_KEYS, SPECIAL_TOKENS, read_meta,
                                                 resolve_model_dir)
    from moep_ds.interop.hf_weights import is_hf_folder, json_object, read_config

    if not is_hf_folder(folder):
        meta = read_meta(resolve_model_dir(folder))
        return {key: meta[key] for key in (SPECIAL_TOKENS, GENERATION_CONFIG) if key in meta}
    hf = read_config(folder)
    out: dict[str, Any] = {SPECIAL_TOKENS: {key: token_ids(hf[key], folder / "config.json", key)
                                            for key in SPECIAL_TOKEN_KEYS if key in hf}}
    generation = folder / "generation_config.json"
    if generation.is_file():
        out[GENERATION_CONFIG] = json_object(generation)
    return out


def token_ids(value: Any, file: Path, key: str) -> int | list[int] | None:
    """A special token id as config.json may set it: an id, a list of ids (eos), or null."""
    def is_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if value is None or is_id(value) or (isinstance(value, list) and value and all(map(is_id, value))):
        return value
    raise UserError(f"{str(file)!r}: {key} = {value!r} is no token id (an id, a list of ids, or null)")


def import_split(src: str, cfg: Any, out: str | Path, expert_parallel: bool = False) -> Path | None:
    """`import_checkpoint` on every rank of a launch, each rank holding and writing only its part (module
    docstring); returns the checkpoint's folder on rank 0, None on the others."""
    import torch.distributed as dist

    from moep_ds.distributed.inference import build_split, stop_together
    from moep_ds.distributed.owned_state import written_model_pieces
    from moep_ds.distributed.rank_errors import agreed
    from moep_ds.errors import SharedUserError

    out = Path(out)
    if cfg.model.upcycle is not None:  # the seeded routers would be initialised per rank's part
        raise SharedUserError("moep-import under a launcher reads a model's own weights; upcycling (model.upcycle) "
                              "runs in one process, or in training from the dense source (model.init_from)")
    model, plan, _, _ = build_split(cfg, "float32", expert_parallel)
    rank = dist.get_rank()
    agreed(check_out_dir, out, run=rank == 0)
    weights, _, source = agreed(source_weights, src, cfg.model, cfg.data.tokenizer)
    agreed(fill_pieces, model_state.module_pieces(model, plan, partitions=True), weights, set(), f"SRC ({src!r})")
    stored, meta, tag = checkpoint_record(cfg, source)
    tokenizer_dir = source_tokenizer(source.folder) if rank == 0 else None
    pieces = written_model_pieces(model, plan)
    aliases = model_state.tied_names(model)
    with contextlib.ExitStack() as stack:  # RUN_DIR appears whole or not at all: rank 0 writes a temporary sibling
        tmp = [agreed(writing, out, lambda: str(stack.enter_context(layout.output_dir(out))), run=rank == 0)]
        dist.broadcast_object_list(tmp, src=0)
        path = layout.checkpoint_root(Path(tmp[0])) / tag
        agreed(writing, out, lambda: path.mkdir(parents=True), run=rank == 0)
        error = None
        try:
            sharded.save(pieces, path, aliases=aliases)
        except (Exception, sharded.DCPError) as err:  # DCP raises the same exception on every rank
            error = SharedUserError(disk_full_reason(err, out) or f"writing {str(out)!r} failed: "
                                    f"{sharded.first_line(err)}")
        agreed(writing, out, lambda: finish(model, stored, path, tokenizer_dir, meta), run=rank == 0 and not error)
        stop_together(error, f"--out ({str(out)!r})")
    dist.barrier()  # rank 0 has moved RUN_DIR into place
    if rank == 0:
        held = "of the experts, the rest whole" if expert_parallel else "of the model (ZeRO-3)"
        log.info("imported %s into %s (step %d) on %d ranks, each holding 1/%d %s; its recipe: %s", src, out,
                 meta["step"], dist.get_world_size(), dist.get_world_size(), held,
                 layout.checkpoint_root(out) / tag / "config.yaml")
        return layout.checkpoint_root(out) / tag
    return None


def writing(out: Path, fn: Any) -> Any:
    """fn(), a failed write one line naming RUN_DIR."""
    try:
        return fn()
    except OSError as err:
        raise UserError(disk_full_reason(err, out) or f"writing {str(out)!r} failed: {err}") from None


def finish(model: torch.nn.Module, cfg: Any, path: Path, tokenizer_dir: Path | None, meta: dict[str, Any]) -> None:
    """On rank 0 once every rank wrote its tensors: what a single process writes beside them, and COMPLETE."""
    sharded.save_json(model_state.extra_states(model), path / model_state.EXTRA_STATE_FILE)
    write_recipe_files(cfg, path, tokenizer_dir, meta)
    manifest.seal(path)  # every file's checksum, as training's checkpoints carry it (checkpointing/manifest.py)
    (path / layout.COMPLETE).touch()


def imported_tokens(step: int, cfg: Any) -> int | None:
    """The tokens a checkpoint of step N was trained on, as a run of the recipe counts them: N x the recipe's
    train.global_batch_size x data.seq_len (Pythia's step 13000: 13000 x 1024 x 2048), so that its evaluation
    stands at its place on the published curves (eval/compare.py). None where the recipe leaves the global batch
    to the ds_config: the import cannot know it."""
    if step == 0:
        return 0
    if cfg.train.global_batch_size is None:
        log.warning("the import records no token count for step %d: the recipe sets no train.global_batch_size "
                    "(evaluations of it then stand at no place on a token axis)", step)
        return None
    return step * cfg.train.global_batch_size * cfg.data.seq_len


def write_model_checkpoint(model: torch.nn.Module, cfg: Any, path: Path, tokenizer_dir: Path | None,
                           meta: dict[str, Any]) -> None:
    """A complete model-only checkpoint of a whole (single-process) model at `path`, as the trainer's writer lays
    it out: each tensor under its canonical name through checkpointing's DCP functions."""
    path.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        model_state.save_module(model, path)  # true shapes, the tied head as an alias: readable by torch alone
    write_recipe_files(cfg, path, tokenizer_dir, meta)
    manifest.seal(path)
    (path / layout.COMPLETE).touch()


def source_tokenizer(folder: Path) -> Path | None:
    """The source's tokenizer folder when it is one moep_ds runs (an end-of-text token), else None with a note:
    the checkpoint then runs on token ids (moep-eval and moep-generate need text)."""
    from moep_ds.data.errors import DataError
    from moep_ds.data.tokenizer import TOKENIZER_FILE, load_tokenizer

    if not (folder / TOKENIZER_FILE).is_file():
        log.warning("%s has no %s: the checkpoint runs on token ids", folder, TOKENIZER_FILE)
        return None
    try:
        load_tokenizer(folder)
    except DataError as err:
        log.warning("the tokenizer of %s is not copied (%s): the checkpoint runs on token ids", folder, err)
        return None
    return folder


__all__ = ["build_imported", "import_checkpoint", "import_split", "write_model_checkpoint"]
