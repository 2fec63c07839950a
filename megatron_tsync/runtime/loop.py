"""The one training loop, for every algorithm (GRPO, OPD), parameterised by a ``runtime.spec.TrainSpec``.

What differs between algorithms is the learner, the event source of a step and the log row; that is the spec's.
Everything else is the loop's, and so the same for all: start-up (``RunContext``), the weight hand-off before every
step, ``--dump-rollouts``, logging, ``--save-interval``, the save at the end (or on an agreed stop: a signal or
``--exit-duration-in-mins``; SIGTERM on one trainer rank aborts the step in flight, otherwise it finishes first),
the stop record ``SAVE/tsync_stop.json`` (``runtime/stop.py``), closing the rollout plane, and the count of steps
whose update the barrier skipped for a non-finite loss or gradient (``--max-consecutive-skipped-steps`` in a row stop
the run with exit code 3 and no checkpoint: ``runtime/stop.py``).

    for k in steps:   publish θ_k → algorithm.step(k) (consume events as they land, barrier, optimizer step)
                      → dump → log → save every N
"""

from __future__ import annotations

import logging
import os
import time

import torch

from megatron_tsync.config import TrainConfig
from megatron_tsync.model.parallel import PortInUse, destroy_parallel
from megatron_tsync.runtime import affinity, env_report, launch_env, preflight, run_dir
from megatron_tsync.runtime.context import RunContext
from megatron_tsync.runtime.fleet import WorkerDied
from megatron_tsync.runtime.grpo import GRPO_SPEC
from megatron_tsync.runtime.opd import OPD_SPEC
from megatron_tsync.runtime.phase import announce
from megatron_tsync.runtime.rollout_io import dump_rollouts
from megatron_tsync.runtime.signal_health import HEALTH_TB_NAMES, NoLearningSignal, SignalHealth
from megatron_tsync.runtime.spec import Algorithm, TrainSpec
from megatron_tsync.runtime.stop import (NonFiniteStop, SkipCounter, StopAgreement, StopFlag, StopRequested,
                                         write_stop_file)


def train(ctx: RunContext, algo: Algorithm) -> list[dict]:
    """Steps ``ctx.step .. train_iters`` (or until an agreed stop: a signal, ``--exit-duration-in-mins``); returns
    the per-step rows. After the last save rank 0 writes ``SAVE/tsync_stop.json`` (``runtime/stop.py``)."""
    cfg = ctx.cfg
    if ctx.step >= cfg.rl.train_iters:  # a finished run started again (the same on every rank: the same checkpoint)
        if ctx.dims.rank == 0:
            print(f"[tsync] nothing to do: {cfg.checkpoint.load} is at step {ctx.step} and --train-iters is "
                  f"{cfg.rl.train_iters} (raise --train-iters to train on, or --save/--load a new folder)", flush=True)
            if cfg.checkpoint.save:  # start-up cleared the stop record: the run is still finished
                write_stop_file(cfg.checkpoint.save, finished=True, reason="done", step=ctx.step)
        ctx.close()
        return ctx.history
    live = not cfg.logging.replay_rollouts
    agreement = StopAgreement(ctx.dims.world_size)  # collective: every rank, before anything can stop
    ctx.stop.abortable = ctx.dims.world_size == 1  # SIGTERM aborts the step in flight (several ranks: finish it)
    fleet = ctx.open_fleet() if live else None
    heldout = ctx.heldout_eval()  # --eval-interval: trainer rank 0, else None
    health = ctx.health = SignalHealth(cfg.rl.algorithm, cfg.logging.stop_on_no_signal or 0)
    stopped = None
    try:
        if fleet is not None:
            fleet.abort_check = ctx.stop.check_abort  # after every poll of a step's source
        if live:
            ctx.publish(fleet, ctx.step)
        _evaluate(ctx, heldout)
        _finish(ctx, _steps(ctx, algo, fleet, agreement, heldout))
    except NonFiniteStop:  # no checkpoint, no stop record; the rows so far are still written
        if ctx.history and ctx.dims.is_logging_rank:
            ctx.save_history(heldout.records if heldout is not None else None)
        raise
    except NoLearningSignal as e:  # --stop-on-no-signal: no checkpoint, no stop record (a scheduler must not requeue)
        stopped = e
    finally:
        if fleet is not None:
            fleet.close()
        if heldout is not None:
            heldout.close()
        ctx.close()
    if ctx.history and ctx.dims.is_logging_rank:
        held = heldout.summary() if heldout is not None else ""
        signal = health.summary(ctx.history[-1].get("events_rejected"))
        print(algo.summary(ctx.history) + f", {signal}" + (f", {held}" if held else ""), flush=True)
        ctx.save_history(heldout.records if heldout is not None else None)
    if stopped is not None:
        raise SystemExit(f"error: {stopped}")
    return ctx.history


