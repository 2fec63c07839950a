# shellcheck shell=bash
# Shared body of slurm/train_grpo.sh and slurm/train_opd.sh (sourced inside the sbatch job; not run by itself).
#
# The job, on its first node (the "head"):
#   1. settles the configuration (environment variables below, defaults per mode);
#   2. derives MASTER_ADDR/MASTER_PORT from `scontrol show hostnames $SLURM_JOB_NODELIST`, the run dir
#      $SAVE/slurm-jobs/$SLURM_JOB_ID, the event endpoint (ipc:// on one node, tcp://HEAD:PORT otherwise) and a
#      fresh shared secret (0600 file in the run dir);
#   3. starts the trainer as one job step: `srun --overlap` one task per trainer node, each running
#      slurm/launch_node.sh → torchrun --nproc_per_node=$NPROC_PER_NODE → one trainer rank per process, or the
#      trainer directly when there is one rank in all (every rank records its PID in the run dir);
#   4. waits for the step; on USR1/TERM/INT (SLURM's `--signal=B:USR1@120` pre-timeout signal, or
#      `scancel --signal=USR1 --batch JOBID`) it sends SIGUSR1 to the trainer ranks only — not to torchrun, not
#      to the rollout workers — once each rank has installed its handler; the trainer finishes the current step,
#      saves a checkpoint and exits 0;
#   5. exits with the step's exit code.
#
# Variables (environment or `sbatch --export=ALL,NAME=VALUE`); CPU-mode default / GPU-mode default:
#   TSYNC_CPU          1: no GPUs (gloo, CUDA hidden), everything on one node, tiny model created if missing  (0)
#   TRAINER_NODES      nodes running trainer ranks (first nodes of the allocation)            1 / 1
#   ROLLOUT_NODES      extra nodes for rollout workers (see "Limits" in the script headers)   0 / 0
#   GPUS_PER_NODE      GPUs per trainer node = trainer ranks per node                         - / $SLURM_GPUS_ON_NODE or 8
#   NPROC_PER_NODE     trainer ranks per node (CPU: gloo processes)                           1 / $GPUS_PER_NODE
#   TP, PP             tensor / pipeline model-parallel sizes                                 1 / 1
#   MODEL              Hugging Face model folder of the policy              $TSYNC_RUNS/tiny-model / (required)
#   TEACHER_MODEL      teacher folder (train_opd.sh)                      $TSYNC_RUNS/tiny-teacher / (required)
#   SAVE               checkpoint dir                                      $TSYNC_RUNS/$SLURM_JOB_NAME
#   LOAD               resume dir (same as SAVE: a resubmit resumes from its latest checkpoint)   $SAVE
#   TSYNC_RUNS         where the defaults above live                       $SLURM_SUBMIT_DIR/runs
#   TRAIN_ITERS        optimizer steps in total (not per job)                                 4 / 1000
#   SAVE_INTERVAL      checkpoint every N steps (and always when stopped by a signal)         1 / 25
#   GROUP_SIZE         trajectories per prompt                                                2 / 8
#   GLOBAL_BATCH_SIZE  trajectories per step                                                  4 / 256
#   RL_MODE            sync | stream-group | stream-trajectory | async | stream-turn (opd)   stream-trajectory
#   ROLLOUT_WORKERS    rollout worker processes (started by the trainer)                      1 / 8
#   ROLLOUT_ENGINE     embedded | vllm                                                        embedded / vllm
#   ROLLOUT_GPUS_PER_WORKER  GPUs per rollout worker on rollout nodes; with vllm also the trainer's
#                      --rollout-tensor-parallel-size (the engine's TP, sent to the workers in their specs)  - / 1
#   SEQ_LENGTH, MAX_TURNS, MAX_NEW_TOKENS                                                     128, 2, 16 / trainer's
#   TASK               task name                                                              trainer's default
#   TENSORBOARD_DIR                                                        $SAVE/tensorboard
#   EXTRA_ARGS         more trainer flags (word-split); arguments after the script name are appended too
#   TSYNC_PYTHON       python with megatron_tsync installed                                   python
#   MASTER_PORT        torch.distributed rendezvous port; EVENTS_PORT (tcp events) = MASTER_PORT + 1
#   TSYNC_FORWARD_EVERY  seconds between checks of the trainer step / retries of a pending signal   2

tsync_log() { echo "[tsync-slurm] $(date +%H:%M:%S) $*"; }
tsync_die() { echo "[tsync-slurm] error: $*" >&2; exit 2; }

