"""`python tests/interop/slow_write.py MARKER MODULE ARGS...`: `python -m MODULE ARGS...` whose first fsync of a file
under a hidden temporary folder (`/.NAME.*.tmp/`) writes MARKER and then waits: a test sends its signal to a
command that is known to be in the middle of writing its output."""
import os
import re
import runpy
import sys
import time

TEMPORARY = re.compile(r"/\.[^/]+\.tmp/")  # a hidden temporary folder, as fsutil.atomic_dir names them
marker, module, *argv = sys.argv[1:]
fsync = os.fsync


def slow_fsync(fd):
    fsync(fd)
    if TEMPORARY.search(os.readlink(f"/proc/self/fd/{fd}")) and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)


os.fsync = slow_fsync
sys.argv = [module, *argv]
runpy.run_module(module, run_name="__main__", alter_sys=True)
