"""Pre-train a moep_ds model.

    deepspeed pretrain.py --ds_config ds_configs/X.json --config configs/Y.yaml [--set a.b=v ...]
    torchrun --nproc_per_node N pretrain.py ...   |   python pretrain.py ...
    python pretrain.py --config configs/Y.yaml --dry_run     # parameter/FLOP report, no allocation
"""
from moep_ds.cli.pretrain import main as pretrain_main

if __name__ == "__main__":
    raise SystemExit(pretrain_main())
