"""Weights & Biases next to TensorBoard (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``).

The logging rank logs the same scalars as TensorBoard (``RunContext.write_scalars``: each row's keys under their
TensorBoard tags, at the step) plus the whole ``TrainConfig`` as the run's config. ``wandb`` is imported only when
``--wandb-project`` is given.

Mode: ``WANDB_MODE`` when set (``offline``, ``online``, ``disabled``) is honoured; otherwise the run is offline unless
``WANDB_API_KEY`` is set. So a cluster node without network (or without credentials) never blocks on a login prompt
or a connection: the run folder is written under the save directory and can be uploaded later with
``wandb sync DIR/wandb/offline-run-*``. A requeued job continues the same W&B run: its id is kept in
``WANDB_SAVE_DIR/wandb_run_id`` (``resume="allow"``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets

log = logging.getLogger("megatron_tsync")


def wandb_mode(env=None) -> str:
    env = os.environ if env is None else env
    return env.get("WANDB_MODE") or ("online" if env.get("WANDB_API_KEY") else "offline")


def save_dir(cfg) -> str:
    lc = cfg.logging
    return lc.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else "wandb")


class WandbRun:
    """One W&B run of this trainer: ``log(row, names, step)``, ``close()``."""

    def __init__(self, cfg):
        import wandb  # only with --wandb-project

        lc = cfg.logging
        self.dir = save_dir(cfg)
        os.makedirs(self.dir, exist_ok=True)
        id_path = os.path.join(self.dir, "wandb_run_id")  # a requeued job continues the same W&B run
        run_id = open(id_path).read().strip() if os.path.exists(id_path) else secrets.token_hex(8)
        with open(id_path, "w") as f:
            f.write(run_id)
        self.mode = wandb_mode()
        self.run = wandb.init(project=lc.wandb_project, name=lc.wandb_exp_name, dir=self.dir, mode=self.mode,
                              id=run_id, resume="allow", config=dataclasses.asdict(cfg))
        print(f"[tsync] W&B: project {lc.wandb_project}, run {self.run.name or run_id} ({self.mode}) in {self.dir}",
              flush=True)

    def log(self, row: dict, names: dict[str, str], step: int) -> None:
        data = {tag: row[key] for key, tag in names.items() if row.get(key) is not None}
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def open_run(cfg) -> WandbRun:
    return WandbRun(cfg)
