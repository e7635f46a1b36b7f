"""A real SLURM cluster on this machine, for the launcher tests and for trying the launchers by hand
(tests/cluster/README.md).

Each node is a network namespace (`ip netns add`) with its own PID, UTS (hostname) and mount namespaces (the
node's /etc/hosts and ssh client configuration bound over the machine's, inside that namespace only), and runs
one slurmd and one sshd; node1 also runs slurmctld. Two nodes are joined by a veth pair whose addresses
(10.77.0.1 and 10.77.0.2) exist only inside the two namespaces: nothing is routed to or from the machine's own
network. One munged (a unix socket in the cluster folder) serves both. ssh: a key made for the cluster, accepted
by the nodes' sshd for root from the nodes' addresses only. The file system is shared: a job sees the checkout
and its run folders at the same paths on both nodes, as on a cluster with a shared file system.

Every process is started here and its PID kept; `down()` kills every process left in the namespaces (jobs
included) by PID, then deletes the namespaces. Needs root, iproute2, util-linux, and Debian's slurm-wlm, munge,
openssh-server and pdsh (`missing()` names what is absent).

    python tests/cluster/slurm_cluster.py up [--nodes 2] [--dir DIR]     # prints the folder; stays up
    python tests/cluster/slurm_cluster.py exec DIR node1 sinfo
    python tests/cluster/slurm_cluster.py down DIR
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "10.77.0"
NEEDED = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge",
          "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh",
          "ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux"}
SBIN = ("/usr/sbin", "/sbin")
# PID 1 of a node: reaps the processes orphaned there (a PID namespace's init must), ends with the namespace
REAPER = """import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(1)
#moep-holder"""


def which(prog: str) -> str | None:
    return shutil.which(prog) or shutil.which(prog, path=os.pathsep.join(SBIN))


def missing() -> str | None:
    """Why a cluster cannot be brought up here (None: it can)."""
    if os.geteuid() != 0:
        return "the test cluster needs root (network namespaces, slurmd)"
    absent = sorted({pkg for prog, pkg in NEEDED.items() if which(prog) is None})
    if absent:
        return f"the test cluster needs the Debian packages {', '.join(absent)} (.ci/run installs them)"
    return None


def slurm_conf(folder: pathlib.Path, nodes: list[str], cpus: int) -> str:
    node_lines = "\n".join(f"NodeName={n} NodeAddr={SUBNET}.{i + 1} CPUs={cpus} State=UNKNOWN"
                           for i, n in enumerate(nodes))
    # cred_expire: a requeued job waits (BeginTime) cred_expire + 1 s before it may start again; SLURM's
    # default is 120 s, its minimum 5. KillWait: scancel / requeue send SIGTERM, then SIGKILL after KillWait:
    # long enough for the trainers to finish their step and checkpoint on a loaded machine.
    return f"""\
ClusterName=moeptest
SlurmctldHost={nodes[0]}({SUBNET}.1)
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/ctld
SlurmdSpoolDir={folder}/%n/spool
SlurmctldPidFile={folder}/ctld/slurmctld.pid
SlurmdPidFile={folder}/%n/slurmd.pid
SlurmctldLogFile={folder}/ctld/slurmctld.log
SlurmdLogFile={folder}/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2
KillWait=60
MinJobAge=600
SlurmdTimeout=60
{node_lines}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def sshd_conf(folder: pathlib.Path, node: str, address: str) -> str:
    return f"""\
ListenAddress {address}
Port 22
HostKey {folder}/ssh/host_ed25519
PidFile {folder}/{node}/sshd.pid
AuthorizedKeysFile {folder}/ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowUsers root@{SUBNET}.*
PrintMotd no
"""


def ssh_client_conf(folder: pathlib.Path) -> str:
    return f"""\
Host *
    IdentityFile {folder}/ssh/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile {folder}/ssh/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
