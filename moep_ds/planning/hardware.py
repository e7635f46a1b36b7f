"""The accelerators a plan can assume, and the efficiencies it assumes of them (both printed beside every time).

Peak numbers are dense (no 2:4 sparsity), per GPU, from the vendors' data sheets: H100 and H200 SXM, A100 SXM 80 GB,
MI300X OAM. Link bandwidths are per GPU and per direction: NVLink / Infinity Fabric within a node, one 400 Gb/s
(200 Gb/s on A100 systems) InfiniBand / RoCE NIC per GPU between nodes. H800 SXM (DeepSeek-V3's cluster): the
H100's compute and HBM with NVLink cut to 400 GB/s (the data sheet's both directions together, as H100's 900: 200
each way), 8 GPUs a node, one 400 Gb/s InfiniBand NIC per GPU (the DeepSeek-V3 report: IB 50 GB/s).

    gpu = hardware("h100", ["hbm_gbps=3000", "inter_node_gbps=25"])      # --gpu h100 --hardware ...
    assumed = assumptions(["compute_efficiency=0.4"])                   # --assume ...
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moep_ds.errors import UserError

GB = 1e9
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float  # HBM capacity
    bf16_tflops: float  # dense tensor-core peak; fp16 is the same on all four
    fp32_tflops: float  # plain fp32 (torch leaves TF32 off for matmuls by default)
    hbm_gbps: float  # memory bandwidth, GB/s
    intra_node_gbps: float  # NVLink / Infinity Fabric, GB/s per direction per GPU
    inter_node_gbps: float  # NIC, GB/s per direction per GPU

    def peak_flops(self, precision: str) -> float:
        return (self.fp32_tflops if precision == "fp32" else self.bf16_tflops) * 1e12


ACCELERATORS = {
    "h100": Accelerator("h100", 80, 989.0, 67.0, 3350, 450, 50),
    "h200": Accelerator("h200", 141, 989.0, 67.0, 4800, 450, 50),
    "h800": Accelerator("h800", 80, 989.0, 67.0, 3350, 200, 50),
    "a100": Accelerator("a100", 80, 312.0, 19.5, 2039, 300, 25),
    "mi300x": Accelerator("mi300x", 192, 1307.0, 163.4, 5300, 448, 50),
}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the step time assumes beyond the hardware's peaks."""

    compute_efficiency: float = 0.45  # achieved / peak FLOP/s of the model's matmuls and attention
    comm_efficiency: float = 0.7  # achieved / peak link bandwidth of a large collective (NCCL's bus bandwidth)
    hbm_efficiency: float = 0.8  # achieved / peak HBM bandwidth of the optimizer step (memory bound)
    overlap: float = 0.5  # share of the overlappable communication hidden behind compute (ZeRO-3 prefetch, and
    #                       ZeRO-1/2 gradient reduction under overlap_comm); the expert all-to-all as its schedule
    #                       hides it (planning/timing.py), not by this share
    reserve_gib: float = 2.0  # per GPU, beyond what the plan counts: CUDA context, NCCL buffers, fragmentation
    micro_step_ms: float = 3.0  # fixed cost of each micro-batch (kernel launches, hooks, Python): small micro-batches
    #                             do not run at the efficiency of large ones


def key_values(items: list[str], flag: str, known: dict[str, Any], zero_ok: tuple[str, ...] = ()) -> dict[str, float]:
    """`["hbm_gbps=3000", ...]` as numbers, each key one of `known`, each value > 0 (>= 0 for keys in `zero_ok`)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise UserError(f"{flag} {item!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"{flag} {key} ({text!r}) must be a number") from None
        if not (value > 0 or (key in zero_ok and value == 0)):
            raise UserError(f"{flag} {key} ({text}) must be {'>= 0' if key in zero_ok else '> 0'}")
        out[key] = value
    return out


def hardware(name: str, overrides: list[str] = ()) -> Accelerator:
    """The accelerator named `name` (any case: `--gpu H100` as the data sheets write it), with `overrides`."""
    if name.lower() not in ACCELERATORS:
        raise UserError(f"--gpu ({name!r}) must be one of {', '.join(ACCELERATORS)}")
    base = ACCELERATORS[name.lower()]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "name"}
    return dataclasses.replace(base, **key_values(list(overrides), "--hardware", fields))


def assumptions(overrides: list[str] = ()) -> Assumptions:
    base = Assumptions()
    values = key_values(list(overrides), "--assume", dataclasses.asdict(base), zero_ok=("overlap", "reserve_gib", "micro_step_ms"))
    for key in ("compute_efficiency", "comm_efficiency", "hbm_efficiency", "overlap"):
        if values.get(key, 0) > 1:
            raise UserError(f"--assume {key} ({values[key]:g}) must be <= 1")
    return dataclasses.replace(base, **values)


def check_reserve(gpu: Accelerator, assumed: Assumptions) -> None:
    """The reserve must leave memory to plan with: a plan against no (or negative) usable memory says nothing."""
    if assumed.reserve_gib >= gpu.memory_gib:
        raise UserError(f"--assume reserve_gib ({assumed.reserve_gib:g}) must be less than the {gpu.memory_gib:g} GiB "
                        f"of {gpu.name}: it would leave {gpu.memory_gib - assumed.reserve_gib:g} GiB to plan with")


__all__ = ["ACCELERATORS", "Accelerator", "Assumptions", "GB", "GIB", "assumptions", "check_reserve", "hardware"]
