# Shared by the moep_ds launchers (sourced, not run): pretrain.py's arguments from the environment, rendezvous
# helpers, submission of a script to SLURM, and the preemption trap. Settings: launchers/README.md.
# shellcheck shell=bash

log() { printf '[launcher] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# build_pretrain_args [ARG...]: set PRETRAIN_ARGS (pretrain.py's arguments, without the script) from CONFIG,
# DS_CONFIG, RESUME, RUN_DIR and the launcher's own arguments, which are pretrain.py arguments. pretrain.py keeps
# only the last `--set` list, so all overrides are merged into one: RUN_DIR's first, then the arguments' in order.
build_pretrain_args() {
    local arg in_set=0 has_config=0
    local -a overrides=() rest=()
    if [ -n "${RUN_DIR:-}" ]; then overrides+=("train.output_dir=$RUN_DIR"); fi
    for arg in "$@"; do
        case $arg in
            --set) in_set=1 ;;
            --set=*) in_set=0; overrides+=("${arg#--set=}") ;;
            -*) in_set=0; rest+=("$arg") ;;
            *) if [ "$in_set" = 1 ]; then overrides+=("$arg"); else rest+=("$arg"); fi ;;
        esac
        case $arg in --config | --config=*) has_config=1 ;; esac
    done
    if [ -z "${CONFIG:-}" ] && [ "$has_config" = 0 ]; then
        die "no recipe: set CONFIG=configs/<name>.yaml or pass --config"
    fi
    PRETRAIN_ARGS=()
    if [ -n "${CONFIG:-}" ]; then PRETRAIN_ARGS+=(--config "$CONFIG"); fi
    if [ -n "${DS_CONFIG:-}" ]; then PRETRAIN_ARGS+=(--ds_config "$DS_CONFIG"); fi
    if [ -n "${RESUME:-}" ]; then PRETRAIN_ARGS+=(--resume "$RESUME"); fi
    PRETRAIN_ARGS+=("${rest[@]}")
    if [ "${#overrides[@]}" -gt 0 ]; then PRETRAIN_ARGS+=(--set "${overrides[@]}"); fi
}

