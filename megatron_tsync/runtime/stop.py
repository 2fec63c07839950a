"""Stopping a run: signals, the wall-time budget, the decision every rank agrees on, and the stop record.

- SIGUSR1 (SLURM's pre-timeout signal) and SIGINT: graceful — the step in flight finishes, a checkpoint is saved, the
  run exits 0.
- SIGTERM (SLURM's time-out, ``scancel``, preemption; SIGKILL follows about 30 s later): urgent. With one trainer
  rank the step in flight is aborted at the learner's next poll of its event source (the place a ``WorkerDied``
  comes from, so before the optimizer step: θ_k and the optimizer state are untouched, the partial gradient is
  discarded), θ_k is saved and a resumed run redoes step k. With several trainer ranks the step finishes as for USR1
  (ranks blocked in a collective cannot be unwound safely one by one).
- ``--exit-duration-in-mins M``: the run stops at the first step boundary M minutes of wall time after this
  process started.

The decision is taken at step boundaries only, and agreed: every rank contributes its local reason code and all
take the all-reduce MAX (a gloo group, on CPU), so ranks whose signal landed in different steps still stop after the
same step. The codes are ordered by urgency (``REASONS``): the MAX is the most urgent one any rank saw.

Under torchrun a job-wide SIGTERM also reaches the elastic agent, which forwards it to the ranks and kills them
after its own timeout: launch trainer ranks with srun (``SLURM_PROCID``) where the 30 s matter.

After the stop (and after the checkpoint is complete) rank 0 writes ``SAVE/tsync_stop.json`` atomically:
``{"finished": step == train_iters, "reason": "done" | "exit-duration" | "SIGTERM" | "SIGUSR1" | "SIGINT",
"step": the checkpointed step, "time": unix time}``; the SLURM scripts requeue the job when ``finished`` is false.
The file is removed at the start of a run, so its absence after a run means the run failed.

Skipped updates (:class:`SkipCounter`): a step whose loss or gradient is NaN / inf anywhere keeps θ (the barrier
skips the optimizer step on every rank, ``training/barrier.py``), and the version still advances (the rollout plane
samples step k + 1 from the same weights). ``--max-consecutive-skipped-steps N`` (default 3; 0: never stop) steps
in a row with a skipped update stop the run: one ``[tsync] error:`` line, exit code 3, no checkpoint and no stop
record (the SLURM scripts do not requeue it: the same data would poison it again); the last checkpoint written
before holds finite weights, since no skipped step changed them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

log = logging.getLogger("megatron_tsync")

REASONS = ("", "exit-duration", "SIGUSR1", "SIGINT", "SIGTERM")
"""Stop reasons by code (the index); a higher code is more urgent, so the all-reduce MAX is the most urgent one."""
SIGNAL_REASONS = {signal.SIGUSR1: "SIGUSR1", signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
STOP_FILE = "tsync_stop.json"


class StopRequested(Exception):
    """The step in flight is aborted (SIGTERM, one trainer rank): raised from the event source's poll."""


def process_start_time() -> float:
    """Unix time this process started (``/proc/self/stat``; 1 s resolution), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (clock ticks after boot)
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StopFlag:
    """The local stop request of this rank: installed at the very start of a run (``loop.run``), so a signal during
    start-up (model load, SFT) is honoured. ``stop``: a signal arrived; ``reason``: the most urgent one so far;
    ``urgent``: SIGTERM; ``abortable``: the loop allows an abort of the step in flight (one trainer rank)."""

    def __init__(self, exit_duration_in_mins: float | None = None, *, install: bool = True):
        self.stop, self.signum, self.urgent, self.abortable = False, None, False, False
        self.reason = ""
        self.exit_duration_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.t_start = process_start_time()
        for s in SIGNAL_REASONS if install else ():
            try:
                signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                pass

    def _handler(self, signum, frame):
        why = SIGNAL_REASONS.get(signum, "SIGTERM")
        if REASONS.index(why) > REASONS.index(self.reason):
            self.reason = why
        self.stop, self.signum = True, signum
        self.urgent = self.urgent or signum == signal.SIGTERM
        what = ("aborting the step in flight at the next poll" if self.urgent and self.abortable
                else "finishing the step in flight")
        try:  # the main thread may be inside a write to the same stream: never fail the run over the message
            log.warning("signal %s: %s, then saving a checkpoint and exiting", why, what)
        except RuntimeError:
            pass

    def elapsed_s(self) -> float:
        return time.time() - self.t_start

    def local_code(self) -> int:
        """This rank's reason code now: its most urgent signal, else the wall-time budget, else 0."""
        if self.reason:
            return REASONS.index(self.reason)
        if self.exit_duration_s is not None and self.elapsed_s() >= self.exit_duration_s:
            return REASONS.index("exit-duration")
        return 0

    def check_abort(self) -> None:
        """Called after every poll of a step's event source: raises :class:`StopRequested` on SIGTERM when the step
        may be aborted."""
        if self.urgent and self.abortable:
            raise StopRequested(f"{self.reason}: the step in flight is aborted (its partial gradient is discarded)")


