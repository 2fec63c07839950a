#!/usr/bin/env bash
# megatron_tsync streaming GRPO as one SLURM job: a Megatron trainer and its rollout workers.
#
#   sbatch slurm/train_grpo.sh                                    # from the repository root; MODEL is required
#   sbatch --export=ALL,MODEL=/ckpt/qwen2-7b,TRAIN_ITERS=2000 slurm/train_grpo.sh --lr 1e-6
#   sbatch --gpus-per-node=0 --export=ALL,TSYNC_CPU=1 slurm/train_grpo.sh     # CPU smoke run, tiny model
#   sbatch slurm/train_grpo.sh                                    # again: resumes from $SAVE's latest checkpoint
#
# Cluster layout (GPU mode, the default): the allocation's first TRAINER_NODES nodes run the trainer — one srun task
# per node, torchrun --nproc_per_node=$NPROC_PER_NODE (one rank per GPU, NCCL), static rendezvous at the first node.
# The trainer starts ROLLOUT_WORKERS rollout worker processes itself (--rollout-engine vllm on GPUs) on the trainer's
# head node, on GPUs disjoint from its own (TRAINER_GPUS: default half of the node; ROLLOUT_GPUS: the rest); they stream signed trajectory events to the trainer over $ENDPOINT (ipc:// on one node, tcp://HEAD:PORT
# on several) and read each policy version from $SAVE/slurm-jobs/$JOBID/rollout_plane/weights. SAVE must be on a filesystem every node
# sees. The job needs a python with megatron_tsync installed on every node (activate the venv/container before
# sbatch: the environment is exported, or set TSYNC_PYTHON).
#
# Limits of the trainer today (the script says so rather than pretend):
#   * ROLLOUT_NODES > 0: the trainer runs with --rollout-launch external and writes the worker specs, the secret and
#     each weight version to $SAVE/slurm-jobs/$JOBID/rollout_plane (shared filesystem); ROLLOUT_WORKERS tasks of
#     `python -m megatron_tsync.runtime.worker SPEC` run as a second job step on the rollout nodes and connect over
#     tcp. Tested on a 2-node cluster on one machine (tests/slurm/test_two_nodes.py), not on separate machines.
#   * Several trainer ranks with live rollouts: global rank 0 owns the event receiver and broadcasts what lands.
# TSYNC_CPU=1 (CPU mode): no GPUs (CUDA hidden, gloo, embedded engine), one trainer process, tiny model at MODEL if
# missing, small defaults (4 steps, group 2, batch 4). Clusters without GPU GRES: add --gpus-per-node=0.
#
# Run: RUN_NAME (default the job name, + _TASKID in an array), SAVE=$TSYNC_RUNS/$RUN_NAME, per-job files in
# $SAVE/slurm-jobs/$SLURM_JOB_ID. Stopping: every stop saves the last finished step and writes $SAVE/tsync_stop.json.
# EXIT_DURATION_MINS (or SLURM's pre-timeout USR1, --signal=B:USR1@300) → save and requeue this job itself
# (REQUEUE=0: off); time limit, scancel, scontrol requeue, preemption (SIGTERM) → save the last finished step; the
# rollout workers ignore those signals until the trainer has saved. `scancel --signal=USR1 --batch JOBID` stops by
# hand (finish the step, save; not requeued). LOAD=SAVE: resubmitting continues at "[tsync] resumed from SAVE at
# step K". TSYNC_DRY_RUN=1 prints the commands and exits. See slurm/README.md.
#
# All variables (defaults per mode) are listed in slurm/common.sh; the job's exit code is the trainer's.
#SBATCH --job-name=tsync-grpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
set -euo pipefail

# sbatch runs a copy of this file: find the repository from the submitted path, else the submit dir
if [ -z "${TSYNC_HOME:-}" ]; then
  _cmd=
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    _cmd=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'Command=[^ ]*' | cut -d= -f2- || true)
  fi
  if [ -n "$_cmd" ] && [ -f "$(dirname "$_cmd")/common.sh" ]; then
    TSYNC_HOME=$(cd "$(dirname "$_cmd")/.." && pwd)
  elif [ -f "${SLURM_SUBMIT_DIR:-.}/slurm/common.sh" ]; then
    TSYNC_HOME=$(cd "${SLURM_SUBMIT_DIR:-.}" && pwd)
  else
    echo "[tsync-slurm] error: cannot find slurm/common.sh; set TSYNC_HOME=<repository root>" >&2
    exit 2
  fi
fi
export TSYNC_HOME
RL_ALGORITHM=grpo
# shellcheck source=slurm/common.sh
source "$TSYNC_HOME/slurm/common.sh"
tsync_main "$@"