# ------------------------------------------------------------------------------------------------ configuration
tsync_config() {
  [ -n "${SLURM_JOB_ID:-}" ] || tsync_die "run this script with sbatch (SLURM_JOB_ID is not set)"
  PY=${TSYNC_PYTHON:-python}
  TSYNC_CPU=${TSYNC_CPU:-0}
  TSYNC_RUNS=${TSYNC_RUNS:-${SLURM_SUBMIT_DIR:-$PWD}/runs}
  TRAINER_NODES=${TRAINER_NODES:-1}
  ROLLOUT_NODES=${ROLLOUT_NODES:-0}
  TP=${TP:-1}
  PP=${PP:-1}
  RL_MODE=${RL_MODE:-stream-trajectory}
  SAVE=${SAVE:-$TSYNC_RUNS/${SLURM_JOB_NAME:-tsync}}
  LOAD=${LOAD:-$SAVE}
  TENSORBOARD_DIR=${TENSORBOARD_DIR:-$SAVE/tensorboard}
  if [ "$TSYNC_CPU" = 1 ]; then
    GPUS_PER_NODE=0
    NPROC_PER_NODE=${NPROC_PER_NODE:-1}
    MODEL=${MODEL:-$TSYNC_RUNS/tiny-model}
    TRAIN_ITERS=${TRAIN_ITERS:-4}
    SAVE_INTERVAL=${SAVE_INTERVAL:-1}
    GROUP_SIZE=${GROUP_SIZE:-2}
    GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-4}
    ROLLOUT_WORKERS=${ROLLOUT_WORKERS:-1}
    ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-embedded}
    ROLLOUT_GPUS_PER_WORKER=0
    SEQ_LENGTH=${SEQ_LENGTH:-128}
    MAX_TURNS=${MAX_TURNS:-2}
    MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-16}
    export CUDA_VISIBLE_DEVICES=""  # gloo even on a GPU node
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  else
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
    NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
    [ -n "${MODEL:-}" ] || tsync_die "MODEL=<Hugging Face folder> is required without TSYNC_CPU=1"
    TRAIN_ITERS=${TRAIN_ITERS:-1000}
    SAVE_INTERVAL=${SAVE_INTERVAL:-25}
    GROUP_SIZE=${GROUP_SIZE:-8}
    GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
    ROLLOUT_WORKERS=${ROLLOUT_WORKERS:-8}
    ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
    ROLLOUT_GPUS_PER_WORKER=${ROLLOUT_GPUS_PER_WORKER:-1}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron TP overlap ordering
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  fi
  FORWARD_EVERY=${TSYNC_FORWARD_EVERY:-2}
}

tsync_check_layout() {
  local n=${SLURM_JOB_NUM_NODES:-1}
  if [ "$TSYNC_CPU" = 1 ]; then
    if [ "$TRAINER_NODES" != 1 ] || [ "$ROLLOUT_NODES" != 0 ]; then
      tsync_die "TSYNC_CPU=1 runs everything on one node: TRAINER_NODES=1 ROLLOUT_NODES=0 (got $TRAINER_NODES/$ROLLOUT_NODES)"
    fi
  fi
  if [ "$ROLLOUT_NODES" -gt 0 ] && [ "$REPLAY" = 1 ]; then
    tsync_die "ROLLOUT_NODES=$ROLLOUT_NODES with --replay-rollouts: replaying needs no rollout nodes"
  fi
  [ $((TRAINER_NODES + ROLLOUT_NODES)) -le "$n" ] \
    || tsync_die "TRAINER_NODES=$TRAINER_NODES + ROLLOUT_NODES=$ROLLOUT_NODES > $n allocated nodes (sbatch --nodes)"
  local world=$((TRAINER_NODES * NPROC_PER_NODE))
  [ $((world % (TP * PP))) = 0 ] || tsync_die "trainer ranks $world (TRAINER_NODES × NPROC_PER_NODE) not divisible by TP×PP=$((TP * PP))"
}

