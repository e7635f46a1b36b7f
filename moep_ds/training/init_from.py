"""`model.init_from` at the start of a fresh run: the weights of SRC (interop/sources.py) instead of the seeded
initialisation, each rank reading only what it holds.

Called once the engine exists, so that one call serves every layout: the module's own parameters (under ZeRO-1/2
views into DeepSpeed's flat buffers; this rank's experts only under expert parallelism) and the fp32 masters the
optimizer owns (ZeRO-1/2: this rank's fragments; ZeRO-3: its partitions, from which the working partitions are
set), read as `--resume` reads a checkpoint's. With `model.upcycle` the routers keep the seeded initialisation.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from moep_ds.checkpointing import model_state
from moep_ds.checkpointing.sharded import OPTIM_PREFIX
from moep_ds.distributed.rank_errors import agreed
from moep_ds.interop.sources import source_weights
from moep_ds.interop.weights import fill_pieces
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.distributed import optimizer_state as st
from moep_ds.distributed.owned_state import commit_partitions, owned_pieces

if TYPE_CHECKING:
    from moep_ds.training.recipe import Recipe

log = logging.getLogger(__name__)


def initialise_from_source(engine, model, cfg: Recipe, plan: ExpertParallelPlan = SINGLE_PROCESS) -> None:
    """Nothing without model.init_from; else every parameter this rank holds from SRC (see the module docstring)."""
    src = cfg.model.init_from
    if src is None:
        return
    # every rank reads the same source: its error once, from the first rank that has it (rank_errors.py)
    weights, keep, source = agreed(source_weights, src, cfg.model, cfg.data.tokenizer)
    label = f"model.init_from ({src!r})"
    fill_pieces(model_state.module_pieces(model, plan), weights, keep, label)
    st.init_optimizer_state(engine.optimizer)  # zero moments, step 0: what a fresh optimizer's first step makes
    masters = {k: v for k, v in owned_pieces(engine.optimizer, model, plan, for_load=True).items()
               if not k.startswith(OPTIM_PREFIX)}
    fill_pieces(masters, weights, keep, label)
    commit_partitions(model, masters)
    st.refresh_working_copies(engine.optimizer)
    if dist.get_rank() == 0:
        what = "upcycled from" if cfg.model.upcycle is not None else "initialised from"
        log.info("weights %s %s (%s)%s", what, src, source.folder,
                 f"; routers from train.seed ({len(keep)} tensors)" if keep else "")
