"""The one training loop, for every algorithm (GRPO, OPD), parameterised by a ``runtime.spec.TrainSpec``.

What differs between algorithms is the learner, the event source of a step and the log row; that is the spec's.
Everything else is the loop's, and so the same for all: start-up (``RunContext``), the weight hand-off before every
step, ``--dump-rollouts``, logging, ``--save-interval``, the save at the end (or on a signal: the step in flight
finishes first), closing the rollout plane.

    for k in steps:   publish θ_k → algorithm.step(k) (consume events as they land, barrier, optimizer step)
                      → dump → log → save every N
"""

from __future__ import annotations

import logging
import os
import time

import torch

from megatron_tsync.config import TrainConfig
from megatron_tsync.model.parallel import destroy_parallel
from megatron_tsync.runtime.context import RunContext, StopFlag
from megatron_tsync.runtime.grpo import GRPO_SPEC
from megatron_tsync.runtime.opd import OPD_SPEC
from megatron_tsync.runtime.rollout_io import dump_rollouts
from megatron_tsync.runtime.spec import Algorithm, TrainSpec


def train(ctx: RunContext, algo: Algorithm) -> list[dict]:
    """Steps ``ctx.step .. train_iters`` (or until a signal); returns the per-step rows."""
    cfg = ctx.cfg
    live = not cfg.logging.replay_rollouts
    fleet = ctx.open_fleet() if live else None
    try:
        if live:
            ctx.publish(fleet, ctx.step)
        t_run = time.perf_counter()
        first = saved = ctx.step
        while ctx.step < cfg.rl.train_iters and not ctx.stop.stop:
            k = ctx.step
            if fleet is not None:
                fleet.begin_step(k)
            out = algo.step(k, fleet)
            ctx.step += 1
            if cfg.logging.dump_rollouts and ctx.dims.rank == 0:
                dump_rollouts(cfg.logging.dump_rollouts, k, out.samples, out.group_order)
            if live and ctx.step < cfg.rl.train_iters:
                ctx.publish(fleet, ctx.step)
            _log(ctx, algo, k, algo.row(k, out, fleet), time.perf_counter() - t_run, ctx.step - first)
            si = cfg.checkpoint.save_interval
            if si and ctx.step % si == 0:
                ctx.save()
                saved = ctx.step
        if cfg.checkpoint.save and saved != ctx.step:  # the end of the run, or a signal
            ctx.save()
    finally:
        if fleet is not None:
            fleet.close()
        ctx.close()
    if ctx.history and ctx.dims.is_logging_rank:
        print(algo.summary(ctx.history), flush=True)
        ctx.save_history()
    return ctx.history


def _log(ctx: RunContext, algo: Algorithm, k: int, row: dict, elapsed: float, done: int) -> None:
    ctx.history.append(row)
    ctx.write_scalars(row, algo.tb_names, k)
    if ctx.dims.is_logging_rank and k % max(ctx.cfg.logging.log_interval, 1) == 0:
        total = ctx.cfg.rl.train_iters
        eta = elapsed / max(done, 1) * (total - ctx.step)
        print(algo.line(row, ctx.step, total, eta), flush=True)


def train_spec(name: str) -> TrainSpec:
    """The spec of ``--rl-algorithm NAME``."""
    specs = {s.name: s for s in (GRPO_SPEC, OPD_SPEC)}
    if name not in specs:
        raise ValueError(f"--rl-algorithm {name!r}: one of {sorted(specs)}")
    return specs[name]


def run(cfg: TrainConfig) -> list[dict]:
    """A whole run: signals first (so start-up is interruptible too), then start-up, the loop, teardown."""
    stop = StopFlag()
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[%(name)s] %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = train_spec(cfg.rl.algorithm)
    ctx = RunContext(cfg, stop)
    try:
        return train(ctx, spec.build(ctx))
    finally:
        destroy_parallel()