"""


class Cluster:
    """A cluster of 1 or 2 nodes (node1, node2) in `folder`. `up()` starts it; `down()` stops everything."""

    def __init__(self, folder: pathlib.Path | str, nodes: int = 2, cpus: int = 4):
        if nodes not in (1, 2):
            raise ValueError(f"nodes ({nodes}) must be 1 or 2")
        self.folder = pathlib.Path(folder).resolve()
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.tag = secrets.token_hex(3)
        self.state: dict = {"nodes": self.nodes, "namespaces": {}, "holders": {}, "pids": []}

    # ---- state kept in the folder, so that `down` works from another process
    @property
    def state_file(self) -> pathlib.Path:
        return self.folder / "cluster.json"

    def save(self) -> None:
        self.state_file.write_text(json.dumps(self.state))

    @classmethod
    def load(cls, folder: pathlib.Path | str) -> "Cluster":
        folder = pathlib.Path(folder).resolve()
        state = json.loads((folder / "cluster.json").read_text())
        c = cls(folder, nodes=len(state["nodes"]))
        c.state = state
        return c

    @property
    def conf(self) -> pathlib.Path:
        return self.folder / "slurm.conf"

    def env(self, **extra: str) -> dict:
        """An environment for commands on the nodes: SLURM_CONF set, no SLURM_* of an enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        env.update(SLURM_CONF=str(self.conf), **extra)
        return env

    # ---- start
    def up(self, timeout: float = 90) -> "Cluster":
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.save()
        try:
            self._files()
            self._network()
            self._munge()
            ctld = self.folder / "ctld"
            self._spawn(self.nodes[0], ["slurmctld", "-D", "-i", "-f", str(self.conf)], ctld / "slurmctld.out")
            for node in self.nodes:
                self._spawn(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                            self.folder / node / "slurmd.out")
                self._spawn(node, [which("sshd"), "-D", "-f", str(self.folder / node / "sshd_config"),
                                   "-E", str(self.folder / node / "sshd.log")], self.folder / node / "sshd.out")
            self._wait_ready(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _files(self) -> None:
        f = self.folder
        for sub in ("ctld", "munge", "ssh", *self.nodes, *(f"{n}/spool" for n in self.nodes)):
            (f / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("munge", "ssh"):
            (f / sub).chmod(0o700)
        self.conf.write_text(slurm_conf(f, self.nodes, self.cpus))
        ssh = f / "ssh"
        for key in ("host_ed25519", "id_ed25519"):
            if not (ssh / key).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"moep-test-{key}",
                                "-f", str(ssh / key)], check=True)
        addresses = ",".join(f"{SUBNET}.{i + 1}" for i in range(len(self.nodes)))
        (ssh / "authorized_keys").write_text(f'from="{addresses}" {(ssh / "id_ed25519.pub").read_text()}')
        host_key = (ssh / "host_ed25519.pub").read_text().split()[:2]
        (ssh / "known_hosts").write_text("".join(f"{n},{SUBNET}.{i + 1} {' '.join(host_key)}\n"
                                                 for i, n in enumerate(self.nodes)))
        (ssh / "ssh_config").write_text(ssh_client_conf(f))
        hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {n}\n" for i, n in enumerate(self.nodes))
        for node in self.nodes:
            (f / node / "hosts").write_text(hosts)
        for i, node in enumerate(self.nodes):
            (f / node / "sshd_config").write_text(sshd_conf(f, node, f"{SUBNET}.{i + 1}"))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder

    def _network(self) -> None:
        for node in self.nodes:
            ns = f"moep{self.tag}{node[-1]}"
            subprocess.run(["ip", "netns", "add", ns], check=True)
            self.state["namespaces"][node] = ns
            self.save()
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        if len(self.nodes) == 2:
            ns1, ns2 = (self.state["namespaces"][n] for n in self.nodes)
            # eth0: the interface DeepSpeed's `--launcher openmpi` names for MPI's TCP transport by default
            subprocess.run(["ip", "link", "add", "name", "eth0", "netns", ns1, "type", "veth",
                            "peer", "name", "eth0", "netns", ns2], check=True)
        for i, node in enumerate(self.nodes):
            ns = self.state["namespaces"][node]
            dev = "eth0" if len(self.nodes) == 2 else "lo"
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/{24 if dev == 'eth0' else 32}",
                            "dev", dev], check=True)
            if dev == "eth0":
                subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
            # the holder: PID 1 of the node's PID namespace (a node sees only its own processes, as the
            # launchers' signal_trainers.sh expects), keeping the node's hostname (UTS namespace) and mount
            # namespace (its own /proc, the node's /etc/hosts and ssh client configuration bound over the
            # machine's), inside the node's network namespace; it reaps orphans. Everything on the node enters
            # its namespaces. Not `ip netns exec`: it mounts a new /sys, hiding the cgroup file systems slurmd needs.
            binds = [(self.folder / node / "hosts", "/etc/hosts"),
                     (self.folder / "ssh" / "ssh_config", "/etc/ssh/ssh_config")]
            script = " && ".join([f"hostname {node}", *(f"mount --bind {a} {b}" for a, b in binds),
                                  f"exec nsenter --net=/run/netns/{ns} {sys.executable} -c '{REAPER}'"])
            with open(self.folder / node / "holder.out", "w") as out:
                unshare = subprocess.Popen(["unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
                                            "--propagation", "slave", "sh", "-c", script], stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.state["pids"].append(unshare.pid)
            self.save()
            deadline = time.time() + 20
            while not self._holder_ready(node, unshare.pid):
                if time.time() > deadline or unshare.poll() is not None:
                    raise RuntimeError(f"{node}: namespace holder did not start: "
                                       f"{(self.folder / node / 'holder.out').read_text()}")
                time.sleep(0.1)
            self.state["pids"].append(self.state["holders"][node])
            self.save()

    def _holder_ready(self, node: str, unshare_pid: int) -> bool:
        """unshare's child (PID 1 of the node) has become the reaper."""
        try:
            [child] = pathlib.Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
            if not pathlib.Path(f"/proc/{child}/cmdline").read_bytes().endswith(b"#moep-holder\0"):
                return False
        except (OSError, ValueError):
            return False
        self.state["holders"][node] = int(child)
        return True

    def _munge(self) -> None:
        m = self.folder / "munge"
        key = m / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
            key.chmod(0o600)
        proc = subprocess.Popen(["munged", "-F", "-f", f"--socket={m}/munge.socket", f"--key-file={key}",
                                 f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                                 f"--seed-file={m}/munged.seed"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(m / "munged.out", "w"),
                                start_new_session=True)
        self.state["pids"].append(proc.pid)
        self.save()
        deadline = time.time() + 20
        while not (m / "munge.socket").exists():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"munged did not start: {(m / 'munged.out').read_text()}")
            time.sleep(0.1)

    def _enter(self, node: str, cwd=None) -> list[str]:
        # --wd: entering a mount namespace would start the command in / (sbatch takes its folder as the job's)
        return ["nsenter", "-t", str(self.state["holders"][node]), "--net", "--uts", "--mount", "--pid",
                f"--wd={cwd or os.getcwd()}", "--"]

    def _spawn(self, node: str, command: list[str], out: pathlib.Path) -> subprocess.Popen:
        with open(out, "w") as log:
            proc = subprocess.Popen(self._enter(node, self.folder) + command, env=self.env(), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.state["pids"].append(proc.pid)
        self.save()
        return proc

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            states = self.run(self.nodes[0], ["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
            if states and all(s == "idle" for s in states[1::2]) and sorted(states[0::2]) == self.nodes:
                break
            if time.time() > deadline:
                logs = "\n".join(p.read_text()[-2000:] for p in self.folder.glob("*/*.log"))
                raise RuntimeError(f"the cluster did not come up within {timeout} s (sinfo: {states}):\n{logs}")
            time.sleep(0.5)
        for a in self.nodes:  # ssh between the nodes (DeepSpeed's pdsh launch)
            for b in self.nodes:
                self.run(a, ["ssh", b, "true"], timeout=30)

    # ---- use
    def command(self, node: str, command: list[str], cwd=None) -> list[str]:
        return self._enter(node, cwd) + command

    def run(self, node: str, command: list[str], check: bool = True, timeout: float = 60, cwd=None,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a command on a node (its network, hostname and /etc), output captured."""
        proc = subprocess.run(self.command(node, command, cwd), env=env or self.env(), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{node}: {command} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, BatchHost, ...), {} once SLURM forgot the job."""
        out = self.run(self.nodes[0], ["scontrol", "-o", "show", "job", job_id], check=False).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    # ---- stop
    def down(self) -> None:
        """Kill every process started here and every process left in the namespaces (jobs), by PID, then remove
        the namespaces and the veth pair (it goes with them). Safe to call twice."""
        pids = set(self.state.get("pids", []))
        for ns in self.state.get("namespaces", {}).values():
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            pids.update(int(p) for p in listed)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + (5 if sig == signal.SIGTERM else 10)
            while time.time() < deadline and any(alive(p) for p in pids):
                time.sleep(0.1)
        for pid in pids:  # reap our own children
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        for ns in self.state.get("namespaces", {}).values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.state["namespaces"], self.state["pids"] = {}, []
        if self.folder.exists():
            self.save()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and leave it running")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--dir", default=None, help="cluster folder (default: a new one under $TMPDIR)")
    ex = sub.add_parser("exec", help="run a command on a node")
    ex.add_argument("dir")
    ex.add_argument("node")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="stop a cluster started with `up`")
    down.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "up":
        folder = args.dir or tempfile.mkdtemp(prefix="moep-cluster-")
        Cluster(folder, nodes=args.nodes).up()
        print(folder)
        return 0
    c = Cluster.load(args.dir)
    if args.cmd == "down":
        c.down()
        return 0
    return subprocess.call(c.command(args.node, args.command), env=c.env())


if __name__ == "__main__":
    sys.exit(main())
