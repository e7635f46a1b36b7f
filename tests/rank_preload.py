"""Imported once by the fork server of tests/ranks.py, before it forks any rank: what the ranks import (seconds per
process otherwise: DeepSpeed's optimizer check imports torch's compiler, the end of a run plots with matplotlib),
then frozen out of the garbage collector, so that a rank's collections neither walk these objects (hundreds of
thousands) nor copy the pages they sit on. Nothing here starts a thread: a fork copies only the thread that forks
(lm_eval's evaluator starts one on import)."""
import gc

import deepspeed  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
import lm_eval.api.instance  # noqa: F401
import matplotlib.pyplot  # noqa: F401
import torch  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401

import moep_ds.cli.eval  # noqa: F401
import moep_ds.cli.generate  # noqa: F401
import moep_ds.cli.pretrain  # noqa: F401
import moep_ds.evaluation.harness  # noqa: F401
import moep_ds.training.analyze  # noqa: F401
import moep_ds.training.trainer  # noqa: F401

gc.collect()
gc.freeze()
