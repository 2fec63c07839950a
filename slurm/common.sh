# shellcheck shell=bash
# Shared body of slurm/train_grpo.sh and slurm/train_opd.sh (sourced inside the sbatch job; not run by itself).
#
# The job, on its first node (the "head"):
#   1. sources ENV_SETUP, loads MODULES, settles the configuration (variables below, defaults per mode);
#   2. derives the run name, SAVE ($TSYNC_RUNS/$RUN_NAME), the per-job dir $SAVE/slurm-jobs/$SLURM_JOB_ID (rollout
#      plane, secret, PIDs, launch.txt: nothing of one job is shared with another), MASTER_ADDR/MASTER_PORT from
#      `scontrol show hostnames $SLURM_JOB_NODELIST`, the event endpoint (ipc:// on one node, tcp://HEAD:PORT
#      otherwise) and a fresh shared secret (0600 file in the job dir);
#   3. starts the trainer as one job step: `srun --overlap` one task per trainer node, each running
#      slurm/launch_node.sh → torchrun --nproc_per_node=$NPROC_PER_NODE → one trainer rank per process, or the
#      trainer directly when there is one rank in all (every rank records its PID in the job dir); with
#      ROLLOUT_NODES > 0 the rollout workers run as a second job step on the rollout nodes;
#   4. waits for the step; on USR1/TERM/INT it forwards the same signal to the trainer ranks only — not to torchrun,
#      not to the rollout workers — once each rank has installed its handler (USR1: finish the step, save, exit 0;
#      TERM: stop now, save the last finished step, exit 0). The trainer writes $SAVE/tsync_stop.json;
#   5. requeues itself (`scontrol requeue`, same job id, LOAD=SAVE resumes) when the trainer stopped unfinished on
#      its time budget (EXIT_DURATION_MINS) or on SLURM's pre-timeout USR1, unless REQUEUE=0; exits with the
#      trainer's exit code.
# TSYNC_DRY_RUN=1 prints the exact commands (srun steps, trainer flags, environment) and exits 0 without starting
# anything or writing a file; it also runs outside SLURM (`TSYNC_DRY_RUN=1 bash slurm/train_grpo.sh`).
#
# Variables (environment or `sbatch --export=ALL,NAME=VALUE`); CPU-mode default / GPU-mode default:
#   TSYNC_CPU          1: no GPUs (gloo, CUDA hidden), embedded engine, tiny model created if missing     (0)
#   TRAINER_NODES      nodes running trainer ranks (first nodes of the allocation)            1 / 1
#   ROLLOUT_NODES      extra nodes for rollout workers                                        0 / 0
#   GPUS_PER_NODE      GPUs per node                                                          - / $SLURM_GPUS_ON_NODE or 8
#   TRAINER_GPUS       GPUs of the trainer ranks per node (0..TRAINER_GPUS-1)   - / GPUS_PER_NODE/2 with ROLLOUT_NODES=0
#                                                                                                (else GPUS_PER_NODE)
#   ROLLOUT_GPUS       GPUs of the rollout engines on the trainer's head node (--rollout-gpus, comma list;
#                      must not overlap the trainer's)                 - / TRAINER_GPUS..GPUS_PER_NODE-1 (ROLLOUT_NODES=0)
#   NPROC_PER_NODE     trainer ranks per node (CPU: gloo processes)                           1 / $TRAINER_GPUS
#   TP, PP             tensor / pipeline model-parallel sizes                                 1 / 1
#   MODEL              Hugging Face model folder of the policy              $TSYNC_RUNS/tiny-model / (required)
#   TEACHER_MODEL      teacher folder (train_opd.sh)                      $TSYNC_RUNS/tiny-teacher / (required)
#   RUN_NAME           name of the run          $SLURM_JOB_NAME (+ _$SLURM_ARRAY_TASK_ID in a job array)
#   TSYNC_RUNS         where runs and the CPU-mode models live             $SLURM_SUBMIT_DIR/runs
#   SAVE               checkpoint dir (one per run: never shared by two experiments)    $TSYNC_RUNS/$RUN_NAME
#   LOAD               resume dir (same as SAVE: a resubmit or requeue resumes from its latest checkpoint)   $SAVE
#   TRAIN_ITERS        optimizer steps in total (not per job)                                 4 / 1000
#   SAVE_INTERVAL      checkpoint every N steps (and always when stopped)                     1 / 25
#   KEEP_LAST_CKPTS    keep only the newest N checkpoints (--keep-last-checkpoints)           all
#   EXIT_DURATION_MINS stop at a step boundary after N minutes, save, requeue (--exit-duration-in-mins)    off
#   REQUEUE            0: never requeue the job itself (resubmit by hand)                     1
#   REQUEUE_SIGNAL_WINDOW  a USR1 that arrives with at most this many seconds of the time limit left is SLURM's
#                      pre-timeout signal (→ requeue); earlier it is a manual stop (no requeue)   600
#   GROUP_SIZE         trajectories per prompt                                                2 / 8
#   GLOBAL_BATCH_SIZE  trajectories per step                                                  4 / 256
#   RL_MODE            sync | stream-group | stream-trajectory | async | stream-turn (opd)   stream-trajectory
#   ROLLOUT_WORKERS    rollout worker processes                  1 / ROLLOUT_GPUS ÷ ROLLOUT_GPUS_PER_WORKER, or 8
#   ROLLOUT_ENGINE     embedded | vllm                                                        embedded / vllm
#   ROLLOUT_GPUS_PER_WORKER  GPUs per rollout worker; with vllm also the trainer's --rollout-tensor-parallel-size
#                      (the engine's TP, sent to the workers in their specs)                 - / 1
#   SEQ_LENGTH, MAX_TURNS, MAX_NEW_TOKENS                                                     128, 2, 16 / trainer's
#   TASK               task name                                                              trainer's default
#   TENSORBOARD_DIR                                                        $SAVE/tensorboard
#   WANDB_PROJECT      W&B project: logs to W&B beside TensorBoard (--wandb-project)         off
#   WANDB_EXP_NAME     W&B run name (--wandb-exp-name)                                        $RUN_NAME
#   WANDB_SAVE_DIR     W&B files (--wandb-save-dir)                                           $SAVE/wandb
#   WANDB_MODE         passed through (offline: no network needed; `wandb sync` later)
#   CONTAINER_IMAGE    pyxis/enroot image: srun --container-image (trainer and rollout job steps)
#   CONTAINER_MOUNTS   srun --container-mounts (apptainer: --bind)        $TSYNC_HOME:$TSYNC_HOME,$SAVE:$SAVE
#   CONTAINER_WORKDIR  srun --container-workdir                                               $TSYNC_HOME
#   APPTAINER_IMAGE    apptainer image: every python runs as `apptainer exec [--nv] IMAGE python ...` (--nv with GPUs)
#   MODULES            environment modules to `module load` (space-separated) before the launch
#   ENV_SETUP          a bash file sourced first (site settings, venv activation, variables of this list)
#   HF_HOME, HF_HUB_OFFLINE, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG: passed through to
#                      every process (exported, listed in launch.txt)
#   EXTRA_ARGS         more trainer flags (word-split); arguments after the script name are appended too
#   TSYNC_PYTHON       python with megatron_tsync installed                                   python
#   TSYNC_DRY_RUN      1: print the commands and exit 0 (see above)                           0
#   MASTER_PORT        torch.distributed rendezvous port; EVENTS_PORT (tcp events) = MASTER_PORT + 1
#   TSYNC_FORWARD_EVERY  seconds between checks of the trainer step / retries of a pending signal   2

