"""Where a process sits in its launch, read from the launcher's variables alone (standard library only: the
pre-flight checks use it before torch.distributed, ``model/parallel.py`` to initialise it)."""

from __future__ import annotations

import os


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or srun (SLURM_*); (0, 1, 0)
    without a launcher."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0
