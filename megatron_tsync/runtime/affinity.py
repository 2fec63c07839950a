"""Disjoint CPU resources on one machine: the trainer ranks on ``--trainer-cpus``, the rollout workers (their
engines and sandboxed tool calls) on ``--rollout-cpus`` — the CPU counterpart of the paper's disjoint learner and
rollout GPUs.

* The trainer (``runtime.loop.run``, every rank, first thing) calls :func:`setup_trainer`: both lists are checked
  against the cores this process may use (``os.sched_getaffinity`` at start-up, recorded before any pinning:
  a core the machine does not have, or one outside the process's cpuset, is a :class:`AffinityError` naming the
  flag), an overlap of the two lists is allowed but warned, the split is printed once (rank 0), and the rank's
  share of ``--trainer-cpus`` is applied.
* Workers the trainer starts (``runtime.fleet``) are started on their share (:func:`worker_cpus`,
  :func:`children_on`), so the whole interpreter, its imports included, runs on the rollout share; with
  ``--trainer-cpus`` and no ``--rollout-cpus`` they get the cores the trainer was started with (not the trainer's
  pinned share, which a child would inherit otherwise).
* Every worker (``runtime.worker.main``) applies its share again with :func:`setup_worker` (external workers started
  by srun elsewhere only get this), so its threads and every sandboxed tool call it starts (a child inherits the
  mask of the thread that forks it) stay there.

Pinning covers every thread of the process (``/proc/self/task``), not only the caller, so thread pools made before
(OpenBLAS, ZeroMQ, heartbeats) move too. torch's intra-op threads are set to the number of cores of the share.

Shares: ``n`` processes on one list (trainer ranks of a node: ``LOCAL_WORLD_SIZE``; workers one trainer starts:
``--rollout-workers``) get contiguous, disjoint slices when the list has at least ``n`` cores (the first
``len % n`` one core more), else all share the whole list (warned).
"""

from __future__ import annotations

import contextlib
import logging
import os

from megatron_tsync.config import parse_cpu_list

log = logging.getLogger(__name__)

_STARTUP: frozenset[int] | None = None  # the cores this process could use before setup_trainer pinned it


class AffinityError(ValueError):
    """A CPU list that cannot be applied here (names the flag)."""


def fmt(cpus) -> str:
    """``{0, 1, 2, 3, 8}`` → ``"0-3,8"`` (the kernel's list syntax)."""
    cpus = sorted(cpus)
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def startup_cpus() -> frozenset[int]:
    """The cores this process could use when it started (before :func:`setup_trainer` pinned it)."""
    return _STARTUP if _STARTUP is not None else frozenset(os.sched_getaffinity(0))


def resolve(text: str, flag: str, allowed=None) -> tuple[int, ...]:
    """``text`` (a CPU list) checked against ``allowed`` (default: :func:`startup_cpus`); AffinityError naming
    ``flag`` for a bad list, a core the machine lacks, or one this process may not use."""
    try:
        cpus = parse_cpu_list(text)
    except ValueError as e:
        raise AffinityError(f"{flag}: {e}") from None
    allowed = frozenset(startup_cpus() if allowed is None else allowed)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        n = os.cpu_count() or 0
        raise AffinityError(f"{flag} {text}: core(s) {fmt(missing)} not available (this machine has {n} cores, "
                            f"{fmt(range(n))}; this process may use {fmt(allowed)})")
    return cpus


def share(cpus: tuple[int, ...], n: int, i: int) -> tuple[int, ...]:
    """Process ``i`` of ``n`` on ``cpus``: a contiguous slice when there is a core per process, else all of them."""
    if n <= 1 or len(cpus) < n:
        return tuple(cpus)
    base, extra = divmod(len(cpus), n)
    start = i * base + min(i, extra)
    return tuple(cpus[start:start + base + (1 if i < extra else 0)])


def pin(cpus) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it)."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def children_on(cpus):
    """Processes started inside run on ``cpus`` from their first instruction: only the calling thread's mask is
    changed for the moment (a child inherits the mask of the thread that forks it), then restored; no
    ``preexec_fn``, so ``subprocess`` keeps its thread-safe spawn. ``cpus`` None: nothing changes."""
    if cpus is None:
        yield
        return
    mine = os.sched_getaffinity(0)  # pid 0 = this thread
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, n))


