"""Pre-train a moep_ds model.

    deepspeed pretrain.py --ds_config ds_configs/X.json --config configs/Y.yaml [--set a.b=v ...]
    torchrun --nproc_per_node N pretrain.py ...   |   python pretrain.py ...
    python pretrain.py --config configs/Y.yaml --dry_run     # parameter/FLOP report, no allocation
"""
import gc

from moep_ds.cli.pretrain import main as pretrain_main

if __name__ == "__main__":
    code = pretrain_main()
    # The interpreter's last garbage collection walks every object torch, dynamo and DeepSpeed made (~500k):
    # seconds per process at exit, paid by every launch and requeue. The run's files are closed by now.
    gc.freeze()
    raise SystemExit(code)
