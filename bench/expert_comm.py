"""Expert communication on a throttled link between two nodes: step time of the blocking per-expert all-to-all
against each `train.expert_comm` option and all of them together, and the bytes that crossed the link against
moep-plan's prediction for the same layout (issue #44).

The two nodes are network namespaces joined by a veth pair, as tests/cluster/ builds them (`eth0`, 10.78.0.1 and
10.78.0.2, nothing routed elsewhere), each end's egress throttled by `tc` (a token bucket of --rate Mbit/s). Each
layout is one launch: `torchrun --nnodes 2 --node_rank i` inside each namespace (gloo over the veth; torchrun's
LOCAL_WORLD_SIZE tells node-aware dispatch the ranks per node), training one job per row after another in the
same process group:
  ep2   expert parallel 2, one rank per node
  ep4   expert parallel 4, two ranks per node (node-aware dispatch)
Rows: `blocking` (dedup false, node_aware false, overlap_chunks 1: a row per (token, expert)), `dedup`, `dedup +
node_aware` (ep4: node-aware needs dedup), `fp8_dispatch`, `overlap_chunks` (2 chunks in flight behind the experts'
compute) (each on the blocking path; where the option exists in this tree), `all` (every option that applies:
node-aware only where a node holds several ranks of the group, its hops in 2 chunks in flight).
The recipe: one FFN-MoE block (llama attention, --experts SwiGLU experts of --expert_hidden) at --d_model, expert
choice with capacity factor = experts by default, so every expert takes every token: the rows each path sends are
then fixed by the layout alone (as in tests/planning/test_plan_comm.py), not by where the router sends tokens (the
best case for dedup: every token reaches every rank); a smaller --capacity_factor, or `--router topk --k K` (dropless
top-k), makes the plan's rows an expectation under balanced routing (planning/dedup.py) that the router's own choices
move off. ZeRO-0 fp32: the only other traffic is the dense parameters' gradient all-reduce (the experts have no
data-parallel replica at expert parallel = world size) and the trainer's step all-reduce.
Per row, over --steps optimizer steps after --warmup (between two barriers, rank 0 reading the link there):
  step s        median step time (after_step to after_step)
  a2a share     time inside torch.distributed.all_to_all_single and waiting for the asynchronous ones (chunks
                in flight) / step time, mean over the ranks: the exposed communication
  link MB       bytes the veth carried (node 0's eth0 rx + tx, frames as the kernel counts them) per step
  payload MB    TCP payload between the nodes per step (`ss -ti` bytes_acked + bytes_received of node 0's sockets
                to node 1): what gloo wrote, its own message headers included
  plan MB       moep-plan's collectives of the layout (moep_ds/planning, Cluster(R, ranks per node)) placed on
                the link as gloo moves them: an all-to-all straight to each peer (moep-plan's own model), an
                all-reduce as gloo's flat ring in rank order (2 (n-1)/n of the buffer on each edge between nodes;
                moep-plan costs NCCL's hierarchical all-reduce, which at ep4 puts a third fewer dense-gradient bytes
                between the nodes: printed below the table), all ranks together
  payload/plan  the check: within 2%
  link/plan     link MB / (plan MB x framing), framing = link / payload of a plain gloo all-to-all of --calibrate_mb
                over the same link (TCP/IP and Ethernet headers, acknowledgements)
The last line: `blocking / best: R.RRx`, the smaller over the layouts of the blocking row's step time over the
fastest row's. Needs root (namespaces, veth, tc) and iproute2; without them it exits 2 with one line saying why.

    python bench/expert_comm.py                                   # 100 Mbit/s, ep2 and ep4, ~4 min on 2 cores
    python bench/expert_comm.py --layouts ep2 --steps 3 --warmup 1 --rate 50
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # two_nodes.py beside this script, also where a test loads it by path

from moep_ds.distributed.commands import positive_int  # noqa: E402
from two_nodes import SUBNET, Nodes, NodesError, counted, link_counters, stop, unavailable  # noqa: E402

log = logging.getLogger("expert_comm")
LAYOUTS = {"ep2": (2, 1), "ep4": (4, 2)}  # name: (expert parallel = world size, ranks per node)
OPTIONS = ("blocking", "dedup", "dedup + node_aware", "fp8_dispatch", "overlap_chunks", "all")
OVERLAP_CHUNKS = 2  # train.expert_comm.overlap_chunks of the rows with it on (the recipe's default)
MB = 1e6


@dataclasses.dataclass
class Row:
    """One measured row: its layout and option, and what the run and the plan say about it."""

    layout: str
    option: str
    step_s: float  # median
    a2a_share: float
    link_bytes: float  # per step, both directions
    payload_bytes: float  # per step, both directions
    plan_bytes: float  # per step, gloo's placement of moep-plan's collectives
    plan_own_bytes: float  # per step, moep-plan's own link model
    framing: float  # link / payload of the calibration all-to-all


# ---- recipe and plan ---------------------------------------------------------------------------------------------


def comm_options(option: str, layout: str, fp8: bool) -> dict:
    """train.expert_comm of a row; the blocking path is every option off (`fp8`: the option exists)."""
    nodes_share = LAYOUTS[layout][1] > 1  # node-aware applies where a node holds several of the group's ranks
    on = {"blocking": set(), "dedup": {"dedup"}, "dedup + node_aware": {"dedup", "node_aware"},
          "fp8_dispatch": {"fp8_dispatch"}, "overlap_chunks": {"overlap_chunks"},
          "all": {"dedup", "fp8_dispatch", "overlap_chunks"} | ({"node_aware"} if nodes_share else set())}
    comm = {"dedup": "dedup" in on[option], "node_aware": "node_aware" in on[option]}
    if fp8:
        comm["fp8_dispatch"] = "fp8_dispatch" in on[option]
    if overlap_available():
        comm["overlap_chunks"] = OVERLAP_CHUNKS if "overlap_chunks" in on[option] else 1
    return comm


def recipe(args: argparse.Namespace, layout: str, option: str, out: pathlib.Path, fp8: bool) -> dict:
    ep = LAYOUTS[layout][0]
    router = {"type": "expert_choice", "capacity_factor": args.capacity_factor or float(args.experts),
              "rounding": "ceil", "score": "softmax_experts"}
    if args.router == "topk":  # dropless; where tokens go is the router's: the plan's rows are an expectation
        router = {"type": "topk", "k": args.k, "load_balancing_weight": 0.01}
    return {
        "model": {"flavour": "llama", "vocab_size": 512, "d_model": args.d_model, "max_seq_len": args.seq_len,
                  "layers": [{"type": "ffn_moe", "attention": {"num_heads": 4},
                              "moe": {"num_experts": args.experts, "router": router,
                                      "expert": {"type": "swiglu", "hidden_size": args.expert_hidden}}}]},
        "data": {"source": "builtin", "tokenizer": {"kind": "bpe", "vocab_size": 512}, "seq_len": args.seq_len},
        "train": {"output_dir": str(out), "max_steps": args.warmup + args.steps, "log_every": 1,
                  "micro_batch_size": args.micro_batch, "expert_parallel_size": ep,
                  "expert_comm": comm_options(option, layout, fp8),
                  "checkpoint": {"every_steps": None, "at_end": False},
                  "optimizer": {"lr": 1.0e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 1}},
    }


def ds_config() -> dict:
    from moep_ds.training.ds_config import read_ds_config

    ds = read_ds_config(str(REPO / "ds_configs" / "zero0_fp32.json"))
    ds["tensorboard"] = {"enabled": False}
    return ds


def rank_groups(world: int, ep: int, span: str) -> list[list[int]]:
    """The process groups of a span (planning/comm.py Collective.span) whose collectives gloo runs as rings."""
    if span == "data":
        return [list(range(world))]
    if span == "expert":
        return [list(range(i, i + ep)) for i in range(0, world, ep)]
    return [list(range(j, world, ep)) for j in range(ep)]  # expert_data


def gloo_inter_bytes(c, layout) -> float:
    """Bytes collective `c` (all its calls, all ranks) puts between the nodes as gloo runs it: an all-to-all sends
    to each peer directly (moep-plan's link model); an all-reduce is a ring in rank order, each edge carrying
    2 (n - 1) / n of the buffer; other kinds as moep-plan models them."""
    from moep_ds.planning.comm import link_bytes

    world, per_node = layout.gpus, layout.cluster.gpus_per_node
    if c.kind != "all_reduce" or c.span not in ("data", "expert", "expert_data"):
        return link_bytes(c, layout).inter * world
    total = 0.0
    for group in rank_groups(world, layout.expert_parallel, c.span):
        n = len(group)
        crossing = sum(group[i] // per_node != group[(i + 1) % n] // per_node for i in range(n))
        total += crossing * 2 * (n - 1) / n * c.total
    return total


def planned_bytes(recipe_path: pathlib.Path, layout: str) -> tuple[float, float]:
    """(gloo's placement, moep-plan's own) bytes per step between the two nodes, all ranks together."""
    from moep_ds.config import load_config
    from moep_ds.planning.comm import link_bytes
    from moep_ds.planning.hardware import assumptions, hardware
    from moep_ds.planning.layout import Cluster
    from moep_ds.planning.plan import plan_run

    world, per_node = LAYOUTS[layout]
    run = plan_run(load_config(str(recipe_path)), ds_config(), Cluster(world, per_node), hardware("h100"),
                   assumptions())
    gloo = sum(gloo_inter_bytes(c, run.layout) for c in run.comm.collectives)
    own = sum(link_bytes(c, run.layout).inter for c in run.comm.collectives) * world
    return gloo, own


# ---- worker: the jobs of one layout on this rank -----------------------------------------------------------------

A2A_SECONDS = [0.0]  # time inside all_to_all_single on this rank since the last reset


class TimedWork:
    """An asynchronous all-to-all's work whose wait() counts as time in the all-to-all: what the overlap leaves
    exposed (issuing a chunk costs little; waiting for it is the communication compute did not hide)."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            A2A_SECONDS[0] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.work, name)


def time_all_to_all() -> None:
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            out = inner(*args, **kwargs)
        finally:
            A2A_SECONDS[0] += time.perf_counter() - start
        return TimedWork(out) if kwargs.get("async_op", len(args) > 5 and args[5]) else out

    dist.all_to_all_single = timed


def make_probe(warmup: int, steps: int):
    """A trainer callback timing the steps after `warmup` and reading the link (rank 0) at both ends of them."""
    import torch.distributed as dist

    from moep_ds.training.callbacks import Callback

    class Probe(Callback):
        def __init__(self):
            self.times, self.a2a, self.link, self.last = [], 0.0, [], 0.0

        def mark(self) -> None:
            dist.barrier()
            time.sleep(0.3)  # the last acknowledgements land
            if dist.get_rank() == 0:
                self.link.append(link_counters())
            dist.barrier()
            A2A_SECONDS[0] = 0.0
            self.last = time.perf_counter()

        def after_step(self, event) -> None:
            if event.step > warmup:
                now = time.perf_counter()
                self.times.append(now - self.last)
                self.last = now
            if event.step == warmup + steps:
                self.a2a = A2A_SECONDS[0]
                self.mark()
            elif event.step == warmup:
                self.mark()

    return Probe()


def calibrate(megabytes: float) -> dict:
    """A plain gloo all-to-all of `megabytes` per rank: the known payload between the nodes, and what the veth and
    TCP counted for it (rank 0's reading; None elsewhere)."""
    import torch
    import torch.distributed as dist

    world, per_node = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    numel = int(megabytes * 2**20) // 4 // world * world
    x = torch.ones(numel)
    dist.barrier()
    time.sleep(0.3)
    before = link_counters() if dist.get_rank() == 0 else None
    dist.barrier()
    start = time.perf_counter()
    dist.all_to_all_single(torch.empty_like(x), x)
    seconds = time.perf_counter() - start
    dist.barrier()
    time.sleep(0.3)
    if dist.get_rank() != 0:
        return {}
    veth, tcp = counted(before, link_counters())
    return {"known": world * (world - per_node) * numel // world * 4, "veth": veth, "tcp": tcp, "s": seconds}


def worker(jobs_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from moep_ds.config import load_config
    from moep_ds.training.trainer import build_trainer

    time_all_to_all()
    jobs, results = json.loads(pathlib.Path(jobs_path).read_text()), []
    for job in jobs:
        probe = make_probe(job["warmup"], job["steps"])
        build_trainer(load_config(job["recipe"], job["overrides"]), job["ds_config"], None, callbacks=[probe]).fit()
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, probe.a2a / sum(probe.times))
        if dist.get_rank() == 0:
            veth, tcp = counted(*probe.link)
            results.append({**job, "times": probe.times, "a2a_share": statistics.mean(shares), "veth": veth,
                            "tcp": tcp})
    calibration = calibrate(jobs[0]["calibrate_mb"])
    if dist.get_rank() == 0:
        pathlib.Path(out_path).write_text(json.dumps({"rows": results, "calibration": calibration}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's last collection of torch's and DeepSpeed's objects


def worker_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(nodes: Nodes, layout: str, jobs: pathlib.Path, out: pathlib.Path, timeout: float) -> None:
    """torchrun on each node (static rendezvous at node 0's address), the ranks training `jobs` into `out`."""
    per_node = LAYOUTS[layout][1]
    port = 20000 + secrets.randbelow(20000)
    procs = []
    for i, ns in enumerate(nodes.names):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", str(per_node), "--node_rank", str(i), "--master_addr", f"{SUBNET}.1",
               "--master_port", str(port), str(pathlib.Path(__file__).resolve()), "--worker", str(jobs),
               "--result", str(out)]
        with open(out.with_suffix(f".node{i}.log"), "w") as log_file:
            procs.append(subprocess.Popen(cmd, env=worker_env(), cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    deadline = time.time() + timeout
    try:
        for proc in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
            if code != 0:
                tail = out.with_suffix(f".node{procs.index(proc)}.log").read_text()[-3000:]
                raise RuntimeError(f"{layout}: node {procs.index(proc)} exited {code}:\n{tail}")
    finally:
        for proc in procs:
            stop(proc)


# ---- the rows of a layout ----------------------------------------------------------------------------------------


def fp8_available() -> bool:
    from moep_ds.moe.all_to_all import ExpertCommConfig

    return "fp8_dispatch" in {f.name for f in dataclasses.fields(ExpertCommConfig)}


def overlap_available() -> bool:
    from moep_ds.moe.all_to_all import ExpertCommConfig

    return "overlap_chunks" in {f.name for f in dataclasses.fields(ExpertCommConfig)}


def layout_options(layout: str, fp8: bool) -> list[str]:
    nodes_share = LAYOUTS[layout][1] > 1
    return [o for o in OPTIONS if (o != "dedup + node_aware" or nodes_share) and (o != "fp8_dispatch" or fp8)
            and (o != "overlap_chunks" or overlap_available())]


def measure(args: argparse.Namespace, nodes: Nodes, layout: str, work: pathlib.Path, fp8: bool) -> list[Row]:
    """Train every row of `layout` (--repeats rounds, one launch) and read the plan of each."""
    (work / "ds.json").write_text(json.dumps(ds_config()))
    jobs, plans = [], {}
    for option in layout_options(layout, fp8):
        path = work / f"{layout}_{option.replace(' + ', '_')}.yaml"
        path.write_text(yaml.safe_dump(recipe(args, layout, option, work / path.stem, fp8)))
        plans[option] = planned_bytes(path, layout)
        for r in range(args.repeats):  # a run folder each
            jobs.append({"option": option, "recipe": str(path), "ds_config": str(work / "ds.json"),
                         "overrides": [f"train.output_dir={work / path.stem}_{r}"],
                         "warmup": args.warmup, "steps": args.steps, "calibrate_mb": args.calibrate_mb})
    jobs = [jobs[i] for r in range(args.repeats) for i in range(r, len(jobs), args.repeats)]  # round-robin
    (work / f"{layout}_jobs.json").write_text(json.dumps(jobs))
    out = work / f"{layout}_result.json"
    launch(nodes, layout, work / f"{layout}_jobs.json", out, args.timeout)
    result = json.loads(out.read_text())
    cal = result["calibration"]
    framing = cal["veth"] / cal["tcp"]
    log.info("%s calibration: %d bytes between the nodes, TCP payload %d (%.4f), veth %d (framing %.4f), %.1f Mbit/s "
             "each way", layout, cal["known"], cal["tcp"], cal["tcp"] / cal["known"], cal["veth"], framing,
             cal["known"] / 2 * 8 / 1e6 / cal["s"])
    rows = []
    for option in plans:
        done = [r for r in result["rows"] if r["option"] == option]
        steps = sum(len(r["times"]) for r in done)
        rows.append(Row(layout, option, statistics.median(t for r in done for t in r["times"]),
                        statistics.mean(r["a2a_share"] for r in done), sum(r["veth"] for r in done) / steps,
                        sum(r["tcp"] for r in done) / steps, *plans[option], framing))
    return rows


# ---- the report --------------------------------------------------------------------------------------------------


def table(rows: list[Row]) -> list[str]:
    lines = ["| layout | option | step s | vs blocking | a2a share | link MB/step | payload MB/step | plan MB/step | "
             "payload / plan | link / (plan x framing) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        blocking = next(r for r in rows if r.layout == row.layout and r.option == "blocking")
        lines.append(f"| {row.layout} | {row.option} | {row.step_s:.3f} | {blocking.step_s / row.step_s:.2f}x | "
                     f"{row.a2a_share:.0%} | {row.link_bytes / MB:.3f} | {row.payload_bytes / MB:.3f} | "
                     f"{row.plan_bytes / MB:.3f} | {row.payload_bytes / row.plan_bytes:.4f} | "
                     f"{row.link_bytes / (row.plan_bytes * row.framing):.4f} |")
    return lines


def layout_ratios(rows: list[Row]) -> dict[str, tuple[float, str]]:
    """Per layout: (blocking step time / the fastest row's, that row)."""
    out = {}
    for layout in dict.fromkeys(r.layout for r in rows):
        mine = [r for r in rows if r.layout == layout]
        blocking = next(r for r in mine if r.option == "blocking")
        best = min(mine, key=lambda r: r.step_s)
        out[layout] = (blocking.step_s / best.step_s, best.option)
    return out


def report(rows: list[Row], header: str, notes: list[str] = ()) -> list[str]:
    """The table, the checks beside it, and the last line `blocking / best: R.RRx` (the smallest over layouts)."""
    lines = [header, *table(rows), *notes]
    for row in rows:
        if row.option == "blocking":
            lines.append(f"{row.layout}: the blocking step's share in the all-to-all {row.a2a_share:.0%} "
                         f"(needed >= 40%: {'met' if row.a2a_share >= 0.40 else 'NOT MET'})")
        if row.plan_own_bytes != row.plan_bytes and row.option == "blocking":
            lines.append(f"{row.layout}: moep-plan's own link model (NCCL's hierarchical all-reduce) puts "
                         f"{row.plan_own_bytes / MB:.3f} MB/step between the nodes, gloo's flat ring "
                         f"{(row.plan_bytes - row.plan_own_bytes) / MB:.3f} MB more (the dense gradients)")
    worst = max(rows, key=lambda r: abs(r.payload_bytes / r.plan_bytes - 1))
    off = worst.payload_bytes / worst.plan_bytes - 1
    lines.append(f"payload / plan, farthest row: {worst.layout} {worst.option} {off:+.2%} "
                 f"(target within 2%: {'met' if abs(off) <= 0.02 else 'MISSED'})")
    ratios = layout_ratios(rows)
    for layout, (ratio, best) in ratios.items():
        lines.append(f"{layout}: blocking / best ({best}): {ratio:.2f}x")
    lines.append(f"blocking / best: {min(r for r, _ in ratios.values()):.2f}x")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s each way (tc tbf)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=positive_int, default=5, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=positive_int, default=2, help="steps before the timed ones")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds over the rows (round-robin), pooled")
    p.add_argument("--d_model", type=positive_int, default=256, help="a multiple of 128 for fp8_dispatch")
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--expert_hidden", type=positive_int, default=16)
    p.add_argument("--router", default="expert_choice", choices=["expert_choice", "topk"])
    p.add_argument("--k", type=positive_int, default=2, help="experts per token (--router topk)")
    p.add_argument("--capacity_factor", type=float, default=None,
                   help="expert choice's; default: the number of experts (every expert takes every token)")
    p.add_argument("--micro_batch", type=positive_int, default=8, help="sequences per rank")
    p.add_argument("--seq_len", type=positive_int, default=128)
    p.add_argument("--calibrate_mb", type=float, default=8.0, help="per rank, the plain all-to-all for framing")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per layout's launch")
    p.add_argument("--work_dir", default=None, help="recipes, logs and run folders (default: a temporary folder)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rate <= 0:
        p.error(f"argument --rate: {args.rate:g} is not a positive rate")
    if args.capacity_factor is not None and not 0 < args.capacity_factor <= args.experts:
        p.error(f"argument --capacity_factor: {args.capacity_factor:g} must be in (0, --experts ({args.experts})]")
    if args.router == "topk" and args.k > args.experts:
        p.error(f"argument --k: {args.k} must be <= --experts ({args.experts})")
    if args.calibrate_mb <= 0:
        p.error(f"argument --calibrate_mb: {args.calibrate_mb:g} is not a positive size")


def routing(args: argparse.Namespace) -> str:
    if args.router == "topk":
        return f"top-{args.k} (dropless)"
    return f"expert choice c {args.capacity_factor or args.experts:g}"


def bench(args: argparse.Namespace) -> int:
    """Build the nodes, measure every layout, print the report; 2 with one line where the nodes cannot be built."""
    from moep_ds.config import load_config
    from moep_ds.data.prepare import prepare

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="moep-expert-comm-"))
    work.mkdir(parents=True, exist_ok=True)
    fp8 = fp8_available()
    (work / "prepare.yaml").write_text(yaml.safe_dump(recipe(args, args.layouts[0], "blocking", work, fp8)))
    prepare(load_config(str(work / "prepare.yaml")).data)  # once, before any rank
    nodes = Nodes(args.rate)
    try:
        nodes.up()
    except NodesError as err:
        nodes.close()
        print(f"expert_comm.py: cannot build two nodes here: {err}", file=sys.stderr)
        return 2
    started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the launches, delete the nodes
    try:
        rows = [row for layout in args.layouts for row in measure(args, nodes, layout, work, fp8)]
    finally:
        nodes.close()
    header = (f"# expert_comm: {started}, link {args.rate:g} Mbit/s each way (tc tbf), D {args.d_model}, "
              f"E {args.experts} (hidden {args.expert_hidden}), {routing(args)}, {args.micro_batch}x{args.seq_len} "
              f"tokens per rank, ZeRO-0 fp32, {args.steps} steps after {args.warmup} x {args.repeats}, "
              f"load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    notes = [] if fp8 else ["fp8_dispatch: not in this tree (train.expert_comm has no such option): no rows"]
    print("\n".join(report(rows, header, notes)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.result)
        return 0
    check_args(p, args)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    why = unavailable()
    if why:
        print(f"expert_comm.py: {why}", file=sys.stderr)
        return 2
    return bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
