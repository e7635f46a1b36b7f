"""Stands in for pretrain.py in the launcher tests: writes started-<local rank>, and on SIGUSR1 takes
$FAKE_TRAINER_STOP_S seconds (the checkpoint), writes stopped-<local rank> and exits 0; exits 3 after 60 s."""
import os
import pathlib
import signal
import sys
import time

out = pathlib.Path(os.environ["FAKE_TRAINER_DIR"])
rank = sys.argv[1].split("=")[1]
stop = []


def on_usr1(signum, frame):
    # The simulated nodes all run on this machine, so every node's signal_trainers.sh signals this process; a
    # repeat arriving while Python shuts down (when it restores its handlers to the default) would kill it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    stop.append(signum)


signal.signal(signal.SIGUSR1, on_usr1)
(out / f"started-{rank}").write_text(os.environ["MASTER_PORT"])
deadline = time.time() + 60
while not stop and time.time() < deadline:
    time.sleep(0.05)
if stop:
    time.sleep(float(os.environ.get("FAKE_TRAINER_STOP_S", 0)))
    (out / f"stopped-{rank}").write_text("USR1")
sys.exit(0 if stop else 3)
