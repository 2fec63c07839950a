"""The environment of a rollout worker process: no launcher rendezvous, its own GPUs.

A rollout worker is a single-process program, never a member of the trainer's process group. Whatever launched the
trainer (torchrun, srun) leaves its task's rank and count in the environment; a worker that inherits them believes
it is task ``SLURM_PROCID`` of ``SLURM_NTASKS`` (the embedded engine with several workers hung on it).
:func:`scrub_launcher_env` removes them: the fleet applies it to every worker it spawns, and the worker entry
(``python -m megatron_tsync.runtime.worker``) applies it to itself first thing, so a worker that srun starts on a
rollout node is scrubbed as well.

GPU placement on one node (``--rollout-gpus LIST``): worker ``w`` that the trainer spawns gets
``CUDA_VISIBLE_DEVICES`` = its ``--rollout-tensor-parallel-size`` GPUs of the list, in order
(:func:`worker_gpus`); the trainer's own GPUs on this node (:func:`trainer_gpus`: the first ``LOCAL_WORLD_SIZE``
devices of the trainer's ``CUDA_VISIBLE_DEVICES``, or 0.. without it; none on a machine without CUDA) must not
overlap them (:func:`check_gpu_placement`, at start-up). GPU ids are in the namespace of the trainer's environment
(what ``CUDA_VISIBLE_DEVICES`` means for the job).
"""

from __future__ import annotations

import os

SCRUBBED_EXACT = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
})
"""Launcher variables a worker must not see: torchrun's rendezvous and SLURM's task rank / count."""
SCRUBBED_PREFIXES = ("SLURM_STEP_", "PMI_", "PMIX_", "OMPI_COMM_WORLD_", "TORCHELASTIC_")


class PlacementError(ValueError):
    """Trainer and rollout GPUs overlap, or ``--rollout-gpus`` cannot give every worker its GPUs."""


def scrub_launcher_env(env: dict) -> list[str]:
    """Removes the launcher's task variables from ``env`` (a dict, or ``os.environ``) in place; returns their names."""
    gone = sorted(k for k in env if k in SCRUBBED_EXACT or k.startswith(SCRUBBED_PREFIXES))
    for k in gone:
        env.pop(k)
    return gone


def parse_gpu_list(text: str, flag: str = "--rollout-gpus") -> tuple[int, ...]:
    """``"4,5,6,7"`` or ``"4-7"`` → (4, 5, 6, 7): distinct non-negative ids, in the order given."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise PlacementError(f"{flag} {text!r}: {part!r} is not a GPU id or range (e.g. 4,5,6,7 or 4-7)")
        ids = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        if sep and int(hi) < int(lo):
            raise PlacementError(f"{flag} {text!r}: empty range {part!r}")
        out += ids
    if len(set(out)) != len(out):
        raise PlacementError(f"{flag} {text!r}: a GPU is named twice")
    return tuple(out)


def worker_gpus(rollout_cfg, worker_id: int) -> tuple[int, ...] | None:
    """The GPUs of worker ``worker_id`` (``--rollout-tensor-parallel-size`` of ``--rollout-gpus``, in order), or
    None without the flag (the worker inherits the trainer's devices)."""
    if rollout_cfg.gpus is None:
        return None
    gpus = parse_gpu_list(rollout_cfg.gpus)
    per, n = rollout_cfg.engine_tensor_parallel_size, rollout_cfg.num_workers
    if len(gpus) < per * n:
        raise PlacementError(f"--rollout-gpus {rollout_cfg.gpus}: {len(gpus)} GPU(s) for {n} worker(s) × "
                             f"--rollout-tensor-parallel-size {per} = {per * n}")
    return gpus[worker_id * per:(worker_id + 1) * per]


def trainer_gpus(env=None, *, cuda: bool) -> tuple[int, ...]:
    """The GPUs the trainer ranks of this node use: cuda:LOCAL_RANK for LOCAL_RANK < LOCAL_WORLD_SIZE, mapped through
    the trainer's ``CUDA_VISIBLE_DEVICES``; () without CUDA."""
    if not cuda:
        return ()
    env = os.environ if env is None else env
    n = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return tuple(range(n))
    ids = parse_gpu_list(visible, "CUDA_VISIBLE_DEVICES")
    return ids[:n]


def check_gpu_placement(cfg, env=None, *, cuda: bool) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """At start-up: every worker gets its GPUs and none is a trainer's. Returns (trainer GPUs, rollout GPUs), or None
    without ``--rollout-gpus``; :class:`PlacementError` names the overlap."""
    ro = cfg.rollout
    if ro.gpus is None:
        return None
    rollout = tuple(g for w in range(ro.num_workers) for g in worker_gpus(ro, w))
    trainer = trainer_gpus(env, cuda=cuda)
    both = sorted(set(trainer) & set(rollout))
    if both:
        raise PlacementError(f"--rollout-gpus {ro.gpus} overlaps the trainer's GPUs {list(trainer)} on {both} "
                             "(the trainer ranks of this node use cuda:LOCAL_RANK of CUDA_VISIBLE_DEVICES): give the "
                             "rollout workers other GPUs, or start the trainer with CUDA_VISIBLE_DEVICES set to "
                             "its own")
    return trainer, rollout


def worker_process_env(base: dict, rollout_cfg, worker_id: int) -> dict:
    """The environment of worker ``worker_id`` that the trainer spawns: ``base`` scrubbed, ``CUDA_VISIBLE_DEVICES``
    set from ``--rollout-gpus`` when given."""
    env = dict(base)
    scrub_launcher_env(env)
    gpus = worker_gpus(rollout_cfg, worker_id)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env