# require_int NAME WHAT MIN [MAX]: die unless the variable NAME holds a whole number from MIN to MAX, naming it and its
# value (deepspeed's own refusal is its multi-line usage, and NPROC 0 or -1 it takes: it trains one process). NAME
# is set to the plain decimal number: signal_trainers.sh finds the trainers by MASTER_PORT as deepspeed writes it.
require_int() {
    local name=$1 what=$2 min=$3 max=${4:-999999999999999999} value=${!1-}  # 18 digits: no overflow in (( ))
    if ! [[ $value =~ ^[0-9]{1,18}$ ]] || ((10#$value < min || 10#$value > max)); then
        die "$name ($value) must be $what"
    fi
    printf -v "$name" '%d' "$((10#$value))"
}

# check_launch_numbers: NODES, GPUS_PER_NODE (0: a CPU-only job), NPROC_PER_NODE and MASTER_PORT, those that are
# set, before anything is submitted (srun or deepspeed would refuse them later, in their own words, or take 0 as
# something else)
check_launch_numbers() {
    if [ -n "${NODES:-}" ]; then require_int NODES "a positive integer (nodes)" 1; fi
    if [ -n "${GPUS_PER_NODE:-}" ]; then
        require_int GPUS_PER_NODE "a whole number (GPUs per node; 0 for CPU only)" 0
    fi
    if [ -n "${NPROC_PER_NODE:-}" ]; then
        require_int NPROC_PER_NODE "a positive integer (processes per node)" 1
    fi
    if [ -n "${MASTER_PORT:-}" ]; then require_int MASTER_PORT "an integer from 1 to 65535" 1 65535; fi
}

# DEEPSPEED_ARGS (e.g. "--launcher openmpi"), split on whitespace into DEEPSPEED_EXTRA.
deepspeed_extra_args() {
    # shellcheck disable=SC2034  # read by the scripts that source this file
    read -r -a DEEPSPEED_EXTRA <<<"${DEEPSPEED_ARGS:-}"
}

# deepspeed --hostfile starts every node's processes through pdsh with only a few of this environment's variables
# (PYTHON*, NCCL*, PATH, ...) and those of its environment file (DS_ENV_FILE, default .deepspeed_env in ~ and in
# the working directory). Write one file (private to the user) holding the variables a run reads (MOEP_* data and
# cache folders, the hubs' HF_* / TRANSFORMERS_* / TOKENIZERS_* settings, GLOO_* / TORCH_*, OMP_NUM_THREADS,
# DEEPSPEED_TIMEOUT, and PATH: the job's tools, e.g. the virtual environment's ninja, which DeepSpeed's JIT-built
# ops need; a remote shell's PATH finds none or another version, whose build log format differs, so every switch
# rebuilds the op), then the user's own file's lines, which win as DeepSpeed lets them; point DS_ENV_FILE at it.
# DeepSpeed puts each value in double quotes on a shell command line: a value holding " $ ` \ or a newline is left
# out with a warning (it would break the command or run on the nodes), and secrets (HF_TOKEN and other *_TOKEN,
# *SECRET*, *PASSWORD*) are never written.
write_deepspeed_env() {
    local file=$1 user=${DS_ENV_FILE:-.deepspeed_env} source name value line sources mpi=0
    if [[ " ${DEEPSPEED_ARGS:-} " =~ [[:space:]]--launcher(=|[[:space:]]+)(openmpi|mpich|impi|mvapich)[[:space:]] ]]; then
        mpi=1
    fi
    sources=("$HOME/$user" "$PWD/$user")
    case $user in /*) sources=("$user") ;; esac
    (umask 077 && : >"$file")
    for name in $(compgen -e); do
        case $name in
            *_TOKEN | *_TOKEN_* | *SECRET* | *PASSWORD*) continue ;;
            MOEP_* | HF_* | TRANSFORMERS_* | TOKENIZERS_* | GLOO_* | TORCH_* | OMP_NUM_THREADS | DEEPSPEED_TIMEOUT | PATH) ;;
            *) continue ;;
        esac
        value=${!name}
        if [[ $value == *[\"\$\`\\]* || $value == *$'\n'* ]]; then
            log "warning: $name is not passed to the other nodes: its value holds \" \$ \` \\ or a newline"
            continue
        fi
        # DeepSpeed's MPI runners put `-x NAME="value"` (quoted as for pdsh's shell) into mpirun's argv, which no shell
        # reads: the quotes would become part of the value. Open MPI under SLURM starts its daemons with srun, which
        # carries the job's whole environment: such a variable reaches the nodes unquoted without the file.
        if [ "$mpi" = 1 ] && [[ $value =~ [^[:alnum:]_@%+=:,./-] ]]; then
            log "warning: $name is left out of DeepSpeed's -x list (its MPI runner would pass the value with quotes):" \
                "the nodes get the job's own"
            continue
        fi
        printf '%s=%s\n' "$name" "$value" >>"$file"
    done
    for source in "${sources[@]}"; do
        [ -f "$source" ] || continue
        while IFS= read -r line || [ -n "$line" ]; do
            if [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then  # yours as written ($ expands on the nodes)
                printf '%s\n' "$line" >>"$file"
            elif [ -n "$line" ]; then
                log "warning: $source: a line DeepSpeed cannot pass on is left out: $line"
            fi
        done <"$source"
    done
    export DS_ENV_FILE=$file
}

free_port() {
    "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# cluster_has_gpus: 1 unless sinfo answers and no partition offers a GPU gres (a CPU-only cluster, where
# `--gpus-per-node=N` is refused: "Invalid generic resource (gres) specification").
cluster_has_gpus() {
    local gres
    gres=$(sinfo -h -o %G 2>/dev/null) || return 0
    [[ $gres == *gpu* ]]
}

# submit_self SCRIPT [ARG...]: outside a SLURM job, submit SCRIPT with NODES, GPUS_PER_NODE and NPROC_PER_NODE as
# sbatch options (its #SBATCH lines give the defaults; sbatch's own SBATCH_ACCOUNT, SBATCH_PARTITION, ... apply).
# On a cluster without GPU gres, GPUS_PER_NODE defaults to 0: `--gpus-per-node=0` overrides the scripts'
# `#SBATCH --gpus-per-node=8`, and NPROC_PER_NODE (default 1 there) gives the tasks per node. The job gets this
# environment (sbatch exports it) and finds the repository through MOEP_ROOT.
submit_self() {
    local -a opts=()
    local nproc=${NPROC_PER_NODE:-}
    if [ -n "${NODES:-}" ]; then opts+=("--nodes=$NODES"); fi
    if [ -z "${GPUS_PER_NODE:-}" ] && ! cluster_has_gpus; then
        GPUS_PER_NODE=0
        log "the cluster has no GPU gres (sinfo): submitting a CPU-only job (GPUS_PER_NODE=0)"
    fi
    if [ -n "${GPUS_PER_NODE:-}" ]; then
        opts+=("--gpus-per-node=$GPUS_PER_NODE")
        if [ -z "$nproc" ]; then
            if [ "$GPUS_PER_NODE" -gt 0 ]; then nproc=$GPUS_PER_NODE; else nproc=1; fi
        fi
        export GPUS_PER_NODE
    fi
    if [ -n "$nproc" ]; then opts+=("--ntasks-per-node=$nproc"); fi
    export MOEP_ROOT=$ROOT
    log "not inside a SLURM job: submitting $1 with sbatch ${opts[*]}"
    exec sbatch "${opts[@]}" "$@"
}

# procs_per_node: NPROC_PER_NODE (processes per node) defaults to GPUS_PER_NODE when that is above 0, else to the
# GPUs SLURM gave the job per node, else to the job's tasks per node (a CPU-only job: --ntasks-per-node).
procs_per_node() {
    local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
    if [ -z "${NPROC_PER_NODE:-}" ]; then
        if [[ $gpus =~ ^[0-9]+$ ]] && [ "$gpus" -gt 0 ]; then
            NPROC_PER_NODE=$gpus
        elif [[ ${SLURM_NTASKS_PER_NODE:-} =~ ^[0-9]+$ ]]; then
            NPROC_PER_NODE=$SLURM_NTASKS_PER_NODE
        else
            die "set NPROC_PER_NODE or GPUS_PER_NODE (the job has neither GPUs nor --ntasks-per-node)"
        fi
    fi
    require_int NPROC_PER_NODE "a positive integer (processes per node)" 1
}

# slurm_layout NODES: HOSTS = the first NODES hosts of the job's allocation, and NPROC_PER_NODE (procs_per_node).
slurm_layout() {
    local listing
    listing=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
    mapfile -t HOSTS <<<"$listing"
    if [ "${#HOSTS[@]}" -lt "$1" ]; then die "NODES ($1) exceeds the job's ${#HOSTS[@]} node(s) ($SLURM_JOB_NODELIST)"; fi
    HOSTS=("${HOSTS[@]:0:$1}")
    procs_per_node
}

# remove_on_exit FILE...: delete the job's temporary files (hostfile, environment file) when the script exits,
# however it ends (a requeued job writes them again).
remove_on_exit() {
    TEMP_FILES+=("$@")
    trap 'rm -f -- "${TEMP_FILES[@]}"' EXIT
}
TEMP_FILES=()

# stop_local_trainers: SIGUSR1 to this machine's trainers of this launch (the deepspeed launcher does not
# forward SIGUSR1 to its children).
stop_local_trainers() {
    bash "$ROOT/launchers/signal_trainers.sh" USR1 "$MASTER_PORT"
}

# run_preemptible [--requeue] STOP_FN COMMAND...: run COMMAND and return its status. On SIGUSR1 (SLURM's warning
# before the time limit, `--signal=B:USR1@90`) call STOP_FN, which asks the trainers to checkpoint and exit, wait
# for them, then (--requeue) `scontrol requeue` the job, which resumes with --resume auto. On SIGTERM (scancel,
# preemption) only STOP_FN: a cancelled job must stay cancelled.
run_preemptible() {
    REQUEUE=0 STOP_SENT=0 INTERRUPTED=0
    local requeue=0 status=0
    if [ "$1" = --requeue ]; then requeue=1; shift; fi
    STOP_FN=$1
    shift
    trap 'on_stop_signal USR1 || true' USR1  # a failing trap would end this shell (set -e)
    trap 'on_stop_signal TERM || true' TERM
    log "launch: $(printf '%q ' "$@")"
    "$@" &
    LAUNCH_PID=$!
    # A trapped signal interrupts `wait` (status 128 + signal) whether or not the launch is still running; wait
    # again for its own status (bash keeps it for a launch that ended meanwhile), or a job stopped cleanly
    # would end with 138.
    while :; do
        INTERRUPTED=0 status=0
        wait "$LAUNCH_PID" || status=$?
        if [ "$INTERRUPTED" = 0 ]; then break; fi
    done
    trap - USR1 TERM
    if [ "$requeue" = 1 ] && [ "$REQUEUE" = 1 ]; then
        log "launch exited with status $status after the stop request; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}

on_stop_signal() {
    INTERRUPTED=1
    if [ "$1" = USR1 ]; then REQUEUE=1; fi
    if [ "$STOP_SENT" = 1 ]; then  # a repeat could kill a trainer that is already shutting down
        log "received SIG$1: the trainers are already stopping"
        return 0
    fi
    STOP_SENT=1
    log "received SIG$1: asking the trainers to checkpoint and stop"
    "$STOP_FN" || log "stop request failed with status $? (the launch continues)"
}