TSYNC_PASS_VARS=(HF_HOME HF_HUB_OFFLINE NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG WANDB_MODE)

tsync_log() { echo "[tsync-slurm] $(date +%H:%M:%S) $*"; }
tsync_die() { echo "[tsync-slurm] error: $*" >&2; exit 2; }

# ------------------------------------------------------------------------------------------------ environment
# ENV_SETUP first (it may set any variable above), then MODULES.
tsync_env_setup() {
  if [ -n "${ENV_SETUP:-}" ]; then
    [ -f "$ENV_SETUP" ] || tsync_die "ENV_SETUP=$ENV_SETUP: no such file"
    tsync_log "sourcing ENV_SETUP=$ENV_SETUP"
    set +u
    # shellcheck disable=SC1090
    source "$ENV_SETUP" || { set -u; tsync_die "ENV_SETUP=$ENV_SETUP failed (exit code $?)"; }
    set -u
  fi
  if [ -n "${MODULES:-}" ]; then
    type module >/dev/null 2>&1 \
      || tsync_die "MODULES='$MODULES' is set but there is no 'module' command in the batch shell (environment modules or Lmod; source its init script in ENV_SETUP)"
    local m
    for m in $MODULES; do
      set +u
      module load "$m" || { set -u; tsync_die "module load $m failed (MODULES='$MODULES')"; }
      set -u
      tsync_log "module load $m"
    done
  fi
}

