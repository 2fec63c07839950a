"""The environment and topology of a run, printed once at start-up by the logging rank (one block in the job log):
host, package versions, world size and layout, devices, the SLURM job, NCCL / GLOO variables, and where the
checkpoints, TensorBoard events, W&B run and rollout plane go."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata

PACKAGES = ("torch", "megatron-core", "transformers", "transformer-engine", "vllm", "wandb")
ENV_PREFIXES = ("NCCL_", "GLOO_")


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "-"


def _where(cfg) -> list[str]:
    from megatron_tsync.runtime import wandb_log

    ck, lg, ro = cfg.checkpoint, cfg.logging, cfg.rollout
    save = os.path.abspath(ck.save) if ck.save else "not saved (no --save)"
    lines = [f"checkpoints: {save}" + (f" (resume from {os.path.abspath(ck.load)})" if ck.load else ""),
             f"tensorboard: {os.path.abspath(lg.tensorboard_dir) if lg.tensorboard_dir else 'off'}"]
    if lg.wandb_project:
        lines.append(f"wandb: project {lg.wandb_project}, {wandb_log.wandb_mode()}, "
                     f"{os.path.abspath(wandb_log.save_dir(cfg))}")
    else:
        lines.append("wandb: off")
    if not lg.replay_rollouts and ro.num_workers:
        plane = ro.run_dir or os.path.join(ck.save or os.path.join("runs", "tsync"), "rollout_plane")
        lines.append(f"rollout plane: {os.path.abspath(plane)} ({ro.num_workers} worker(s), {ro.launch}, engine "
                     f"{ro.engine}, logs in {os.path.join(os.path.abspath(plane), 'worker_logs')})")
    return lines


def report(cfg, dims, env=None) -> str:
    """The block, as text (each line prefixed ``[tsync] env:``)."""
    env = os.environ if env is None else env
    versions = ", ".join(f"{p} {_version(p)}" for p in PACKAGES)
    nets = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(ENV_PREFIXES)) or "(none)"
    lines = [
        f"host {socket.gethostname()}, python {platform.python_version()}, {versions}",
        f"world size {dims.world_size}: TP {dims.tp}, PP {dims.pp}, DP {dims.dp}, CP {dims.cp}, EP {dims.ep} "
        f"(backend {dims.backend})",
        f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(unset)')}; rollout GPUs "
        f"{cfg.rollout.gpus or '(inherited)'}",
        f"SLURM_JOB_ID={env.get('SLURM_JOB_ID', '-')} SLURM_JOB_NODELIST="
        f"{env.get('SLURM_JOB_NODELIST', env.get('SLURM_NODELIST', '-'))}",
        f"network: {nets}",
        *_where(cfg),
    ]
    return "\n".join(f"[tsync] env: {line}" for line in lines)


def print_report(cfg, dims) -> None:
    if dims.is_logging_rank:
        print(report(cfg, dims), flush=True)
