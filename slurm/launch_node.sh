#!/usr/bin/env bash
# Per-node helper of slurm/common.sh (not for direct use).
#
#   launch_node.sh trainer PYTHON ARGS...     one srun task per trainer node. One trainer rank in all: runs it
#                                             directly ('rank' below; RANK=0 WORLD_SIZE=1, MASTER_* of the job).
#                                             Several: torchrun --nproc_per_node=$NPROC_PER_NODE, node rank
#                                             $SLURM_NODEID, static rendezvous at $MASTER_ADDR:$MASTER_PORT, every
#                                             rank running 'launch_node.sh rank PYTHON ARGS...'. (Not torchrun for
#                                             one rank: the rollout workers the trainer spawns inherit torchrun's
#                                             TORCHELASTIC_USE_AGENT_STORE=True and hang in their own
#                                             init_process_group, waiting for an agent store that does not exist.)
#   launch_node.sh rank PYTHON ARGS...        records this rank's PID in $PID_DIR/<host>.<LOCAL_RANK>.pid, then
#                                             exec's PYTHON ARGS (so the PID is the trainer rank's)
#   launch_node.sh rollout PYTHON SPEC_DIR    one srun task per rollout worker: pins its GPUs, runs the worker
#   launch_node.sh signal SIG PID_DIR N       sends SIG to this node's N recorded ranks once all N have a handler
#                                             for it installed (/proc/PID/status SigCgt); exit 1 if not yet
# TSYNC_PY_PREFIX (from common.sh, word-split): what every python runs behind, e.g. `apptainer exec --nv IMAGE`.
set -euo pipefail
read -r -a prefix <<<"${TSYNC_PY_PREFIX:-}"

mode=${1:?usage: launch_node.sh trainer|rank|rollout|signal ...}
shift
host=$(hostname -s)

case $mode in
  trainer)
    py=$1
    shift
    export PID_DIR
    if [ "$((TRAINER_NODES * NPROC_PER_NODE))" = 1 ]; then
      export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
      exec "${prefix[@]}" bash "$0" rank "$py" "$@"
    fi
    exec "${prefix[@]}" "$py" -m torch.distributed.run \
      --nnodes="$TRAINER_NODES" --node_rank="${SLURM_NODEID:-0}" --nproc_per_node="$NPROC_PER_NODE" \
      --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
      --no-python bash "$0" rank "$py" "$@"
    ;;
  rank)
    echo $$ >"$PID_DIR/$host.${LOCAL_RANK:-0}.pid"
    exec "$@"
    ;;
  rollout)
    # one srun task per rollout worker: task SLURM_LOCALID of this node gets GPUs
    # [LOCALID*G, LOCALID*G + G) (G = ROLLOUT_GPUS_PER_WORKER; 0 or TSYNC_CPU=1: no GPU). The engine's
    # tensor-parallel size reaches the worker in its spec (the trainer's --rollout-tensor-parallel-size, which
    # common.sh sets to the same G)
    py=$1 dir=$2
    g=${ROLLOUT_GPUS_PER_WORKER:-1}
    if [ "${TSYNC_CPU:-0}" != 1 ] && [ "$g" -gt 0 ]; then
      first=$(( ${SLURM_LOCALID:-0} * g ))
      CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + g - 1)))
      export CUDA_VISIBLE_DEVICES
    fi
    echo "[tsync-slurm] rollout worker ${SLURM_PROCID:-0} on $host (GPUs '${CUDA_VISIBLE_DEVICES:-}')"
    exec "${prefix[@]}" "$py" -m megatron_tsync.runtime.worker "$dir/worker${SLURM_PROCID:-0}.json"
    ;;
  signal)
    sig=$1 dir=$2 want=$3
    num=$(kill -l "$sig")
    bit=$((1 << (num - 1)))
    pids=()
    for f in "$dir/$host".*.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f")
      kill -0 "$pid" 2>/dev/null || continue
      caught=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
      (( 16#${caught:-0} & bit )) || exit 1  # not ready for it yet: the caller retries
      pids+=("$pid")
    done
    [ "${#pids[@]}" -ge "$want" ] || exit 1
    kill -s "$sig" "${pids[@]}"
    ;;
  *)
    echo "launch_node.sh: unknown mode $mode" >&2
    exit 2
    ;;
esac
