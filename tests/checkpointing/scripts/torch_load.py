"""Every rank of a launch builds the empty model and fills it with torch.distributed.checkpoint alone (the README's
snippet, under a process group: DCP plans the reads collectively), then saves what it holds for the test.

    torchrun --nproc_per_node 2 torch_load.py CKPT OUT_DIR
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moep_ds import build_model, load_config


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model = build_model(load_config(f"{ckpt}/config.yaml").model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    held = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save({"tensors": held, "tied": model.head.weight is model.embed.weight}, f"{out}/rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
