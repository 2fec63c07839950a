"""Training checkpoints: megatron-core ``dist_checkpointing`` (torch_dist) for model and optimizer, plus RNG
states, the step counter and a JSON trainer state. Resume is bitwise: the steps after a resume equal those of
an uninterrupted run (tested with Adam in fp32).

Layout (Megatron-LM's convention)::

    DIR/latest_checkpointed_iteration.txt      the newest complete step, e.g. "7"
    DIR/iter_0000007/                          dist_checkpointing files (metadata.json, common.pt, *.distcp)
        tsync_meta.json                        step, trainer_state, arch, layout at save time
        rng/rank_00000.pt                      per-rank RNG states (torch CPU/CUDA, python, numpy, megatron tracker)
        tsync_checksums.json                   size + SHA-256 of every file above (``ckpt_integrity``), verified
                                               before a load; ``fallback`` loads the newest older one that verifies
    DIR/hf_assets/                             optional: config.json + tokenizer files (for export to HF)

A save writes ``iter_XXXXXXX.tmp`` first, renames it when every rank has finished, and only then rewrites the
tracker file (atomically), so a process killed mid-save leaves the previous checkpoint as the latest; a save that
fails (a full disk: reported as such) removes its ``.tmp`` and leaves the tracker alone. ``keep_last`` deletes all but
the newest N checkpoints after a save.
``dist_checkpointing`` reshards on load: a checkpoint saved at one TP/PP/DP layout loads at another (model and,
for the non-distributed optimizer, optimizer state). RNG states are restored only when the world size matches
(a different layout cannot resume bitwise anyway); a warning says so otherwise.

All functions are collective over the default process group: every rank calls them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_tsync.model import compat
from megatron_tsync.model.builder import ModelArch, unwrap
from megatron_tsync.training.ckpt_integrity import (
    CheckpointCorrupt,
    CheckpointSaveError,
    disk_full,
    free_bytes,
    verify,
    write_manifest,
)
from megatron_tsync.training.writer_shield import start_shielded

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
META = "tsync_meta.json"
HF_ASSETS = "hf_assets"
FORMAT_VERSION = 2  # 2: a checksum manifest (ckpt_integrity.MANIFEST) in every checkpoint


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_step(root: str) -> int | None:
    """The step named by ``root/latest_checkpointed_iteration.txt``, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def read_meta(root: str, step: int | None = None) -> dict:
    """``tsync_meta.json`` of a checkpoint (step, trainer_state, arch, layout)."""
    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {root}")
    return _read_meta_file(iter_dir(root, step))


def arch_from_checkpoint(root: str, step: int | None = None) -> ModelArch:
    meta = read_meta(root, step)
    if not meta.get("arch"):
        raise ValueError(f"checkpoint {root} records no model architecture")
    return ModelArch(**meta["arch"])


# --------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This rank's random states: torch CPU (and CUDA), python, numpy, megatron's model-parallel tracker."""
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": {k: v.clone() for k, v in compat.rng_tracker_states().items()},
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    compat.set_rng_tracker_states(state["tracker"])
    if torch.cuda.is_available() and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])


def _rng_path(d: str, rank: int) -> str:
    return os.path.join(d, "rng", f"rank_{rank:05d}.pt")


# --------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_hf_assets(src: str, root: str) -> None:
    from megatron_tsync.model.hf_conversion import TOKENIZER_FILES

    dst = os.path.join(root, HF_ASSETS)
    os.makedirs(dst, exist_ok=True)
    for fn in ("config.json",) + TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, fn)):
            shutil.copyfile(os.path.join(src, fn), os.path.join(dst, fn))


def _any_failed(exc: BaseException | None, probe_dir: str) -> tuple[str, bool] | None:
    """Collective: ``None`` when no rank failed, else (the first failing rank's message, whether a disk was full)."""
    lines = str(exc).strip().splitlines()
    mine = None if exc is None else (f"{type(exc).__name__}: {lines[-1] if lines else ''}", disk_full(exc, probe_dir))
    world = dist.get_world_size()
    if world == 1:
        return mine
    every = [None] * world
    dist.all_gather_object(every, mine)
    failed = [m for m in every if m is not None]
    return None if not failed else (failed[0][0], any(f[1] for f in failed))


def _save_failed(save_dir: str, step: int, tmp: str, why: tuple[str, bool]) -> CheckpointSaveError:
    msg, full = why
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    prev = latest_step(save_dir) if os.path.exists(os.path.join(save_dir, TRACKER)) else None
    kept = f"the latest checkpoint is still step {prev}" if prev is not None else "no earlier checkpoint exists"
    if full:
        free = free_bytes(save_dir)
        return CheckpointSaveError(f"no space left on device while saving step {step} to {iter_dir(save_dir, step)} "
                                   f"({free} bytes free on that filesystem after removing the partial save): {kept}. "
                                   f"Free space or pass --keep-last-checkpoints N. Cause: {msg}", disk_full=True)
    return CheckpointSaveError(f"saving step {step} to {iter_dir(save_dir, step)} failed ({msg}); the partial save "
                               f"was removed and {kept}", disk_full=False)