# ------------------------------------------------------------------------------------------------ configuration
tsync_config() {
  DRY_RUN=${TSYNC_DRY_RUN:-0}
  OUTSIDE_SLURM=0
  if [ "$DRY_RUN" = 1 ] && [ -z "${SLURM_JOB_ID:-}" ]; then  # outside SLURM: a stand-in job (SLURM_JOB_NODELIST
    OUTSIDE_SLURM=1                                           # a plain comma list; default this host)
    SLURM_JOB_ID=0 SLURM_JOB_NUM_NODES=${SLURM_JOB_NUM_NODES:-1}
  fi
  [ -n "${SLURM_JOB_ID:-}" ] || tsync_die "run this script with sbatch (SLURM_JOB_ID is not set; TSYNC_DRY_RUN=1 prints the commands)"
  PY=${TSYNC_PYTHON:-python}
  TSYNC_CPU=${TSYNC_CPU:-0}
  TSYNC_RUNS=${TSYNC_RUNS:-${SLURM_SUBMIT_DIR:-$PWD}/runs}
  TRAINER_NODES=${TRAINER_NODES:-1}
  ROLLOUT_NODES=${ROLLOUT_NODES:-0}
  TP=${TP:-1}
  PP=${PP:-1}
  RL_MODE=${RL_MODE:-stream-trajectory}
  RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-tsync-$RL_ALGORITHM}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}}
  case $RUN_NAME in */*|.|..|"") tsync_die "RUN_NAME='$RUN_NAME' must be a plain name (no '/')" ;; esac
  SAVE=${SAVE:-$TSYNC_RUNS/$RUN_NAME}
  LOAD=${LOAD:-$SAVE}
  TENSORBOARD_DIR=${TENSORBOARD_DIR:-$SAVE/tensorboard}
  REQUEUE=${REQUEUE:-1}
  REQUEUE_SIGNAL_WINDOW=${REQUEUE_SIGNAL_WINDOW:-600}
  if [ "$TSYNC_CPU" = 1 ]; then
    tsync_config_cpu
  else
    tsync_config_gpu
  fi
  FORWARD_EVERY=${TSYNC_FORWARD_EVERY:-2}
}

tsync_config_cpu() {
  GPUS_PER_NODE=0 TRAINER_GPUS=0
  [ -z "${ROLLOUT_GPUS:-}" ] || tsync_die "ROLLOUT_GPUS=$ROLLOUT_GPUS with TSYNC_CPU=1: CPU mode uses no GPU"
  ROLLOUT_GPUS=
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
}

tsync_config_gpu() {
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  [ -n "${MODEL:-}" ] || tsync_die "MODEL=<Hugging Face folder> is required without TSYNC_CPU=1"
  ROLLOUT_GPUS_PER_WORKER=${ROLLOUT_GPUS_PER_WORKER:-1}
  if [ "$ROLLOUT_NODES" = 0 ] && [ "$REPLAY" = 0 ]; then
    # the rollout engines run on the trainer's head node: a disjoint share of its GPUs
    TRAINER_GPUS=${TRAINER_GPUS:-$(( GPUS_PER_NODE > 1 ? GPUS_PER_NODE / 2 : GPUS_PER_NODE ))}
    if [ -z "${ROLLOUT_GPUS:-}" ] && [ "$TRAINER_GPUS" -lt "$GPUS_PER_NODE" ]; then
      ROLLOUT_GPUS=$(seq -s, "$TRAINER_GPUS" $((GPUS_PER_NODE - 1)))
    fi
    ROLLOUT_GPUS=${ROLLOUT_GPUS:-}
    tsync_check_rollout_gpus
    if [ -n "$ROLLOUT_GPUS" ]; then
      local n; n=$(tr ',' '\n' <<<"$ROLLOUT_GPUS" | grep -c .)
      ROLLOUT_WORKERS=${ROLLOUT_WORKERS:-$(( n / ROLLOUT_GPUS_PER_WORKER > 0 ? n / ROLLOUT_GPUS_PER_WORKER : 1 ))}
    fi
  else
    TRAINER_GPUS=${TRAINER_GPUS:-$GPUS_PER_NODE}
    [ -z "${ROLLOUT_GPUS:-}" ] || tsync_die "ROLLOUT_GPUS=$ROLLOUT_GPUS applies to the trainer's node only (ROLLOUT_NODES=0); rollout nodes give each worker ROLLOUT_GPUS_PER_WORKER GPUs"
    ROLLOUT_GPUS=
  fi
  NPROC_PER_NODE=${NPROC_PER_NODE:-$TRAINER_GPUS}
  TRAIN_ITERS=${TRAIN_ITERS:-1000}
  SAVE_INTERVAL=${SAVE_INTERVAL:-25}
  GROUP_SIZE=${GROUP_SIZE:-8}
  GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
  ROLLOUT_WORKERS=${ROLLOUT_WORKERS:-8}
  ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron TP overlap ordering
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
}

# ROLLOUT_GPUS: a comma list of GPU indices of the head node, none of them the trainer's (0..TRAINER_GPUS-1)
tsync_check_rollout_gpus() {
  [ -n "$ROLLOUT_GPUS" ] || return 0
  local g
  for g in ${ROLLOUT_GPUS//,/ }; do
    [[ $g =~ ^[0-9]+$ ]] || tsync_die "ROLLOUT_GPUS=$ROLLOUT_GPUS: '$g' is not a GPU index (comma list, e.g. 4,5,6,7)"
    [ "$g" -ge "$TRAINER_GPUS" ] \
      || tsync_die "ROLLOUT_GPUS=$ROLLOUT_GPUS overlaps the trainer's GPUs 0-$((TRAINER_GPUS - 1)) (TRAINER_GPUS=$TRAINER_GPUS)"
    [ "$g" -lt "$GPUS_PER_NODE" ] || tsync_die "ROLLOUT_GPUS=$ROLLOUT_GPUS: GPU $g >= GPUS_PER_NODE=$GPUS_PER_NODE"
  done
}

tsync_check_layout() {
  local n=${SLURM_JOB_NUM_NODES:-1}
  if [ "$ROLLOUT_NODES" -gt 0 ] && [ "$REPLAY" = 1 ]; then
    tsync_die "ROLLOUT_NODES=$ROLLOUT_NODES with --replay-rollouts: replaying needs no rollout nodes"
  fi
  [ $((TRAINER_NODES + ROLLOUT_NODES)) -le "$n" ] \
    || tsync_die "TRAINER_NODES=$TRAINER_NODES + ROLLOUT_NODES=$ROLLOUT_NODES > $n allocated nodes (sbatch --nodes)"
  local world=$((TRAINER_NODES * NPROC_PER_NODE))
  [ "$world" -gt 0 ] || tsync_die "no trainer rank: NPROC_PER_NODE=$NPROC_PER_NODE (TRAINER_GPUS=$TRAINER_GPUS)"
  [ $((world % (TP * PP))) = 0 ] || tsync_die "trainer ranks $world (TRAINER_NODES × NPROC_PER_NODE) not divisible by TP×PP=$((TP * PP))"
  if [ -n "${CONTAINER_IMAGE:-}" ] && [ -n "${APPTAINER_IMAGE:-}" ]; then
    tsync_die "CONTAINER_IMAGE (pyxis) and APPTAINER_IMAGE are both set: choose one"
  fi
}

# ------------------------------------------------------------------------------------------------ containers
# SRUN_CONTAINER: the pyxis options of every python job step; PY_PREFIX: what runs before python (apptainer).
tsync_containers() {
  SRUN_CONTAINER=() PY_PREFIX=()
  local mounts=${CONTAINER_MOUNTS:-$TSYNC_HOME:$TSYNC_HOME,$SAVE:$SAVE}
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    SRUN_CONTAINER=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
      --container-workdir="${CONTAINER_WORKDIR:-$TSYNC_HOME}")
  elif [ -n "${APPTAINER_IMAGE:-}" ]; then
    PY_PREFIX=(apptainer exec)
    [ "$GPUS_PER_NODE" -gt 0 ] && PY_PREFIX+=(--nv)
    PY_PREFIX+=(--bind "$mounts" "$APPTAINER_IMAGE")
    [ "$DRY_RUN" = 1 ] || command -v apptainer >/dev/null || tsync_die "APPTAINER_IMAGE is set but there is no apptainer command"
  fi
  TSYNC_PY_PREFIX="${PY_PREFIX[*]}"  # launch_node.sh runs python behind it (word-split: no spaces in the image path)
  export TSYNC_PY_PREFIX
}

# python on the head node in the job's environment (the container's, when there is one)
tsync_py() {
  if [ "${#SRUN_CONTAINER[@]}" -gt 0 ]; then
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$HEAD" "${SRUN_CONTAINER[@]}" "$PY" "$@"
  else
    "${PY_PREFIX[@]}" "$PY" "$@"
  fi
}

# ------------------------------------------------------------------------------------------------ derived values
tsync_derive() {
  if [ "$OUTSIDE_SLURM" = 1 ]; then
    IFS=, read -r -a NODES <<<"${SLURM_JOB_NODELIST:-$(hostname -s)}"
  else
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  fi
  [ "${#NODES[@]}" -ge 1 ] || tsync_die "no nodes in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'"
  HEAD=${NODES[0]}
  TRAINER_NODELIST=$(IFS=,; echo "${NODES[*]:0:$TRAINER_NODES}")
  ROLLOUT_NODELIST=$(IFS=,; echo "${NODES[*]:$TRAINER_NODES:$ROLLOUT_NODES}")
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
  ROLLOUT_DIR=$RUN_DIR/rollout_plane
  if [ "$((TRAINER_NODES + ROLLOUT_NODES))" = 1 ]; then
    ENDPOINT=ipc://$RUN_DIR/events.sock
    # unix socket paths are limited to ~107 bytes
    [ ${#ENDPOINT} -le 100 ] || ENDPOINT=ipc:///tmp/tsync-$SLURM_JOB_ID-events.sock
  else
    local head_ip
    head_ip=$(getent hosts "$HEAD" | awk '{print $1; exit}' || true)
    ENDPOINT=tcp://${head_ip:-$HEAD}:$EVENTS_PORT
  fi
  SECRET_FILE=$RUN_DIR/secret.hex
  JOB_LOG=
  if [ "$OUTSIDE_SLURM" = 0 ]; then
    JOB_LOG=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'StdOut=[^ ]*' | cut -d= -f2- || true)
  fi
  START_STEP=$(cat "$LOAD/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
}

# the job dir and its secret (a requeued job reuses its dir: PIDs and secret are made fresh)
tsync_make_run_dir() {
  rm -rf "$PID_DIR"  # job ids restart with a fresh slurmctld state: never trust PID files of an older job
  mkdir -p "$RUN_DIR" "$PID_DIR"
  rm -f "$SECRET_FILE"
  (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' >"$SECRET_FILE" && echo >>"$SECRET_FILE") \
    || tsync_die "cannot create the shared secret $SECRET_FILE"
  chmod 0600 "$SECRET_FILE"
}

tsync_prepare_models() {
  [ "$TSYNC_CPU" = 1 ] || return 0
  # The trainer creates MODEL itself (--init-tiny-model); a distillation teacher is made here (different seed).
  if [ "${RL_ALGORITHM}" = opd ] && [ ! -f "$TEACHER_MODEL/config.json" ]; then
    tsync_log "creating a tiny teacher model at $TEACHER_MODEL"
    tsync_py "$TSYNC_HOME/tools/make_tiny_model.py" --out "$TEACHER_MODEL" --seed 1 >/dev/null
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
  if [ "$REPLAY" = 0 ]; then  # replaying: no workers
    ARGS+=(--rollout-workers "$ROLLOUT_WORKERS" --rollout-dir "$ROLLOUT_DIR")
    [ "$ROLLOUT_NODES" -gt 0 ] && ARGS+=(--rollout-launch external)  # workers: a job step on the rollout nodes
    [ -n "$ROLLOUT_GPUS" ] && ARGS+=(--rollout-gpus "$ROLLOUT_GPUS")
    # each worker gets ROLLOUT_GPUS_PER_WORKER GPUs: its vLLM engine spans them
    if [ "$ROLLOUT_ENGINE" = vllm ] && [ "$TSYNC_CPU" != 1 ] && [ "$ROLLOUT_GPUS_PER_WORKER" -gt 1 ]; then
      ARGS+=(--rollout-tensor-parallel-size "$ROLLOUT_GPUS_PER_WORKER")
    fi
  fi
  [ -n "${EXIT_DURATION_MINS:-}" ] && ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_MINS")
  [ -n "${KEEP_LAST_CKPTS:-}" ] && ARGS+=(--keep-last-checkpoints "$KEEP_LAST_CKPTS")
  if [ -n "${WANDB_PROJECT:-}" ]; then
    ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-$RUN_NAME}"
      --wandb-save-dir "${WANDB_SAVE_DIR:-$SAVE/wandb}")
  fi
  [ "$TSYNC_CPU" = 1 ] && ARGS+=(--init-tiny-model)
  [ "$RL_ALGORITHM" = opd ] && ARGS+=(--teacher-model "$TEACHER_MODEL")
  [ -n "${SEQ_LENGTH:-}" ] && ARGS+=(--seq-length "$SEQ_LENGTH")
  [ -n "${MAX_TURNS:-}" ] && ARGS+=(--max-turns "$MAX_TURNS")
  [ -n "${MAX_NEW_TOKENS:-}" ] && ARGS+=(--max-new-tokens "$MAX_NEW_TOKENS")
  [ -n "${TASK:-}" ] && ARGS+=(--task "$TASK")
  ARGS+=("${EXTRA[@]}")
}

# the job steps: the trainer (one task per trainer node) and, with ROLLOUT_NODES > 0, one task per rollout worker
tsync_steps() {
  TRAINER_STEP=(srun --overlap --nodes="$TRAINER_NODES" --nodelist="$TRAINER_NODELIST" --ntasks="$TRAINER_NODES"
    --ntasks-per-node=1 --kill-on-bad-exit=1 "${SRUN_CONTAINER[@]}"
    bash "$TSYNC_HOME/slurm/launch_node.sh" trainer "$PY" "${ARGS[@]}")
  ROLLOUT_STEP=()
  if [ "$ROLLOUT_NODES" -gt 0 ]; then
    # a worker that dies does not end the step (--kill-on-bad-exit=0): the trainer re-dispatches its work. The
    # workers ignore TERM/USR1/INT until the trainer closes the fleet, so a job-wide TERM leaves them serving the
    # trainer until it has saved. Output per worker where the trainer's supervisor reads it.
    ROLLOUT_STEP=(srun --overlap --nodes="$ROLLOUT_NODES" --nodelist="$ROLLOUT_NODELIST" --ntasks="$ROLLOUT_WORKERS"
      --kill-on-bad-exit=0 --output="$ROLLOUT_DIR/worker_logs/worker%t.log" "${SRUN_CONTAINER[@]}"
      bash "$TSYNC_HOME/slurm/launch_node.sh" rollout "$PY" "$ROLLOUT_DIR")
  fi
}

# ------------------------------------------------------------------------------------------------ report
tsync_wandb_line() {
  if [ -n "${WANDB_PROJECT:-}" ]; then
    echo "project $WANDB_PROJECT, run ${WANDB_EXP_NAME:-$RUN_NAME}, files ${WANDB_SAVE_DIR:-$SAVE/wandb}, mode ${WANDB_MODE:-online}"
  else
    echo "off (WANDB_PROJECT unset)"
  fi
}

tsync_report() {
  local v gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  echo "job $SLURM_JOB_ID on ${NODES[*]} (head $HEAD); restart ${SLURM_RESTART_COUNT:-0}; cpu mode $TSYNC_CPU"
  echo "run name $RUN_NAME"
  echo "checkpoints $SAVE (load $LOAD, latest step $START_STEP); keep last ${KEEP_LAST_CKPTS:-all}"
  echo "tensorboard $TENSORBOARD_DIR"
  echo "wandb $(tsync_wandb_line)"
  echo "logs: job ${JOB_LOG:-(sbatch --output)}, rollout workers $ROLLOUT_DIR/worker_logs, job dir $RUN_DIR"
  echo "stop: exit duration ${EXIT_DURATION_MINS:-off} min, requeue $( [ "$REQUEUE" = 0 ] && echo off || echo on)"
  echo "topology: cpus/node ${SLURM_CPUS_ON_NODE:-?}, visible GPUs ${gpus:-0}; trainer GPUs/node $TRAINER_GPUS, rollout GPUs ${ROLLOUT_GPUS:-none}"
  echo "trainer: $TRAINER_NODES node(s) × $NPROC_PER_NODE rank(s), TP=$TP PP=$PP, master $MASTER_ADDR:$MASTER_PORT"
  echo "rollout: $ROLLOUT_WORKERS worker(s), engine $ROLLOUT_ENGINE, $( [ "$ROLLOUT_NODES" -gt 0 ] && echo "on $ROLLOUT_NODELIST" || echo "started by the trainer on $HEAD")"
  echo "events $ENDPOINT, secret $SECRET_FILE"
  for v in "${TSYNC_PASS_VARS[@]}"; do
    [ -n "${!v:-}" ] && echo "env $v=${!v}"
  done
  [ -n "${CONTAINER_IMAGE:-}" ] && echo "container (pyxis) $CONTAINER_IMAGE"
  [ -n "${APPTAINER_IMAGE:-}" ] && echo "container (apptainer) $APPTAINER_IMAGE"
  printf 'trainer step:'; printf ' %q' "${TRAINER_STEP[@]}"; echo
  if [ "${#ROLLOUT_STEP[@]}" -gt 0 ]; then printf 'rollout step:'; printf ' %q' "${ROLLOUT_STEP[@]}"; echo; fi
  [ -n "$TSYNC_PY_PREFIX" ] && echo "python prefix: $TSYNC_PY_PREFIX"
  printf 'command: %s' "$PY"; printf ' %q' "${ARGS[@]}"; echo
}

# ------------------------------------------------------------------------------------------------ signals
STOP_SIG= PENDING_SIG= STOP_TIME_LEFT=
# USR1 (pre-timeout signal, `scancel --signal=USR1 --batch`), TERM (time limit, scancel, requeue, preemption), INT:
# the same signal goes to the trainer ranks (USR1: finish the step and save; TERM: save the last finished step).
tsync_on_signal() {
  tsync_log "got SIG$1: forwarding it to the trainer ranks (they save and exit)"
  if [ -z "$STOP_SIG" ] && [ "$1" = USR1 ]; then STOP_TIME_LEFT=$(tsync_time_left); fi
  STOP_SIG=$1 PENDING_SIG=$1
  tsync_forward
}

# seconds left before the job's time limit ('' when unknown or unlimited)
tsync_time_left() {
  local l d=0 h=0 m=0 s=0
  l=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n1) || return 0
  [[ $l =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 0
  d=${BASH_REMATCH[2]:-0} h=${BASH_REMATCH[4]:-0} m=${BASH_REMATCH[5]} s=${BASH_REMATCH[6]}
  echo $(( ((10#$d * 24 + 10#$h) * 60 + 10#$m) * 60 + 10#$s ))
}

# PENDING_SIG to every trainer rank (all nodes); retried every FORWARD_EVERY s until every rank has its handler
# installed — a signal that early would otherwise kill a rank that has not reached its training loop.
tsync_forward() {
  [ -n "$PENDING_SIG" ] || return 0
  local ok=0 sig=$PENDING_SIG
  if [ "$TRAINER_NODES" = 1 ]; then
    bash "$TSYNC_HOME/slurm/launch_node.sh" signal "$sig" "$PID_DIR" "$NPROC_PER_NODE" && ok=1
  elif [ "$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)" != RUNNING ]; then
    # the job is ending (time limit, scancel, requeue): no new job step can start, and SLURM signals every task
    tsync_log "job $SLURM_JOB_ID is ending: SLURM signals the trainer ranks itself (no SIG$sig forwarded)"
    PENDING_SIG=
    return 0
  else
    srun --overlap --nodes="$TRAINER_NODES" --nodelist="$TRAINER_NODELIST" --ntasks-per-node=1 \
      bash "$TSYNC_HOME/slurm/launch_node.sh" signal "$sig" "$PID_DIR" "$NPROC_PER_NODE" && ok=1
  fi
  if [ "$ok" = 1 ]; then
    [ "$PENDING_SIG" = "$sig" ] && PENDING_SIG=
    tsync_log "sent SIG$sig to the trainer ranks"
  fi
}

# ------------------------------------------------------------------------------------------------ after the step
# field of $SAVE/tsync_stop.json (written by trainer rank 0 after its final checkpoint)
tsync_stop_field() {
  grep -o "\"$1\"[[:space:]]*:[[:space:]]*\(\"[^\"]*\"\|[a-z0-9.]*\)" "$SAVE/tsync_stop.json" 2>/dev/null \
    | head -n1 | sed 's/^[^:]*:[[:space:]]*//; s/"//g'
}