def _evaluate(ctx: RunContext, heldout) -> None:
    """Held-out evaluation of the policy now (θ_{ctx.step}) when it is due (``runtime/evaluation.py``)."""
    if heldout is None or not heldout.due(ctx.step):
        return
    from megatron_tsync.runtime.evaluation import EVAL_TB_NAMES

    with announce(f"held-out evaluation v{ctx.step}"):
        rec = heldout.run(ctx.step)
    print(heldout.line(rec), flush=True)
    ctx.write_scalars(rec, EVAL_TB_NAMES, ctx.step)


def _steps(ctx: RunContext, algo: Algorithm, fleet, agreement: StopAgreement, heldout=None) -> str:
    """The step loop; returns the agreed stop reason ("" at the end of training). Saves every --save-interval."""
    cfg = ctx.cfg
    live = not cfg.logging.replay_rollouts  # every rank publishes (a collective over TP/PP); rank 0 owns the fleet
    t_run = time.perf_counter()
    first = ctx.saved = ctx.step
    skips = SkipCounter(cfg.rl.max_consecutive_skipped_steps)
    while ctx.step < cfg.rl.train_iters:
        k = ctx.step
        reason = agreement.decide(ctx.stop)  # the same on every rank: all stop before the same step
        if reason:
            if ctx.dims.rank == 0:
                print(f"[tsync] stopping before step {k} ({reason})", flush=True)
            return reason
        t_step, cpu_step = time.perf_counter(), time.process_time()
        if fleet is not None:
            fleet.begin_step(k)
        try:
            out = algo.step(k, fleet)
        except StopRequested as e:  # SIGTERM, one rank: θ_k and the optimizer untouched; a resumed run redoes k
            print(f"[tsync] step {k} aborted ({e}); saving step {k}", flush=True)
            return ctx.stop.reason
        except WorkerDied as e:  # past --rollout-retries: keep θ_k (a resumed run redoes step k), then fail
            print(f"[tsync] step {k} failed: {e}", flush=True)
            if cfg.checkpoint.save and ctx.dims.world_size == 1:  # several ranks: the others wait in a collective
                ctx.save()
            raise
        ctx.step += 1
        if cfg.logging.dump_rollouts and ctx.dims.rank == 0:
            dump_rollouts(cfg.logging.dump_rollouts, k, out.samples, out.group_order)
        if live and ctx.step < cfg.rl.train_iters:
            ctx.publish(fleet, ctx.step)
        skipped = int(getattr(out.result, "skipped_updates", 0))
        row = {**algo.row(k, out, fleet), **perf_row(out, t_step, cpu_step), **skips.record(k, skipped)}
        row.update(_health(ctx, out, row))
        if skipped and ctx.dims.rank == 0:
            print(f"[tsync] {skips.message(k)}", flush=True)
        _log(ctx, algo, k, row, time.perf_counter() - t_run, ctx.step - first)
        skips.check(k)  # the same on every rank (the barrier's verdict is all-reduced): all stop here
        if ctx.health.stop:  # --stop-on-no-signal: the same on every rank (samples are broadcast); one error line
            raise NoLearningSignal(ctx.health.stop)
        _evaluate(ctx, heldout)  # θ_{k+1}, while the workers roll out step k + 1
        si = cfg.checkpoint.save_interval
        if si and ctx.step % si == 0:
            ctx.save()
            ctx.saved = ctx.step
    return ""


def _finish(ctx: RunContext, reason: str) -> None:
    """The last save (unless the step was just saved), then the stop record (rank 0, after the save is complete)."""
    save = ctx.cfg.checkpoint.save
    if not save:
        return
    if ctx.saved != ctx.step:
        ctx.save()
        ctx.saved = ctx.step
    if ctx.dims.rank == 0:
        finished = ctx.step >= ctx.cfg.rl.train_iters
        path = write_stop_file(save, finished=finished, reason="done" if finished else reason, step=ctx.step)
        print(f"[tsync] stop record {path}: finished {finished}, reason {'done' if finished else reason}, "
              f"step {ctx.step}", flush=True)


