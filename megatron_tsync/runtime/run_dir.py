"""One run per ``--save`` folder, and never another experiment's checkpoint resumed silently.

- :class:`RunLock`: trainer rank 0 holds an exclusive ``fcntl.flock`` on ``SAVE/.tsync.lock`` for the whole run
  (the file says pid, host and ``SLURM_JOB_ID``); a second trainer on the same folder fails at once naming the
  holder. The lock goes with the process (the kernel drops it when the process dies, even by SIGKILL), so a stale
  file never blocks a restart.
- :func:`clean_stale`: ``iter_*.tmp`` folders of a save that was killed are removed at the start (rank 0, under the
  lock, so never another trainer's save in progress), and a checkpoint left as ``iter_*.old`` by a kill in the
  middle of re-saving the same step is put back.
- :func:`run_config` / :func:`config_diff`: the run-defining configuration (``RUN_FIELDS``) is saved with every
  checkpoint (trainer state ``run_config``) and compared on a resume: a difference is an error listing each field
  (old → new), unless ``--override-loaded-config`` (a warning per field). Parallel sizes are not compared: a
  checkpoint reshards on load, so a requeued job may resume on another layout. ``train_iters``, intervals,
  directories and the time budget are not run-defining either.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket

log = logging.getLogger("megatron_tsync")

LOCK_FILE = ".tsync.lock"
RUN_FIELDS = (
    "model.path", "model.ref_model", "rollout.task", "rollout.teacher_model", "rl.algorithm", "rl.opd_objective",
    "learner.mode", "learner.estimator", "learner.loss.aggregation", "learner.loss.kl_mode", "learner.loss.kl_coef",
    "rl.group_size", "rl.groups_per_step", "optim.optimizer", "optim.lr", "rl.seed", "precision.params_dtype",
    "precision.bf16", "precision.fp8_format",
)
"""The configuration fields that define an experiment (``TrainConfig`` paths)."""


class RunLocked(RuntimeError):
    """Another trainer holds the ``--save`` folder."""


class ConfigMismatch(ValueError):
    """The checkpoint to resume is of another experiment (its run-defining config differs)."""


class RunLock:
    """``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``DIR/.tsync.lock``, held until :meth:`release` or process exit."""

    def __init__(self, save_dir: str):
        os.makedirs(save_dir, exist_ok=True)
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "(unknown)"
            os.close(self.fd)
            raise RunLocked(f"--save {save_dir} is in use by another trainer ({self.path}: {holder}); two runs must "
                            "not share a checkpoint folder: give this run its own --save (run name)") from None
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(),
                       "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.holder).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


def clean_stale(save_dir: str) -> list[str]:
    """Removes ``iter_*.tmp`` folders of ``save_dir`` and of its ``reference/`` (a killed save's); restores an
    ``iter_X.old`` whose ``iter_X`` is missing. Returns what it removed (and logs it)."""
    removed = []
    for root in (save_dir, os.path.join(save_dir, "reference")):
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith("iter_") and name.endswith(".old"):
                final = path[:-len(".old")]
                if not os.path.exists(final):
                    os.replace(path, final)
                    print(f"[tsync] restored {final} from {name} (a save of that step was interrupted)", flush=True)
                else:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            elif name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        print(f"[tsync] removed {len(removed)} incomplete checkpoint folder(s) of an interrupted save: "
              f"{', '.join(removed)}", flush=True)
    return removed


def _get(cfg, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def run_config(cfg) -> dict:
    """The run-defining fields of ``cfg`` (JSON values; ``model.path`` made absolute)."""
    out = {}
    for path in RUN_FIELDS:
        v = _get(cfg, path)
        if path == "model.path" and v is not None:
            v = os.path.abspath(v)
        out[path] = list(v) if isinstance(v, tuple) else v
    return json.loads(json.dumps(out, default=str))


def config_diff(old: dict, new: dict) -> list[str]:
    """``"field: old → new"`` for every run-defining field that differs (fields the old run did not record are
    skipped: a checkpoint of an older version)."""
    return [f"{k}: {old[k]!r} → {new[k]!r}" for k in new if k in old and old[k] != new[k]]


def check_resume(saved: dict | None, cfg, load_dir: str) -> None:
    """On a resume: the checkpoint's run-defining config against this run's (error, or warnings with
    ``--override-loaded-config``)."""
    if saved is None:
        log.warning("--load %s: the checkpoint records no run configuration (an older version): not compared",
                    load_dir)
        return
    diff = config_diff(saved, run_config(cfg))
    if not diff:
        return
    if cfg.checkpoint.override_loaded_config:
        for d in diff:
            log.warning("--override-loaded-config: resuming %s with a different %s", load_dir, d)
        return
    raise ConfigMismatch(f"--load {load_dir}: the checkpoint is of another experiment; its run-defining config differs "
                     f"from this run's in {len(diff)} field(s): " + "; ".join(diff)
                     + ". Use a new --save/--load (run name) for a new experiment, or pass --override-loaded-config")


def claim(cfg, rank: int, world_size: int) -> RunLock | None:
    """Collective, right after the process groups exist: rank 0 takes the ``--save`` lock, removes stale ``.tmp``
    folders and the previous stop record; every rank raises :class:`RunLocked` if the lock is held elsewhere."""
    from megatron_tsync.runtime.stop import clear_stop_file

    save = cfg.checkpoint.save
    lock, err = None, None
    if rank == 0 and save:
        try:
            lock = RunLock(save)
            clean_stale(save)
            clear_stop_file(save)
        except RunLocked as e:
            err = str(e)
    if world_size > 1:
        import torch.distributed as dist

        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    if err is not None:
        raise RunLocked(err)
    return lock