tsync_failure_summary() {
  local rc=$1 f
  tsync_log "trainer step failed (exit code $rc). Logs: trainer above in ${JOB_LOG:-this job log}; rollout workers in $ROLLOUT_DIR/worker_logs/"
  for f in "$ROLLOUT_DIR"/worker_logs/*.log; do
    [ -s "$f" ] || continue
    echo "    ==> $f (last 15 lines) <=="
    tail -n 15 "$f" | sed 's/^/    /'
  done
}

# requeue when the trainer stopped unfinished on its time budget or SLURM's pre-timeout USR1, and made progress
tsync_maybe_requeue() {
  local finished reason step
  [ -f "$SAVE/tsync_stop.json" ] || { tsync_log "no $SAVE/tsync_stop.json: not requeueing"; return 1; }
  finished=$(tsync_stop_field finished) reason=$(tsync_stop_field reason) step=$(tsync_stop_field step)
  tsync_log "trainer stop: finished=$finished reason=$reason step=$step"
  [ "$finished" = false ] || return 1
  if [ "$REQUEUE" = 0 ]; then
    tsync_log "REQUEUE=0: not requeueing; resubmit the same command to resume from $SAVE at step $step"; return 1
  fi
  case $reason in
    exit-duration) ;;
    SIGUSR1)
      if [ -z "$STOP_TIME_LEFT" ] || [ "$STOP_TIME_LEFT" -gt "$REQUEUE_SIGNAL_WINDOW" ]; then
        tsync_log "SIGUSR1 with ${STOP_TIME_LEFT:-unlimited} s of the time limit left: a manual stop, not requeued"
        return 1
      fi ;;
    *) tsync_log "stopped by $reason (scancel, time limit, requeue or preemption): not requeued by this script; resubmit to resume from $SAVE at step $step"
       return 1 ;;
  esac
  if [ "$step" = "$START_STEP" ]; then
    tsync_log "no progress in this allocation (still step $step): not requeueing"; return 1
  fi
  tsync_log "requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 ))): it resumes from $SAVE at step $step"
  scontrol requeue "$SLURM_JOB_ID" || { tsync_log "scontrol requeue failed: resubmit to resume"; return 1; }
  return 0
}

# ------------------------------------------------------------------------------------------------ main
tsync_main() {
  EXTRA=()
  if [ -n "${EXTRA_ARGS:-}" ]; then read -r -a EXTRA <<<"$EXTRA_ARGS"; fi
  EXTRA+=("$@")
  REPLAY=0
  case " ${EXTRA[*]:-} " in *" --replay-rollouts"*) REPLAY=1 ;; esac
  tsync_env_setup
  tsync_config
  tsync_check_layout
  if [ "$RL_ALGORITHM" = opd ]; then
    if [ "$TSYNC_CPU" = 1 ]; then TEACHER_MODEL=${TEACHER_MODEL:-$TSYNC_RUNS/tiny-teacher}; fi
    [ -n "${TEACHER_MODEL:-}" ] || tsync_die "TEACHER_MODEL=<Hugging Face folder> is required for train_opd.sh"
  fi
  tsync_derive
  tsync_containers
  tsync_trainer_args
  tsync_steps
  local v
  for v in "${TSYNC_PASS_VARS[@]}"; do [ -z "${!v:-}" ] || export "${v?}"; done
  if [ "$DRY_RUN" = 1 ]; then
    tsync_report | sed 's/^/[tsync-slurm] dry run: /'
    return 0
  fi
  if [ "$RL_ALGORITHM" = opd ]; then
    tsync_py -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron_tsync.runtime.opd') is None)" \
      || tsync_die "OPD trainer not available in this megatron_tsync (megatron_tsync.runtime.opd is missing)"
  fi
  tsync_make_run_dir
  tsync_prepare_models
  tsync_report | tee "$RUN_DIR/launch.txt" | sed 's/^/[tsync-slurm] /'
  tsync_run
}

tsync_run() {
  export TRAINER_NODES NPROC_PER_NODE PID_DIR
  trap 'tsync_on_signal USR1' USR1
  trap 'tsync_on_signal TERM' TERM
  trap 'tsync_on_signal INT' INT
  "${TRAINER_STEP[@]}" &
  local step_pid=$! rc=0 rollout_pid=
  if [ "${#ROLLOUT_STEP[@]}" -gt 0 ]; then
    mkdir -p "$ROLLOUT_DIR/worker_logs"
    TSYNC_CPU=$TSYNC_CPU ROLLOUT_GPUS_PER_WORKER=$ROLLOUT_GPUS_PER_WORKER "${ROLLOUT_STEP[@]}" \
      >"$RUN_DIR/rollout_step.log" 2>&1 &
    rollout_pid=$!
    tsync_log "rollout workers: $ROLLOUT_WORKERS task(s) on $ROLLOUT_NODELIST (logs $ROLLOUT_DIR/worker_logs/)"
  fi
  # bash runs a trap only between commands: wait in short slices so a signal is handled at once
  while kill -0 "$step_pid" 2>/dev/null; do
    sleep "$FORWARD_EVERY" &
    wait $! 2>/dev/null || true
    if [ -n "$PENDING_SIG" ]; then tsync_forward; fi
  done
  wait "$step_pid" || rc=$?
  if [ "$rc" != 0 ] && [ -n "$STOP_SIG" ] && [ "$((TRAINER_NODES * NPROC_PER_NODE))" -gt 1 ] \
     && [ "$(tsync_stop_field finished)" = false ]; then
    # torchrun exits non-zero when it is signalled itself (a job-wide TERM), even when every rank saved and exited 0
    tsync_log "launcher exit code $rc after SIG$STOP_SIG, but the trainer saved (tsync_stop.json): counting it as 0"
    rc=0
  fi
  case $ENDPOINT in ipc:///tmp/tsync-"$SLURM_JOB_ID"-events.sock) rm -f "${ENDPOINT#ipc://}" ;; esac
  local latest
  latest=$(cat "$SAVE/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  tsync_log "trainer exited with code $rc; latest checkpoint step: $latest"
  if [ "$rc" != 0 ]; then
    tsync_failure_summary "$rc"
  elif tsync_maybe_requeue; then
    return 0
  fi
  [ -z "$rollout_pid" ] || kill "$rollout_pid" 2>/dev/null || true
  return "$rc"
}
