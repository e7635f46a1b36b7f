#!/bin/bash
# signal_trainers.sh SIGNAL MASTER_PORT: send SIGNAL to this node's trainer processes of the launch whose
# rendezvous port is MASTER_PORT (run on every node through `srun --overlap`).
#
# The trainers are the processes that run pretrain.py as their script and have MASTER_PORT in their environment.
# Both tests matter: the deepspeed launcher's processes also name pretrain.py on their command lines and may
# carry MASTER_PORT, and SIGUSR1 kills a process without a handler (the launcher does not forward it); other runs
# on the node use other ports.
set -euo pipefail
sig=${1:?usage: signal_trainers.sh SIGNAL MASTER_PORT}
port=${2:?usage: signal_trainers.sh SIGNAL MASTER_PORT}

is_trainer() {  # PID: python [-flags] .../pretrain.py ..., with MASTER_PORT=$port in its environment
    local pid=$1 arg script=
    local -a argv
    mapfile -d '' -t argv <"/proc/$pid/cmdline" || return 1
    for arg in "${argv[@]:1}"; do
        case $arg in -*) ;; *) script=$arg; break ;; esac
    done
    [[ $script == *pretrain.py ]] || return 1
    grep -qxzF "MASTER_PORT=$port" "/proc/$pid/environ"
}

count=0
for pid in $(pgrep -u "$(id -u)" -f 'pretrain\.py' || true); do
    if is_trainer "$pid" 2>/dev/null && kill -s "$sig" "$pid" 2>/dev/null; then count=$((count + 1)); fi
done
printf '[launcher] %s: SIG%s to %d trainer process(es) of port %s\n' "$(hostname)" "$sig" "$count" "$port" >&2