# ------------------------------------------------------------------------------------------------ derived values
tsync_derive() {
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  [ "${#NODES[@]}" -ge 1 ] || tsync_die "no nodes in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
  HEAD=${NODES[0]}
  TRAINER_NODELIST=$(IFS=,; echo "${NODES[*]:0:$TRAINER_NODES}")
  if [ "$TRAINER_NODES" = 1 ]; then
    MASTER_ADDR=127.0.0.1  # one trainer node: the rendezvous never leaves the node
  else
    MASTER_ADDR=$HEAD
  fi
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  EVENTS_PORT=${EVENTS_PORT:-$((MASTER_PORT + 1))}
  export MASTER_ADDR MASTER_PORT
  RUN_DIR=$SAVE/slurm-jobs/$SLURM_JOB_ID
  PID_DIR=$RUN_DIR/pids
  rm -rf "$PID_DIR"  # job ids restart with a fresh slurmctld state: never trust PID files of an older job
  mkdir -p "$RUN_DIR" "$PID_DIR"
  if [ "$((TRAINER_NODES + ROLLOUT_NODES))" = 1 ]; then
    ENDPOINT=ipc://$RUN_DIR/events.sock
    # unix socket paths are limited to ~107 bytes
    [ ${#ENDPOINT} -le 100 ] || ENDPOINT=ipc:///tmp/tsync-$SLURM_JOB_ID-events.sock
  else
    local head_ip
    head_ip=$(getent hosts "$HEAD" | awk '{print $1; exit}')
    ENDPOINT=tcp://${head_ip:-$HEAD}:$EVENTS_PORT
  fi
  SECRET_FILE=$RUN_DIR/secret.hex
  rm -f "$SECRET_FILE"
  (umask 077 && "$PY" -W ignore -c 'import sys; from megatron_tsync.transport.secret import write_secret_file
write_secret_file(sys.argv[1])' "$SECRET_FILE") \
    || tsync_die "cannot create the shared secret $SECRET_FILE with $PY (is megatron_tsync installed in it?)"
  chmod 0600 "$SECRET_FILE"
}

tsync_prepare_models() {
  [ "$TSYNC_CPU" = 1 ] || return 0
  # The trainer creates MODEL itself (--init-tiny-model); a distillation teacher is made here (different seed).
  if [ "${RL_ALGORITHM}" = opd ] && [ ! -f "$TEACHER_MODEL/config.json" ]; then
    tsync_log "creating a tiny teacher model at $TEACHER_MODEL"
    "$PY" "$TSYNC_HOME/tools/make_tiny_model.py" --out "$TEACHER_MODEL" --seed 1 >/dev/null
  fi
}

tsync_trainer_args() {
  ARGS=(-m megatron_tsync.train
    --model "$MODEL" --rl-algorithm "$RL_ALGORITHM" --rl-mode "$RL_MODE"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --train-iters "$TRAIN_ITERS" --group-size "$GROUP_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --rollout-engine "$ROLLOUT_ENGINE"
    --rollout-endpoint "$ENDPOINT" --secret-file "$SECRET_FILE"
    --save "$SAVE" --save-interval "$SAVE_INTERVAL" --load "$LOAD"
    --tensorboard-dir "$TENSORBOARD_DIR" --no-progress)
  [ "$REPLAY" = 1 ] || ARGS+=(--rollout-workers "$ROLLOUT_WORKERS")  # replaying: no workers
  if [ "$ROLLOUT_NODES" -gt 0 ]; then  # workers run as their own job step on the rollout nodes
    ROLLOUT_DIR=$RUN_DIR/rollout_plane
    ARGS+=(--rollout-launch external --rollout-dir "$ROLLOUT_DIR")
    # launch_node.sh gives each worker ROLLOUT_GPUS_PER_WORKER GPUs: its vLLM engine spans them
    if [ "$ROLLOUT_ENGINE" = vllm ] && [ "$TSYNC_CPU" != 1 ] && [ "$ROLLOUT_GPUS_PER_WORKER" -gt 1 ]; then
      ARGS+=(--rollout-tensor-parallel-size "$ROLLOUT_GPUS_PER_WORKER")
    fi
  fi
  [ "$TSYNC_CPU" = 1 ] && ARGS+=(--init-tiny-model)
  [ "$RL_ALGORITHM" = opd ] && ARGS+=(--teacher-model "$TEACHER_MODEL")
  [ -n "${SEQ_LENGTH:-}" ] && ARGS+=(--seq-length "$SEQ_LENGTH")
  [ -n "${MAX_TURNS:-}" ] && ARGS+=(--max-turns "$MAX_TURNS")
  [ -n "${MAX_NEW_TOKENS:-}" ] && ARGS+=(--max-new-tokens "$MAX_NEW_TOKENS")
  [ -n "${TASK:-}" ] && ARGS+=(--task "$TASK")
  ARGS+=("${EXTRA[@]}")
}

# ------------------------------------------------------------------------------------------------ signals
STOP_SIG=
DELIVERED=0
tsync_on_signal() {
  [ -n "$STOP_SIG" ] || tsync_log "got SIG$1: asking the trainer to finish its step, save and exit"
  STOP_SIG=$1
  tsync_forward
}

# SIGUSR1 to every trainer rank (all nodes); pending (retried every FORWARD_EVERY s) until every rank has its
# handler installed — a signal that early would otherwise kill a rank that has not reached its training loop.
tsync_forward() {
  [ "$DELIVERED" = 0 ] || return 0
  local ok=0
  if [ "$TRAINER_NODES" = 1 ]; then
    bash "$TSYNC_HOME/slurm/launch_node.sh" signal USR1 "$PID_DIR" "$NPROC_PER_NODE" && ok=1
  else
    srun --overlap --nodes="$TRAINER_NODES" --nodelist="$TRAINER_NODELIST" --ntasks-per-node=1 \
      bash "$TSYNC_HOME/slurm/launch_node.sh" signal USR1 "$PID_DIR" "$NPROC_PER_NODE" && ok=1
  fi
  if [ "$ok" = 1 ]; then
    DELIVERED=1
    tsync_log "sent SIGUSR1 to the trainer ranks"
  fi
}

# ------------------------------------------------------------------------------------------------ main
tsync_main() {
  EXTRA=()
  if [ -n "${EXTRA_ARGS:-}" ]; then read -r -a EXTRA <<<"$EXTRA_ARGS"; fi
  EXTRA+=("$@")
  REPLAY=0
  case " ${EXTRA[*]:-} " in *" --replay-rollouts"*) REPLAY=1 ;; esac
  tsync_config
  if [ "$RL_ALGORITHM" = opd ]; then
    if [ "$TSYNC_CPU" = 1 ]; then TEACHER_MODEL=${TEACHER_MODEL:-$TSYNC_RUNS/tiny-teacher}; fi
    [ -n "${TEACHER_MODEL:-}" ] || tsync_die "TEACHER_MODEL=<Hugging Face folder> is required for train_opd.sh"
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron_tsync.runtime.opd') is None)" \
      || tsync_die "OPD trainer not available in this megatron_tsync (megatron_tsync.runtime.opd is missing)"
  fi
  tsync_check_layout
  tsync_derive
  tsync_prepare_models
  tsync_trainer_args
  {
    echo "job $SLURM_JOB_ID on ${NODES[*]} (head $HEAD); cpu mode $TSYNC_CPU"
    echo "trainer: $TRAINER_NODES node(s) × $NPROC_PER_NODE rank(s), TP=$TP PP=$PP, master $MASTER_ADDR:$MASTER_PORT"
    echo "events $ENDPOINT, secret $SECRET_FILE, run dir $RUN_DIR"
    printf 'command: %s' "$PY"; printf ' %q' "${ARGS[@]}"; echo
  } | tee "$RUN_DIR/launch.txt" | sed 's/^/[tsync-slurm] /'

  export TRAINER_NODES NPROC_PER_NODE PID_DIR
  trap 'tsync_on_signal USR1' USR1
  trap 'tsync_on_signal TERM' TERM
  trap 'tsync_on_signal INT' INT
  srun --overlap --nodes="$TRAINER_NODES" --nodelist="$TRAINER_NODELIST" --ntasks="$TRAINER_NODES" \
    --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash "$TSYNC_HOME/slurm/launch_node.sh" trainer "$PY" "${ARGS[@]}" &
  local step_pid=$! rc=0
  if [ "$ROLLOUT_NODES" -gt 0 ]; then
    # one task per rollout worker, spread over the rollout nodes; each waits for its spec from the trainer
    local rollout_nodelist
    rollout_nodelist=$(IFS=,; echo "${NODES[*]:$TRAINER_NODES:$ROLLOUT_NODES}")
    TSYNC_CPU=$TSYNC_CPU ROLLOUT_GPUS_PER_WORKER=$ROLLOUT_GPUS_PER_WORKER \
      srun --overlap --nodes="$ROLLOUT_NODES" --nodelist="$rollout_nodelist" --ntasks="$ROLLOUT_WORKERS" \
      bash "$TSYNC_HOME/slurm/launch_node.sh" rollout "$PY" "$ROLLOUT_DIR" \
      > "$RUN_DIR/rollout_workers.log" 2>&1 &
    tsync_log "rollout workers: $ROLLOUT_WORKERS task(s) on $rollout_nodelist (log $RUN_DIR/rollout_workers.log)"
  fi
  # bash runs a trap only between commands: wait in short slices so a signal is handled at once
  while kill -0 "$step_pid" 2>/dev/null; do
    sleep "$FORWARD_EVERY" &
    wait $! 2>/dev/null || true
    if [ -n "$STOP_SIG" ]; then tsync_forward; fi
  done
  wait "$step_pid" || rc=$?
  if [ "$rc" != 0 ]; then
    tsync_log "trainer step failed (exit code $rc); last lines of the worker logs:"
    tail -n 15 "$SAVE"/rollout_plane/worker_logs/*.log 2>/dev/null | sed 's/^/    /' || true
  elif [ -n "$STOP_SIG" ]; then
    tsync_log "stopped by SIG$STOP_SIG after saving: resubmit the same command to resume from $SAVE"
  fi
  case $ENDPOINT in ipc:///tmp/tsync-"$SLURM_JOB_ID"-events.sock) rm -f "${ENDPOINT#ipc://}" ;; esac
  local latest
  latest=$(cat "$SAVE/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  tsync_log "trainer exited with code $rc; latest checkpoint step: $latest"
  return "$rc"
}
