"""Training checkpoints: megatron-core ``dist_checkpointing`` (torch_dist) for model and optimizer, plus RNG
states, the step counter and a JSON trainer state. Resume is bitwise: the steps after a resume equal those of
an uninterrupted run (tested with Adam in fp32).

Layout (Megatron-LM's convention)::

    DIR/latest_checkpointed_iteration.txt      the newest complete step, e.g. "7"
    DIR/iter_0000007/                          dist_checkpointing files (metadata.json, common.pt, *.distcp)
        tsync_meta.json                        step, trainer_state, arch, layout at save time
        rng/rank_00000.pt                      per-rank RNG states (torch CPU/CUDA, python, numpy, megatron tracker)
    DIR/hf_assets/                             optional: config.json + tokenizer files (for export to HF)

A save writes ``iter_XXXXXXX.tmp`` first, renames it when every rank has finished, and only then rewrites the
tracker file (atomically), so a process killed mid-save leaves the previous checkpoint as the latest.
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

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
META = "tsync_meta.json"
HF_ASSETS = "hf_assets"
FORMAT_VERSION = 1


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
    with open(os.path.join(iter_dir(root, step), META)) as f:
        return json.load(f)


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


def save_checkpoint(
    save_dir: str,
    step: int,
    ddp_model,
    optimizer=None,
    trainer_state: dict | None = None,
    *,
    hf_assets_src: str | None = None,
    optim_sharding: str = "dp_reshardable",
) -> str:
    """Save model (+ optimizer when given), RNG states, ``step`` and ``trainer_state`` (JSON-able) to
    ``save_dir/iter_{step:07d}``; returns that path. Collective. ``hf_assets_src``: an HF folder whose
    config.json and tokenizer files are copied to ``save_dir/hf_assets`` (used by the HF export).
    ``optim_sharding``: the distributed optimizer's format (megatron's ``distrib_optim_sharding_type``):
    "dp_reshardable" (default, Megatron-LM's; fully parallel, reshards over DP only) or "fully_reshardable"
    (loads at any TP/PP/DP; gathers the optimizer state on DP rank 0 while saving). Ignored by the plain
    optimizer, whose state always reshards. Resume is bitwise (tested: 1 process, TP=2, DP=2 with the distributed
    optimizer in both formats; megatron-core 0.16 fixes for torch Adam are in ``compat``)."""
    rank = dist.get_rank()
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
    sd = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd["model"], metadata={"distrib_optim_sharding_type": optim_sharding}
        )
    compat.dist_checkpointing_save(sd, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(rng, _rng_path(tmp, rank))
    dist.barrier()
    if rank == 0:
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
    dist.barrier()
    return final


def load_checkpoint(
    load_dir: str,
    ddp_model,
    optimizer=None,
    *,
    step: int | None = None,
    load_rng: bool = True,
) -> tuple[int, dict] | None:
    """Load the checkpoint at ``step`` (default: the latest) into ``ddp_model`` (and ``optimizer``).

    Returns ``(step, trainer_state)``, or None when ``load_dir`` holds no checkpoint. With an optimizer but a
    model-only checkpoint, the optimizer keeps its state and re-reads the model parameters. Collective.
    """
    if step is None:
        step = latest_step(load_dir)
        if step is None:
            return None
    d = iter_dir(load_dir, step)
    with open(os.path.join(d, META)) as f:
        meta = json.load(f)
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
