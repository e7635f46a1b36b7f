"""pretrain.py's main once per argument list, one after another in this process (single rank), each exit code
printed as a line `exit code N` on stdout (DeepSpeed prints there too):

    python pretrain_many.py ARGS.json      ARGS.json: [["--config", "r.yaml", "--resume", "auto"], ...]

A start-up that fails leaves its process group (cli.exit_joined), so the next one can start: one interpreter and
DeepSpeed import for many failing start-ups.
"""
import json
import os
import sys

from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.distributed.process_group import free_port


def main() -> None:
    for args in json.load(open(sys.argv[1])):
        os.environ["MASTER_PORT"] = str(free_port())  # a fresh rendezvous for each process group
        code = pretrain_main(args)
        print(f"exit code {code}", flush=True)
        print("--- end of run", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
