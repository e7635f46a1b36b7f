"""The training loop under DeepSpeed: build, resume, step, log, checkpoint, stop cleanly on a signal.

# B micro-batch, T sequence length
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import pathlib
import signal
import threading
import time
from collections import defaultdict
from contextlib import nullcontext

import deepspeed
import psutil
import torch
import torch.distributed as dist

from moep_ds.checkpointing import layout, sharded
from moep_ds.config import Config
from moep_ds.data.dataset import open_split
from moep_ds.errors import SharedUserError, UserError
from moep_ds.data.prepare import check_meta, check_tokenizer_fits, prepare
from moep_ds.data.errors import DataError
from moep_ds.data.sampler import BatchLoader, eval_batches
from moep_ds.models.accounting import meta_param_report
from moep_ds.models.causal_lm import build_model
from moep_ds.moe.shard import expert_shard
from moep_ds.training import checkpoint as ckpt_io
from moep_ds.training.analyze import analyze, markdown
from moep_ds.training.balancing import LossFreeBalancing, install_count_reducers
from moep_ds.training.blocks import apply_block_options
from moep_ds.training.branch import resolve_start_step
from moep_ds.distributed.launcher import launcher_generations
from moep_ds.distributed.process_group import init_distributed, leave_process_group, setup_logging, world_size_to_be
from moep_ds.training.ds_config import check_with_deepspeed, precision, read_ds_config, reconcile, zero_stage
from moep_ds.distributed.expert_parallel import (
    check_parallel_layout, expert_parallel_group, moe_layer_classes, setup_expert_parallel, shard_of,
)
from moep_ds.training.grad_norm import ExactClipping
from moep_ds.training.hooks import step_callbacks
from moep_ds.training.init_from import initialise_from_source
from moep_ds.training.host_memory import RELEASE_THRESHOLD, return_freed_buffers_to_os
from moep_ds.training.monitor import Monitor, drop_rows_after
from moep_ds.training.optim import build_optimizer, build_scheduler, param_groups
from moep_ds.distributed.rank_errors import agreed, raise_agreed
from moep_ds.training.resume_batch import reconcile_resumed, saved_global_batch
from moep_ds.training.run_dir import STOP_FILE, claim_run_dir
from moep_ds.training.state import adopt_unfused_masters, loss_for_backward, loss_scaler
from moep_ds.distributed.zero3 import check_partitioned, gathered_for_init, partitioned_construction

log = logging.getLogger(__name__)

PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


INTERRUPT_ECHO_S = 1.0


class StopRequest:
    """SIGUSR1 / SIGTERM (SLURM preemption), SIGINT (Ctrl-C, which reaches every process of the terminal's process
    group: under `deepspeed` the trainers and their launcher, which then sends SIGTERM), or the launcher going away,
    ask for a checkpoint and a clean exit at the next step boundary (`requested`). A second SIGINT aborts at once
    (KeyboardInterrupt): the way out of a checkpoint that takes too long.

    SIGTERM to the `deepspeed` runner kills the runner only: its per-node launcher and the trainers go on,
    re-parented. A daemon thread watches the launcher's processes (or the pids in `watch`; none for a process no
    launcher started) every `poll_s` seconds (MOEP_STOP_POLL_S, default 5) and sets `requested` once one of them is
    gone or has a new parent, or once `stop_file` (RUN_DIR/STOP, watched on rank 0) exists."""

    def __init__(self, watch: list[int] | None = None, poll_s: float | None = None,
                 stop_file: pathlib.Path | None = None):
        self.requested = False
        self.stop_file = stop_file
        poll_s = float(os.environ.get("MOEP_STOP_POLL_S", 5.0)) if poll_s is None else poll_s
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)
        watch = launcher_chain() if watch is None else watch
        self.parents = {pid: parent_pid(pid) for pid in watch}
        if self.parents or stop_file is not None:
            threading.Thread(target=self.watch_launcher, args=(poll_s,), daemon=True,
                             name="moep-launcher-watch").start()

    def handle(self, signum, frame) -> None:
        log.warning("received signal %d: checkpointing and stopping after this step", signum)
        self.requested = True
        # A repeat must not kill the process while it checkpoints or shuts down; a second Ctrl-C is meant to.
        self.interrupted_at = time.monotonic()
        signal.signal(signum, self.interrupt_again if signum == signal.SIGINT else signal.SIG_IGN)

    def interrupt_again(self, signum, frame) -> None:
        """A second Ctrl-C aborts; one within INTERRUPT_ECHO_S of the first is the same Ctrl-C passed on by a
        launcher (torchrun forwards the SIGINT its agent got to the trainers, which got it from the terminal too)."""
        if time.monotonic() - self.interrupted_at > INTERRUPT_ECHO_S:
            raise KeyboardInterrupt

    def watch_launcher(self, poll_s: float) -> None:
        while not self.requested:
            time.sleep(poll_s)
            gone = [pid for pid, parent in self.parents.items() if parent_pid(pid) != parent]
            if self.stop_file is not None and self.stop_file.exists():
                log.warning("found %s: checkpointing and stopping after this step", self.stop_file)
                self.requested = True
            elif gone:
                log.warning("launcher process %s is gone: checkpointing and stopping after this step", gone[0])
                self.requested = True


def parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def launcher_chain() -> list[int]:
    """This process and the launcher processes above it whose parents must not change while training; none when
    no launcher started this process (a plain `python pretrain.py`, whose shell may exit: nohup ... &)."""
    try:
        parent = psutil.Process(os.getppid())
        generations = launcher_generations(parent.cmdline())
    except psutil.Error:
        return []
    if generations == 0:
        return []
    chain = [os.getpid()]
    for _ in range(generations - 1):
        chain.append(parent.pid)
        parent = parent.parent()
        if parent is None:
            break
    return chain


def check_output_dir(output_dir: str) -> pathlib.Path:
    """train.output_dir must be writable on every rank, checked before any data preparation."""
    error = None
    try:
        path = layout.check_writable(output_dir, "train.output_dir")
    except UserError as err:
        error = err
    if not sharded.agree(error is None):
        raise SharedUserError(
            str(error) if error else f"train.output_dir ({output_dir!r}) is not writable on every rank")
    return path


PREPARE_TIMEOUT = datetime.timedelta(hours=12)


def prepare_data(cfg: Config, rank: int, local_rank: int) -> tuple[pathlib.Path, dict]:
    """Rank 0 prepares (or reuses) the packed corpus; then the first rank of every other node, which finds it
    complete where the nodes share the cache folder and prepares its node's copy where they do not; then the rest,
    who find it complete. The ranks wait in monitored barriers of a gloo group of their own with PREPARE_TIMEOUT,
    not the collectives' timeout (DeepSpeed's DEEPSPEED_TIMEOUT, 10 minutes), which tokenizing a large corpus on
    first use could outlast. A rank that fails still comes to the barrier; then it reports its error in one line and
    the others exit quietly (rank_errors.py), where they ended in the barrier's traceback once it was gone. Copies
    prepared on several nodes must agree (a sentencepiece tokenizer trained on a sample could differ)."""
    waiting = dist.new_group(backend="gloo")
    prepared = None
    for turn in (rank == 0, rank != 0 and local_rank == 0, local_rank != 0):
        error = None
        try:
            prepared = prepare(cfg.data) if turn else prepared
        except UserError as err:
            error = err
        dist.monitored_barrier(group=waiting, timeout=PREPARE_TIMEOUT, wait_all_ranks=True)
        raise_agreed(error, group=waiting)  # one line from the preparing rank, the others exit quietly
    meta = agreed(lambda: check_meta(prepared, vocab_size=cfg.model.vocab_size), group=waiting)
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, (meta.get("tokenizer_sha256"), meta["train_tokens"]), group=waiting)
    dist.destroy_process_group(waiting)
    if len(set(copies)) > 1:
        raise SharedUserError(f"the ranks prepared different corpora ({len(set(copies))} tokenizers / token counts "
                              f"for {str(prepared)!r}): nodes that do not share $MOEP_CACHE_DIR each prepared their "
                              "own; run moep-prepare once into a shared MOEP_CACHE_DIR")
    return prepared, meta


def total_steps(cfg: Config, num_windows: int, global_batch: int) -> int:
    if cfg.train.max_steps is not None:
        if cfg.train.epochs is not None:  # e.g. --set train.max_steps=5 for a smoke test of an epochs recipe
            log.warning("train.max_steps (%d) overrides train.epochs (%g), as max_steps does in HF's Trainer",
                        cfg.train.max_steps, cfg.train.epochs)
        return cfg.train.max_steps
    if cfg.train.epochs is None:
        raise SharedUserError("train.max_steps (None) must be set when train.epochs is not")
    # an epoch is the full global batches only (BatchLoader drops the incomplete last one): 2 epochs of 12.5
    # batches are 24 steps, not 25 (the 25th would be the first batch of a third epoch); round() keeps e.g.
    # 0.29 x 100 = 28.999999999999996 at 29
    return max(1, math.floor(round(cfg.train.epochs * (num_windows // global_batch), 9)))


def peak_flops(cfg: Config, device: torch.device) -> float | None:
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v * 1e12 for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)
    return None


def build_rank_model(model_cfg, ds: dict, seed: int, ep_group=None):
    """What this rank holds of the model: its experts only (moe/shard.py) and, under ZeRO-3, its partition of
    every parameter only (training/zero3.py). The weights depend on the seed alone: equal on every rank, at every
    expert-parallel size and ZeRO stage (rounded to the working precision)."""
    zero3 = zero_stage(ds) == 3
    with expert_shard(*shard_of(ep_group)), partitioned_construction(ds) if zero3 else nullcontext():
        model = build_model(model_cfg, initialise=False)
    if zero3:
        check_partitioned(model)
    torch.manual_seed(seed)  # not what construction drew, which differs with the sharding
    model.init_weights(gathered_for_init if zero3 else None)
    return model


def scored_windows(num_windows: int, train, ds: dict, path) -> int:
    """How many validation windows an evaluation scores: the first `train.eval_batches` global batches, or all whole
    global batches of a smaller split. Whole global batches, so the same windows at any number of ranks (a global
    batch divides into micro-batches x ranks for any split of it); fewer than one is refused."""
    batch = ds["train_batch_size"]
    if num_windows < batch:
        raise DataError(f"train.eval_every ({train.eval_every}): {num_windows} validation windows in {str(path)!r} "
                        f"are fewer than one global batch ({batch}); hold out more (data.val_fraction) or give a "
                        "data.val_source")
    return min(train.eval_batches, num_windows // batch) * batch


class Trainer:
    def __init__(self, cfg: Config, ds_config_path: str | None, resume: str | None, *, overwrite: bool = False,
                 allow_batch_change: bool = False):
        """Everything up to the first step. A start-up that fails removes train.output_dir if it created it: each
        rank looks before the ranks meet in init_distributed, so before any of them can have created it."""
        created = layout.first_missing(cfg.train.output_dir)
        try:
            self.set_up(cfg, ds_config_path, resume, overwrite, allow_batch_change)
        except BaseException:
            layout.remove_new_dir(cfg.train.output_dir, created)
            raise

    def set_up(self, cfg: Config, ds_config_path: str | None, resume: str | None, overwrite: bool = False,
               allow_batch_change: bool = False) -> None:
        self.cfg = cfg
        # a bad file fails before the ranks meet (init_distributed waits for all of them and compiles an op)
        raw_ds = read_ds_config(ds_config_path)
        reconcile(raw_ds, cfg.train, world_size_to_be())
        self.device = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        setup_logging(self.rank)
        self.run_dir = pathlib.Path(cfg.train.output_dir)
        ds = reconcile_resumed(raw_ds, cfg.train, self.world, resume, self.run_dir, allow_batch_change)
        ds.setdefault("tensorboard", {"enabled": True, "output_path": str(self.run_dir), "job_name": "tensorboard"})
        check_with_deepspeed(ds)
        self.ds = ds
        check_parallel_layout(cfg, ds, self.world)
        check_output_dir(cfg.train.output_dir)
        claim_run_dir(self.run_dir, resume, overwrite)
        # before any tokenizing (prepare_data), which a tokenizer larger than the model would waste
        agreed(check_tokenizer_fits, cfg.data, cfg.model.vocab_size, run=self.rank == 0)
        self.prepared, self.meta = prepare_data(cfg, self.rank, int(os.environ.get("LOCAL_RANK", self.rank)))
        self.resume = resume
        self.dataset = open_split(self.prepared, "train", cfg.data.seq_len)
        self.val = self.open_validation()
        self.engine, self.model, self.ep_group = self.build_engine()
        self.callbacks = step_callbacks(self.engine, self.ep_group)
        self.balancing = LossFreeBalancing(self.model)
        self.accum = ds["gradient_accumulation_steps"]
        self.loader = BatchLoader(self.dataset, micro_batch_size=ds["train_micro_batch_size_per_gpu"],
                                  grad_accum=self.accum, dp_rank=self.rank, dp_size=self.world, seed=cfg.train.seed,
                                  shuffle=cfg.data.order == "shuffled")
        self.step = 0 if self.resume_from is not None else self.start_at(self.start_step)
        self.tokens_per_step = ds["train_batch_size"] * cfg.data.seq_len
        if self.resume_from is not None:
            state = ckpt_io.load_engine_state(self.engine, self.model, self.resume_from, self.ep_group)
            ckpt_io.check_same_tokenizer(state, self.meta, self.resume_from)
            self.loader.load_state_dict(state["data"], global_batch_size=saved_global_batch(state))
            self.step = state["step"]
            log.info("resumed from %s at step %d", self.resume_from, self.step)
            if self.rank == 0:
                ckpt_io.warn_length_change(state, self.max_steps, self.resume_from)
                ckpt_io.warn_model_changes(cfg.model, self.resume_from)
                drop_rows_after(self.run_dir, self.step)
        else:  # a fresh start: the weights of model.init_from, when the recipe names a source
            initialise_from_source(self.engine, self.model, cfg, self.ep_group)
        self.checkpoints = ckpt_io.CheckpointWriter(self.run_dir, cfg.train.checkpoint.keep_last,
                                                    async_save=cfg.train.checkpoint.async_save)
        self.monitor = Monitor(self.run_dir, self.engine, enabled=self.rank == 0)
        self.stop = StopRequest(stop_file=self.run_dir / STOP_FILE if self.rank == 0 else None)

    def new_model(self):
        """The model with this rank's experts only (moe/shard.py), under ZeRO-3 with this rank's partition of
        every parameter only (training/zero3.py); initialised from the seed alike on every rank, at every
        expert-parallel size and ZeRO stage."""
        ep_group = expert_parallel_group(self.cfg.train.expert_parallel_size)
        model = build_rank_model(self.cfg.model, self.ds, self.cfg.train.seed, ep_group)
        self.report = meta_param_report(self.cfg.model, self.cfg.data.seq_len)  # of the whole model
        setup_expert_parallel(model, ep_group)
        install_count_reducers(model)
        return model, ep_group

    def load_resumed_model(self):
        """The model, with the weights of the checkpoint to resume from (`self.resume_from`, None for a fresh
        start). `--resume auto` skips a damaged newest checkpoint: all ranks agree on each candidate before the
        engine, the only holder of optimizer state, exists. Only a run without checkpoints starts fresh: were none
        of them loadable, training from step 0 would overwrite the run's logs and its rotation delete them."""
        model, ep_group = self.new_model()
        self.resume_from = None
        candidates = ckpt_io.resume_candidates(self.resume, self.run_dir)
        for i, ckpt in enumerate(candidates):
            error = None
            try:
                ckpt_io.check_checkpoint(ckpt)
                ckpt_io.load_model_state(model, ckpt, ep_group)
            except sharded.DamagedCheckpoint as err:
                error = err
            if sharded.agree(error is None):
                self.resume_from = ckpt
                if self.rank == 0:
                    set_aside(candidates[:i])
                return model, ep_group
            if self.resume != "auto":
                raise error or sharded.DamagedCheckpoint(f"checkpoint {str(ckpt)!r} could not be read on every rank")
            log.warning("skipping damaged checkpoint %s: %s", ckpt, error or "unreadable on another rank")
            model, ep_group = self.new_model()  # a failed read may have written part of the weights
        if candidates:  # every rank agreed on each: all raise this
            raise sharded.CheckpointError(
                f"--resume auto: all {len(candidates)} checkpoint(s) in {str(candidates[0].parent)!r} are damaged, "
                f"the newest is {str(candidates[0])!r} (see the warnings above); move them away to train from step 0")
        return model, ep_group

    def build_engine(self):
        cfg = self.cfg
        model, ep_group = self.load_resumed_model()
        apply_block_options(model, activation_checkpointing=cfg.train.activation_checkpointing,
                            compile=cfg.train.compile)
        if cfg.train.activation_checkpointing and self.device.type == "cpu" and return_freed_buffers_to_os():
            # without this glibc keeps most of what checkpointing frees (training/host_memory.py)
            log.info("activation checkpointing on CPU: host buffers of >= %d KiB go back to the OS when freed",
                     RELEASE_THRESHOLD >> 10)
        if zero_stage(self.ds) == 3 and moe_layer_classes(model):
            # Expert order depends on the data: gather each MoE module's parameters as one unit so that ranks
            # routing differently never wait on different parameter fetches.
            deepspeed.utils.set_z3_leaf_modules(model, moe_layer_classes(model))
        groups = param_groups(model, cfg.train.optimizer)
        if ep_group is not None:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = build_optimizer(groups, cfg.train.optimizer)
        self.max_steps = total_steps(cfg, len(self.dataset), self.ds["train_batch_size"])
        self.start_step = resolve_start_step(cfg, self.max_steps)  # 0 unless branching (training/branch.py)
        scheduler = build_scheduler(optimizer, cfg.train.schedule, self.max_steps, self.start_step)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=self.ds, dist_init_required=False)
        adopt_unfused_masters(engine.optimizer)  # ZeRO-0 bf16/fp16: Adam's state as a fresh optimizer's
        self.clipping = None  # ZeRO-0 fp32: the engine's clipping norm ignores expert sharding (grad_norm.py)
        if zero_stage(self.ds) == 0 and precision(self.ds) == "fp32":
            self.clipping = ExactClipping.install(engine, ep_group)
        log.info("model: %s | %s | ZeRO-%d | %d ranks | expert parallel %d | %d steps",
                 self.report.as_dict(), precision(self.ds), zero_stage(self.ds), self.world,
                 cfg.train.expert_parallel_size, self.max_steps)
        return engine, model, ep_group

    def start_at(self, step: int) -> int:
        """A fresh run's position at `step` (train.start_step): the data and the engine's counters; the lr schedule
        starts there already (build_scheduler). Returns the step."""
        self.loader.start_at(step)
        self.engine.global_steps, self.engine.global_samples = step, step * self.ds["train_batch_size"]
        return step

    def train_step(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One optimizer step over `accum` micro-batches: this rank's losses averaged over its micro-batches and
        the routing statistics, all left on the device (no host sync here)."""
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        stats: dict[str, torch.Tensor] = {}
        for _ in range(self.accum):
            input_ids, labels = self.loader.next_micro_batch()
            out = self.engine(input_ids.to(self.device), labels=labels.to(self.device))
            out.logits = None  # [B, T, V] is not needed by backward: free it before backward's peak
            self.engine.backward(loss_for_backward(self.engine.optimizer, out.loss))
            self.engine.step()
            sums["loss"] += out.loss.detach().float() / self.accum
            sums["ce_loss"] += out.ce_loss.detach().float() / self.accum
            for name, value in out.aux_losses.items():
                sums[f"aux/{name}"] += value.detach().float() / self.accum
            for name, value in out.stats.items():
                value = value.detach().float() / self.accum
                stats[name] = stats[name] + value if name in stats else value
        return sums, stats

    def reduce_step(self, sums: dict[str, torch.Tensor], last_save: float) -> tuple[dict[str, torch.Tensor], bool, bool]:
        """The step's one collective: losses averaged over ranks, the loss-free balancing counts summed over
        ranks (then the biases are updated: training/balancing.py), and whether any rank was asked to stop
        (`self.stop.requested`) or is due a time-based checkpoint. Only the two flags come to the host; the
        losses stay on the device (the caller brings them over on log steps)."""
        minutes = self.cfg.train.checkpoint.every_minutes
        due = minutes is not None and (time.time() - last_save) >= 60 * minutes
        keys = sorted(sums)
        flags = torch.tensor([float(self.stop.requested), float(due), float(self.checkpoints.failed())],
                             device=self.device)
        counts = self.balancing.local_counts().to(self.device)
        dtype = torch.float64 if counts.numel() else torch.float32  # counts exact beyond fp32's 2^24
        packed = torch.cat([torch.stack([sums[k] for k in keys]).to(dtype) / self.world, counts, flags.to(dtype)])
        dist.all_reduce(packed)  # sum: mean losses, global counts, and a flag is set when any rank set it
        stop, time_due, save_failed = (v > 0 for v in packed[-3:].tolist())
        if save_failed:  # an asynchronous save failed: its error on every rank now, not at the next save
            self.checkpoints.wait()
            raise ckpt_io.CheckpointError("an asynchronous checkpoint save failed on another rank (see its error)")
        self.balancing.end_step(packed[len(keys):len(keys) + counts.numel()])
        return dict(zip(keys, packed[:len(keys)].float())), stop, time_due

    def save(self) -> None:
        scheduler = self.engine.lr_scheduler
        state = {
            "step": self.step,
            "max_steps": self.max_steps,
            "global_samples": self.engine.global_samples,
            "skipped_steps": self.engine.skipped_steps,
            "data": self.loader.state_dict(),
            "global_batch_size": self.ds["train_batch_size"],
            "lr_scheduler": {"last_epoch": scheduler.last_epoch} if scheduler is not None else None,
            "loss_scaler": ckpt_io.loss_scaler_state(self.engine),
            "world_size": self.world,
            "expert_parallel_size": self.cfg.train.expert_parallel_size,
            "seed": self.cfg.train.seed,
            "tokenizer_sha256": self.meta.get("tokenizer_sha256"),
        }
        self.checkpoints.save(
            self.engine, self.model, self.cfg, self.step, state, ep_group=self.ep_group, tokenizer_dir=self.prepared,
            meta={"tokens": self.step * self.tokens_per_step, **self.report.as_dict()},
        )

    def metrics(self, losses: dict[str, float], seconds: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / max(seconds, 1e-9)
        out = {**losses, "lr": self.engine.get_lr()[0], "tokens_per_s": tokens_per_s,
               "tokens": float(self.step * self.tokens_per_step)}
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None and self.clipping is not None:
            grad_norm = self.clipping.last_norm
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        scaler = loss_scaler(self.engine.optimizer)
        if precision(self.ds) == "fp16" and scaler is not None:
            out["loss_scale"] = float(scaler.cur_scale)
            out["skipped_steps"] = float(self.engine.skipped_steps)
        peak = peak_flops(self.cfg, self.device)
        if peak:
            out["mfu"] = self.report.flops_per_token * tokens_per_s / (peak * self.world)
        return out

    def open_validation(self):
        """The validation windows, when the recipe evaluates, and how many an evaluation scores (`val_windows`):
        checked now, not at the first evaluation."""
        if not self.cfg.train.eval_every:
            return None
        val = open_split(self.prepared, "val", self.cfg.data.seq_len)
        self.val_windows = scored_windows(len(val), self.cfg.train, self.ds, path=self.prepared)
        return val

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation token loss over the first `eval_batches` global batches of validation windows in file
        order (all whole global batches when fewer): the same windows at any number of ranks, each rank scoring
        its contiguous share in micro-batches (routers in their eval mode)."""
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        windows = 0
        for inputs, labels in eval_batches(self.val, micro_batch_size=self.ds["train_micro_batch_size_per_gpu"],
                                           dp_rank=self.rank, dp_size=self.world, max_windows=self.val_windows):
            out = self.engine(inputs.to(self.device), labels=labels.to(self.device))
            total += out.ce_loss.float() * len(inputs)  # windows are of equal length: the token mean's share
            windows += len(inputs)
        self.engine.train()
        dist.all_reduce(total)
        return float(total) / (windows * self.world)  # every rank scores as many windows

    def fit(self) -> int:
        cfg = self.cfg.train
        last_save = time.time()
        self.engine.train()
        while self.step < self.max_steps:
            start = time.time()
            sums, stats = self.train_step()
            self.step += 1
            loss_t, stop, time_due = self.reduce_step(sums, last_save)  # first: a replaced expert's bias stays 0
            events = [event for callback in self.callbacks for event in callback.after_optimizer_step(self.step)]
            if self.step % cfg.log_every == 0 or self.step in (self.start_step + 1, self.max_steps):
                losses = dict(zip(loss_t, torch.stack(list(loss_t.values())).tolist()))
                if self.engine.skipped_steps and precision(self.ds) == "fp16":
                    losses["skipped_steps"] = float(self.engine.skipped_steps)
                metrics = self.metrics(losses, time.time() - start)
                self.monitor.log_step(self.step, metrics, stats)
                log.info("step %d/%d loss %.4f lr %.3g %.0f tok/s", self.step, self.max_steps,
                         metrics["loss"], metrics["lr"], metrics["tokens_per_s"])
            self.monitor.log_events(self.step, events)
            stop = stop or self.step == cfg.exit_at_step
            step_due = cfg.checkpoint.every_steps is not None and self.step % cfg.checkpoint.every_steps == 0
            end_due = cfg.checkpoint.at_end and self.step == self.max_steps
            if stop or time_due or step_due or end_due:
                self.save()
                last_save = time.time()
            # after the step's checkpoint: an evaluation that fails must not take the step's training with it
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == self.max_steps):  # and the end
                val_loss = self.evaluate()
                self.monitor.log_step(self.step, {"val_loss": val_loss}, {})
                log.info("step %d val_loss %.4f", self.step, val_loss)
            if stop:
                log.warning("stopped at step %d on request; resume with --resume auto", self.step)
                break
        self.checkpoints.wait()  # a save in flight must be complete before the process may exit
        self.monitor.close()
        if self.rank == 0:
            self.log_analysis()
        return 0

    def log_analysis(self) -> None:
        """The utilisation summary (moep-analyze) of the finished run; a log it cannot read (edited, or written
        by another program) is a warning: the training itself and its checkpoints are complete."""
        try:
            summary = analyze(self.run_dir)
        except UserError as err:
            log.warning("no utilisation summary: %s", err)
            return
        log.info("expert utilisation (moep-analyze %s):\n%s", self.run_dir, markdown(summary))


def set_aside(damaged: list[pathlib.Path]) -> None:
    """Rename the damaged checkpoints `--resume auto` skipped (all newer than the one it resumed from) to
    `<name>.damaged`: kept for inspection, but no longer counted by keep_last, which would otherwise delete
    usable checkpoints while it kept these."""
    for ckpt in damaged:
        target = ckpt.with_name(f"{ckpt.name}.damaged")
        n = 1
        while target.exists():
            n += 1
            target = ckpt.with_name(f"{ckpt.name}.damaged{n}")
        try:
            ckpt.rename(target)
        except OSError as err:  # best effort: the other ranks are already on their way to the engine's collectives
            log.warning("could not move the damaged checkpoint %s aside (%s); keep_last still counts it", ckpt, err)
            continue
        log.warning("moved the damaged checkpoint %s aside to %s", ckpt, target.name)


def fit(cfg: Config, ds_config_path: str | None = None, resume: str | None = None, **options) -> int:
    """Train; every rank leaves the process group together at the end. A rank that fails leaves without waiting
    for the others, which may be in another collective (cli.exit_joined ends it; the launcher stops the rest)."""
    code = Trainer(cfg, ds_config_path, resume, **options).fit()
    leave_process_group()
    return code