def _attempt(fn) -> BaseException | None:
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # reported collectively by _any_failed (torch's CheckpointException is a
        return exc  # BaseException)
    return None


_writer_manager = None


def shield_checkpoint_writer() -> bool:
    """megatron-core's torch_dist save collects its write results through a ``multiprocessing`` manager, a spawned
    server process started at the first save (``filesystem_async._get_write_results_queue``). A job-wide SIGTERM
    (SLURM time-out, ``scancel``) killed it, and the save made on that signal failed with BrokenPipeError. This
    starts that manager once, ourselves, shielded from its first instruction (:func:`.writer_shield.start_shielded`),
    and hands its queue to megatron; a training run calls it at start-up (``runtime/context.py``), long before any
    stop signal, and every save again (a no-op once started). (The write processes megatron forks per save inherit the trainer's handlers:
    they only set the stop flag.) False when this megatron-core has no such queue (nothing to shield)."""
    global _writer_manager
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return False
    if not hasattr(fa, "_results_queue"):
        return False
    if fa._results_queue is None:
        import multiprocessing.managers as mpm

        from torch import multiprocessing as mp

        _writer_manager = mpm.SyncManager(ctx=mp.get_context("spawn"))
        start_shielded(_writer_manager)
        fa._results_queue = _writer_manager.Queue()
    return True


def save_checkpoint(
    save_dir: str,
    step: int,
    ddp_model,
    optimizer=None,
    trainer_state: dict | None = None,
    *,
    hf_assets_src: str | None = None,
    optim_sharding: str = "dp_reshardable",
    keep_last: int | None = None,
) -> str:
    """Save model (+ optimizer when given), RNG states, ``step`` and ``trainer_state`` (JSON-able) to
    ``save_dir/iter_{step:07d}``; returns that path. Collective. ``hf_assets_src``: an HF folder whose
    config.json and tokenizer files are copied to ``save_dir/hf_assets`` (used by the HF export).
    ``optim_sharding``: the distributed optimizer's format (megatron's ``distrib_optim_sharding_type``):
    "dp_reshardable" (default, Megatron-LM's; fully parallel, reshards over DP only) or "fully_reshardable"
    (loads at any TP/PP/DP; gathers the optimizer state on DP rank 0 while saving). Ignored by the plain
    optimizer, whose state always reshards. Resume is bitwise (tested: 1 process, TP=2, DP=2 with the distributed
    optimizer in both formats; megatron-core 0.16 fixes for torch Adam are in ``compat``).

    Every file written is checksummed (``ckpt_integrity``). A failure on any rank raises
    :class:`CheckpointSaveError` on every rank (saying "no space left on device" when that was the cause) after the
    partial save is removed; the previous checkpoint stays the latest. ``keep_last``: afterwards, delete all but the
    newest ``keep_last`` checkpoints of ``save_dir``."""
    rank = dist.get_rank()
    shield_checkpoint_writer()
    final = iter_dir(save_dir, step)
    tmp = final + ".tmp"
    state_json = json.dumps(trainer_state or {})  # fail early, on every rank, if it is not JSON-able
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)  # must be empty for dist_checkpointing
    dist.barrier()
    model = unwrap(ddp_model)
    rng = rng_state()  # before anything below could draw random numbers

    def write_shards():
        sd = {"model": model.sharded_state_dict()}
        if optimizer is not None:
            sd["optimizer"] = optimizer.sharded_state_dict(
                sd["model"], metadata={"distrib_optim_sharding_type": optim_sharding}
            )
        compat.dist_checkpointing_save(sd, tmp)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng, _rng_path(tmp, rank))

    def write_meta():
        if rank != 0:
            return
        arch = getattr(model, "arch", None)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "trainer_state": json.loads(state_json),
            "arch": dataclasses.asdict(arch) if arch is not None else None,
            "params_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "has_optimizer": optimizer is not None,
            "optim_sharding": optim_sharding,
            "layout": _layout(),
            "megatron_core": ".".join(map(str, compat.megatron_core_version())),
        }
        _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=2))

    for part in (write_shards, write_meta, lambda: write_manifest(tmp), lambda: _publish(save_dir, step, tmp,
                                                                                          hf_assets_src)):
        why = _any_failed(_attempt(part), tmp if os.path.isdir(tmp) else save_dir)
        if why is not None:
            raise _save_failed(save_dir, step, tmp, why)
    if rank == 0 and keep_last is not None:
        try:
            prune(save_dir, keep_last)
        except OSError as exc:  # the new checkpoint is complete: a failed clean-up must not stop the run
            log.warning("--keep-last-checkpoints: could not delete old checkpoints of %s: %s", save_dir, exc)
    dist.barrier()
    return final


def _publish(save_dir: str, step: int, tmp: str, hf_assets_src: str | None) -> None:
    """Rank 0: the complete ``tmp`` becomes ``iter_{step}``, then the tracker names it (atomically)."""
    if dist.get_rank() != 0:
        return
    final = iter_dir(save_dir, step)
    if hf_assets_src:
        _copy_hf_assets(hf_assets_src, save_dir)
    if os.path.exists(final):  # re-saving a step: the old copy goes only once the new one is complete
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _write_atomic(os.path.join(save_dir, TRACKER), str(step))


