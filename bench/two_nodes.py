"""Two nodes on one machine for bench/expert_comm.py: network namespaces joined by a veth pair `eth0` (SUBNET.1 and
SUBNET.2, nothing routed elsewhere), as tests/cluster/slurm_cluster.py builds its nodes (without SLURM, PID or mount
namespaces), each end's egress throttled by a `tc` token bucket; and what crossed between them, read inside node 0
(its eth0's counters and its sockets' TCP payload). Needs root and iproute2 (`unavailable` says why not).
"""
from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess

SUBNET = "10.78.0"  # node i: SUBNET.(i + 1); only inside the two namespaces
TOOLS = {"ip": "iproute2", "tc": "iproute2", "ss": "iproute2"}


# ---- the link: reading it (inside node 0) ---------------------------------------------------------------


def veth_bytes() -> int:
    """rx + tx bytes of this network namespace's eth0 (/proc/net/dev is per namespace)."""
    for line in pathlib.Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            fields = counters.split()
            return int(fields[0]) + int(fields[8])
    raise RuntimeError("no eth0 in this network namespace")


def tcp_payload(peer: str) -> dict[str, int]:
    """TCP payload per connection to `peer` (`ss -ti`: bytes_acked + bytes_received), by (local, peer) address."""
    out = subprocess.run(["ss", "-tinH", "state", "established", "dst", peer], capture_output=True, text=True,
                         check=True).stdout
    sockets, key = {}, None
    for line in out.splitlines():
        if line and not line[0].isspace():
            fields = line.split()
            key = f"{fields[-2]} {fields[-1]}"
            sockets[key] = 0
        elif key is not None:
            sockets[key] += sum(int(m) for m in re.findall(r"\bbytes_(?:acked|received):(\d+)", line))
    return sockets


def link_counters() -> dict:
    return {"veth": veth_bytes(), "tcp": tcp_payload(f"{SUBNET}.2")}


def counted(before: dict, after: dict) -> tuple[int, int]:
    """(veth bytes, TCP payload) between two readings; a connection opened between them counts from zero."""
    payload = sum(v - before["tcp"].get(k, 0) for k, v in after["tcp"].items())
    return after["veth"] - before["veth"], payload


# ---- the two nodes -----------------------------------------------------------------------------------------------


def unavailable(euid: int | None = None, which=shutil.which) -> str | None:
    """Why this machine cannot build the two nodes, or None."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return f"needs root to build two nodes (network namespaces, a veth pair, tc): running as uid {euid}"
    for tool, package in TOOLS.items():
        if which(tool) is None:
            return f"needs `{tool}` ({package}) to build two nodes and throttle their link: not on PATH"
    return None


class Nodes:
    """Two network namespaces joined by a veth pair `eth0` (SUBNET.1 and SUBNET.2), each end's egress throttled by
    a token bucket; close() deletes the namespaces (the veth pair goes with them)."""

    def __init__(self, rate_mbit: float):
        tag = secrets.token_hex(3)
        self.names, self.made, self.rate = [f"moepbench{tag}{i}" for i in (1, 2)], [], rate_mbit

    def up(self) -> "Nodes":
        for ns in self.names:
            run_ip("ip", "netns", "add", ns)
            self.made.append(ns)
            run_ip("ip", "-n", ns, "link", "set", "lo", "up")
        run_ip("ip", "link", "add", "name", "eth0", "netns", self.names[0], "type", "veth", "peer", "name", "eth0",
               "netns", self.names[1])
        for i, ns in enumerate(self.names):
            run_ip("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            run_ip("ip", "-n", ns, "link", "set", "eth0", "up")
            run_ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{self.rate:g}mbit",
                   "burst", "128kb", "latency", "100ms")
        return self

    def close(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []


def run_ip(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NodesError(f"`{' '.join(cmd)}` failed: {' '.join(proc.stderr.split()) or proc.returncode}")


class NodesError(RuntimeError):  # the two nodes could not be built here (one line)
    pass


def stop(proc: subprocess.Popen) -> None:
    """End a launch this script started (its own process group, by id), if it is still running."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
