"""Plan a run before renting the cluster (`moep-plan`): memory per rank, communication per step and step time of a
recipe on a cluster shape, from the code training runs.

    inventory.py   what a rank holds: the model built on the meta device with its expert-parallel plan, the
                   optimizer's groups, ZeRO-3's fetch units; parameters and FLOPs per token as --dry_run counts them
    trace.py       one micro-batch's forward and backward on the meta device (activation checkpointing included),
                   every tensor followed from allocation to release; the target GPU's kernels, expected loads
    layout.py      the cluster shape and the recipe's layout, checked and reconciled as training does it
    memory.py      memory per rank, itemised by ZeRO stage as DeepSpeed keeps it
    comm.py        collectives per step (all-reduce, reduce-scatter, all-gather, all-to-all) and bytes per link
    hardware.py    H100, H200, H800, A100, MI300X and the assumed efficiencies
    timing.py      step time, tokens/s, MFU, the run's time and GPU-hours
    plan.py        one layout's plan, and the search over layouts
    report.py      text, JSON and PNG

Nothing here imports deepspeed: DeepSpeed's behaviour is written down (with the file it comes from) and checked
against a counted 2-process run (tests/planning/test_plan_comm.py) and measured memory (bench/RESULTS.md).
"""