def setup_trainer(cfg, rank: int, local_rank: int, local_world: int) -> tuple[int, ...] | None:
    """Checks both lists, warns on overlap, prints the split (``rank`` 0) and pins this trainer rank to its share
    of ``--trainer-cpus`` (torch threads = its cores). Returns the share (None: not pinned)."""
    global _STARTUP
    if _STARTUP is None:
        _STARTUP = frozenset(os.sched_getaffinity(0))
    tr = cfg.parallel.trainer_cpus
    ro = cfg.rollout.cpus
    t = resolve(tr, "--trainer-cpus") if tr is not None else None
    local_workers = cfg.rollout.launch == "local" and cfg.rollout.num_workers > 0
    r = resolve(ro, "--rollout-cpus") if ro is not None and local_workers else None
    if t is not None and r is not None and set(t) & set(r):
        log.warning("--trainer-cpus %s and --rollout-cpus %s overlap on core(s) %s: the learner and the rollouts "
                    "will contend there", tr, ro, fmt(set(t) & set(r)))
    mine = share(t, local_world, local_rank) if t is not None else None
    if t is not None and local_world > len(t) and rank == 0:
        log.warning("--trainer-cpus %s has %d core(s) for %d ranks on this node: they share all of them", tr, len(t),
                    local_world)
    if rank == 0:
        print(f"[tsync] {split_line(cfg, t, r, local_world)}", flush=True)
    if mine is not None:
        pin(mine)
        _threads(len(mine))
    return mine


def split_line(cfg, trainer, rollout, local_world: int) -> str:
    """One line naming the machine and who runs where."""
    allowed = startup_cpus()
    n = cfg.rollout.num_workers
    if trainer is None:
        tpart = f"trainer unpinned ({os.environ.get('OMP_NUM_THREADS', '?')} torch thread(s) per rank)"
    else:
        shares = [fmt(share(trainer, local_world, i)) for i in range(local_world)]
        tpart = f"trainer cores {fmt(trainer)} (rank shares {' | '.join(shares)})"
    if cfg.rollout.launch != "local" or n == 0:
        rpart = ("rollout workers external" + (f" on {cfg.rollout.cpus}" if cfg.rollout.cpus else "")
                 if n else "no rollout workers")
    elif rollout is None:
        rpart = f"rollout workers on {fmt(allowed)} (unpinned share of the machine; 1 torch thread each)"
    else:
        shares = " | ".join(fmt(share(rollout, n, w)) for w in range(n))
        rpart = f"rollout cores {fmt(rollout)} (worker shares {shares})"
    return f"cpus: machine {os.cpu_count()} cores, allowed {fmt(allowed)}; {tpart}; {rpart}"


def worker_cpus(rollout_cfg, worker_id: int, trainer_pinned: bool) -> tuple[int, ...] | None:
    """What a worker this trainer starts is pinned to: its share of ``--rollout-cpus``; without it, when the
    trainer is pinned, the cores the trainer was started with; else None (inherit)."""
    if rollout_cfg.cpus is not None:
        return share(resolve(rollout_cfg.cpus, "--rollout-cpus"), rollout_cfg.num_workers, worker_id)
    return tuple(sorted(startup_cpus())) if trainer_pinned else None


def setup_worker(rollout_cfg, worker_id: int, started_by_trainer: bool) -> tuple[int, ...] | None:
    """In the worker process: pin to its share of ``--rollout-cpus`` (workers the trainer started: the share the
    trainer gave; external: the whole list, checked against this process's cores) and set torch's threads to its
    cores (1 without the flag). Returns the cores (None: not pinned)."""
    if rollout_cfg.cpus is None:
        _threads(1)
        return None
    if started_by_trainer:  # checked by the trainer against its start-up cores; this process inherited its share
        cpus = share(resolve(rollout_cfg.cpus, "--rollout-cpus", allowed=range(os.cpu_count() or 1)),
                     rollout_cfg.num_workers, worker_id)
    else:
        cpus = resolve(rollout_cfg.cpus, "--rollout-cpus", allowed=os.sched_getaffinity(0))
    try:
        pin(cpus)
    except OSError as e:
        raise AffinityError(f"--rollout-cpus {rollout_cfg.cpus}: cannot pin worker {worker_id} to {fmt(cpus)}: "
                            f"{e}") from None
    _threads(len(cpus))
    return cpus