class StopAgreement:
    """The step-boundary decision, the same on every rank: all-reduce MAX of the local codes over a gloo group (every
    rank of the default group; created collectively here). One rank: no collective."""

    def __init__(self, world_size: int):
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo") if world_size > 1 else None

    def decide(self, flag: StopFlag) -> str:
        """The agreed reason to stop now ("" = go on). Collective over every rank."""
        code = flag.local_code()
        if self.group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            code = int(t.item())
        return REASONS[code]


def stop_file(save_dir: str) -> str:
    return os.path.join(save_dir, STOP_FILE)


def clear_stop_file(save_dir: str | None) -> None:
    """At the start of a run (rank 0): a previous run's record must not describe this one."""
    if save_dir:
        try:
            os.remove(stop_file(save_dir))
        except FileNotFoundError:
            pass


def write_stop_file(save_dir: str, *, finished: bool, reason: str, step: int) -> str:
    """``SAVE/tsync_stop.json``, atomically (written to a temporary name, fsynced, renamed). Rank 0, after the
    checkpoint of ``step`` is complete."""
    os.makedirs(save_dir, exist_ok=True)
    path = stop_file(save_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"finished": bool(finished), "reason": reason, "step": int(step), "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


class NonFiniteStop(RuntimeError):
    """``--max-consecutive-skipped-steps`` steps in a row skipped their update (non-finite loss or gradient)."""


class SkipCounter:
    """Steps whose optimizer update was skipped (``training.barrier``): the run's total, the current streak, and the
    stop after ``limit`` in a row (0: never). The counts come from the barrier's all-reduced verdict, so every rank
    stops after the same step."""

    def __init__(self, limit: int):
        self.limit, self.total, self.streak = limit, 0, 0

    def record(self, k: int, skipped_updates: int) -> dict:
        """Step ``k`` skipped ``skipped_updates`` optimizer updates (of its minibatches × epochs); its log row keys:
        ``update_skipped`` (this step's) and ``skipped_steps`` (this process's total so far)."""
        self.total += skipped_updates
        self.streak = self.streak + 1 if skipped_updates else 0
        return {"update_skipped": skipped_updates, "skipped_steps": self.total}

    def message(self, k: int) -> str:
        limit = f"the run stops at {self.limit}" if self.limit else "never stops"
        return (f"step {k}: optimizer update skipped (non-finite loss or gradient), weights unchanged; "
                f"{self.streak} in a row (--max-consecutive-skipped-steps {self.limit}: {limit})")

    def check(self, k: int) -> None:
        """Raises :class:`NonFiniteStop` once ``limit`` steps in a row (ending at step ``k``) skipped their update."""
        if self.limit and self.streak >= self.limit:
            raise NonFiniteStop(
                f"stopping at step {k}: {self.streak} steps in a row (--max-consecutive-skipped-steps {self.limit}) had "
                f"a non-finite loss or gradient and skipped their optimizer update; the weights are still policy "
                f"version {k + 1 - self.streak}'s, no checkpoint was written now (see the log for the rejected and skipped "
                f"steps, history.json for the rows)")