PERF_TB_NAMES = {"learner_busy_s": "perf/learner_busy_s", "wall_step_s": "perf/wall_step_s",
                 "trainer_cpu_s": "perf/trainer_cpu_s"}
"""TensorBoard tags of :func:`perf_row`'s keys."""
SKIP_TB_NAMES = {"skipped_steps": "train/skipped_steps", "update_skipped": "train/update_skipped"}
"""TensorBoard tags of ``SkipCounter.record``'s keys."""


def perf_row(out, t_step: float, cpu_step: float) -> dict:
    """The loop's own per-step figures: ``learner_busy_s`` (the learner's busy seconds in the step: forward /
    backward, π_θ0 and reference forwards, the barrier — ``step_time_s`` × (1 − ``idle_frac``); it grows when
    the learner's cores are contended), ``wall_step_s`` (the whole iteration: source, learner, dump, the next
    weights' publish) and ``trainer_cpu_s`` (CPU seconds of this trainer process in it, every thread)."""
    return {"learner_busy_s": getattr(out.result, "busy_s", None), "wall_step_s": time.perf_counter() - t_step,
            "trainer_cpu_s": time.process_time() - cpu_step}


def _log(ctx: RunContext, algo: Algorithm, k: int, row: dict, elapsed: float, done: int) -> None:
    ctx.history.append(row)
    ctx.write_scalars(row, algo.tb_names | PERF_TB_NAMES | SKIP_TB_NAMES | HEALTH_TB_NAMES, k)
    if ctx.dims.is_logging_rank and k % max(ctx.cfg.logging.log_interval, 1) == 0:
        total = ctx.cfg.rl.train_iters
        eta = elapsed / max(done, 1) * (total - ctx.step)
        print(algo.line(row, ctx.step, total, eta) + ctx.health.line(row), flush=True)


def _health(ctx: RunContext, out, row: dict) -> dict:
    """The step's learning-signal entries (``runtime/signal_health.py``) and its one-time warning."""
    entries, why, warning = ctx.health.observe(ctx.step, out.samples, row.get("grad_norm"))  # steps done, as shown
    if warning and ctx.dims.is_logging_rank:
        print(warning, flush=True)
    return {**entries, "no_signal_why": why} if why else entries


def train_spec(name: str) -> TrainSpec:
    """The spec of ``--rl-algorithm NAME``."""
    specs = {s.name: s for s in (GRPO_SPEC, OPD_SPEC)}
    if name not in specs:
        raise ValueError(f"--rl-algorithm {name!r}: one of {sorted(specs)}")
    return specs[name]


def run(cfg: TrainConfig) -> list[dict]:
    """A whole run: signals first (so start-up is interruptible too), then start-up, the loop, teardown."""
    stop = StopFlag(cfg.checkpoint.exit_duration_in_mins)
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[%(name)s] %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:  # --trainer-cpus / --rollout-cpus: checked, logged, this rank pinned (before any thread pool exists)
        affinity.setup_trainer(cfg, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                               int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except affinity.AffinityError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.rollout.launch == "local" and cfg.rollout.num_workers and not cfg.logging.replay_rollouts:
        try:  # --rollout-gpus: every worker its GPUs, none of them a trainer rank's
            launch_env.check_gpu_placement(cfg, cuda=torch.cuda.is_available())
        except launch_env.PlacementError as e:
            raise SystemExit(f"error: {e}") from None
    spec = train_spec(cfg.rl.algorithm)
    try:
        ctx = RunContext(cfg, stop)
    except (run_dir.RunLocked, run_dir.ConfigMismatch) as e:
        destroy_parallel()
        raise SystemExit(f"error: {e}") from None
    except PortInUse as e:  # one line, not torch's traceback (every rank: rank 0 prints)
        destroy_parallel()
        preflight.fail(e)
    env_report.print_report(cfg, ctx.dims)
    try:
        return train(ctx, spec.build(ctx))
    except NonFiniteStop as e:  # every rank, after the same step: one line (rank 0), exit code 3
        preflight.fail(e, code=3)
    finally:
        destroy_parallel()
