"""A stand-in for `deepspeed` runner -> per-node launcher -> trainer, to check that the trainer notices when
the runner is killed.

    python launcher_gone.py runner OUT      starts `launcher`, which starts `worker`; both wait on their child
    worker: StopRequest watching itself and its launcher; writes OUT/ready, then OUT/stopped once requested
"""
import os
import pathlib
import subprocess
import sys
import time


def main() -> None:
    role, out = sys.argv[1], pathlib.Path(sys.argv[2])
    (out / f"{role}.pid").write_text(str(os.getpid()))
    if role in ("runner", "launcher"):
        child = "launcher" if role == "runner" else "worker"
        sys.exit(subprocess.call([sys.executable, __file__, child, str(out)]))
    from moep_ds.training.trainer import StopRequest

    stop = StopRequest(watch=[os.getpid(), os.getppid()], poll_s=0.1)
    (out / "ready").touch()
    deadline = time.time() + 60
    while not stop.requested and time.time() < deadline:
        time.sleep(0.05)
    (out / "stopped").write_text(str(stop.requested))
    os._exit(0)


if __name__ == "__main__":
    main()