def saved_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints in ``root`` (``iter_XXXXXXX`` directories with a ``tsync_meta.json``),
    ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.exists(os.path.join(root, name, META)):
            steps.append(int(name[5:]))
    return sorted(steps)


def prune(root: str, keep_last: int) -> list[int]:
    """Deletes all but the newest ``keep_last`` (>= 1) checkpoints of ``root``; returns the steps deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    gone = saved_steps(root)[:-keep_last]
    for s in gone:
        shutil.rmtree(iter_dir(root, s))
    if gone:
        log.info("deleted checkpoint(s) %s of %s (keeping the last %d)", gone, root, keep_last)
    return gone


def _read_meta_file(d: str) -> dict:
    path = os.path.join(d, META)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"damaged checkpoint {d}: {path}: missing", path) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"damaged checkpoint {d}: {path}: unreadable ({type(exc).__name__}: {exc})",
                                path) from None


def _candidates(load_dir: str, step: int | None, fallback: bool) -> list[int]:
    """The steps to try, newest first: ``step`` (default: the tracker's), then with ``fallback`` every older one."""
    if step is None:
        try:
            step = latest_step(load_dir)
        except ValueError as exc:
            if not fallback:
                raise CheckpointCorrupt(str(exc), os.path.join(load_dir, TRACKER)) from None
            log.warning("%s; falling back to the newest checkpoint directory", exc)
            step = max(saved_steps(load_dir), default=None)
    if step is None:
        return []
    return [step] + ([s for s in reversed(saved_steps(load_dir)) if s < step] if fallback else [])


def _choose(load_dir: str, step: int | None, fallback: bool) -> tuple[int, str, dict] | None:
    """(step, directory, meta) of the newest verified checkpoint among the candidates."""
    steps = _candidates(load_dir, step, fallback)
    if not steps:
        return None
    for i, s in enumerate(steps):
        d = iter_dir(load_dir, s)
        try:
            if not verify(d) and dist.get_rank() == 0:
                log.warning("checkpoint %s has no checksum manifest (saved before format 2): loaded unverified", d)
            return s, d, _read_meta_file(d)
        except CheckpointCorrupt as exc:
            if not fallback:
                older = [o for o in saved_steps(load_dir) if o < s]
                hint = (f"; pass --load-fallback to resume from the newest good one of steps {older}" if older
                        else "; no earlier checkpoint exists")
                raise CheckpointCorrupt(f"{exc}{hint}", exc.path) from None
            if i == len(steps) - 1:
                raise CheckpointCorrupt(f"{exc}; no earlier checkpoint of {load_dir} is intact either",
                                        exc.path) from None
            if dist.get_rank() == 0:
                log.warning("%s — falling back to step %d (--load-fallback)", exc, steps[i + 1])
    return None


def load_checkpoint(
    load_dir: str,
    ddp_model,
    optimizer=None,
    *,
    step: int | None = None,
    load_rng: bool = True,
    fallback: bool = False,
) -> tuple[int, dict] | None:
    """Load the checkpoint at ``step`` (default: the latest) into ``ddp_model`` (and ``optimizer``).

    Returns ``(step, trainer_state)``, or None when ``load_dir`` holds no checkpoint. With an optimizer but a
    model-only checkpoint, the optimizer keeps its state and re-reads the model parameters. Collective.
    Every file is verified against the checksums recorded at save before anything is loaded: a missing, truncated
    or altered file raises :class:`CheckpointCorrupt` naming it; with ``fallback`` the newest older checkpoint that
    verifies is loaded instead (a warning names the damaged file).
    """
    chosen = _choose(load_dir, step, fallback)
    if chosen is None:
        return None
    step, d, meta = chosen
    model = unwrap(ddp_model)
    load_opt = optimizer is not None and meta.get("has_optimizer", False)
    sd = {"model": model.sharded_state_dict()}
    if load_opt:
        sharding = meta.get("optim_sharding", "dp_reshardable")
        compat.prepare_distributed_optimizer_load(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd["model"], is_loading=True, metadata={"distrib_optim_sharding_type": sharding}
        )
    loaded = compat.dist_checkpointing_load(sd, d)
    model.load_state_dict(loaded["model"], strict=True)
    if load_opt:
        with torch.no_grad():  # megatron's distributed optimizer copies into leaf parameters while loading
            optimizer.load_state_dict(loaded["optimizer"])
        compat.fix_loaded_adam_steps(optimizer)
    elif optimizer is not None:
        log.warning("checkpoint %s has no optimizer state: the optimizer keeps its own", d)
        optimizer.reload_model_params()
    if load_rng:
        _load_rng(d, meta)
    dist.barrier()
    return step, meta.get("trainer_state", {})


def _load_rng(d: str, meta: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    saved_world = meta.get("layout", {}).get("world_size")
    path = _rng_path(d, rank)
    if saved_world != world or not os.path.exists(path):
        if rank == 0:
            log.warning("RNG states not restored: saved with %s ranks, loading with %s", saved_world, world)
        return
    set_rng_state(torch.load(path, weights_only=False))
