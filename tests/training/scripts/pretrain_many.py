"""pretrain.py's main once per argument list, one after another in this process (single rank), each exit code
printed as a line `exit code N` on stdout (DeepSpeed prints there too):

    python pretrain_many.py ARGS.json      ARGS.json: [["--config", "r.yaml", "--resume", "auto"], ...]

A start-up that fails leaves its process group (cli.exit_joined), so the next one can start: one interpreter and
DeepSpeed import for many failing start-ups. With MOEP_TEST_FULL_DISK=DIR, opening a file for writing under DIR
fails with ENOSPC, as on a full disk.
"""
import builtins
import errno
import json
import os
import sys

from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.distributed.process_group import free_port

FULL_DISK = os.environ.get("MOEP_TEST_FULL_DISK")  # a folder in which writing a file fails as on a full disk
original_open = builtins.open


def open_on_a_full_disk(file, mode="r", *args, **kwargs):
    if FULL_DISK and any(c in mode for c in "wax+") and os.path.abspath(str(file)).startswith(FULL_DISK + os.sep):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return original_open(file, mode, *args, **kwargs)


builtins.open = open_on_a_full_disk


def main() -> None:
    for args in json.load(open(sys.argv[1])):
        os.environ["MASTER_PORT"] = str(free_port())  # a fresh rendezvous for each process group
        code = pretrain_main(args)
        print(f"exit code {code}", flush=True)
        print("--- end of run", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
