"""Liveness across the rollout plane, both ways, and the re-dispatch of a dead worker's trajectories.

Heartbeats are small JSON files in the run directory (``run_dir/hb/``: the shared filesystem the worker specs and
weight versions already use), rewritten by a daemon thread every ``interval`` seconds with a counter that grows:

- ``hb/worker{w}.json``, by every rollout worker: its run id, pid, the step it works on and how many trajectory
  events it has sent. The trainer's fleet declares a worker dead when its process exited, or hung when the counter
  has not changed for ``rollout.heartbeat_timeout_s`` (a SIGSTOPped or wedged process: a stopped process runs no
  thread).
- ``hb/trainer.json``, by the trainer's fleet: its run id and whether it closed. A worker exits when the trainer's
  counter has not changed for ``rollout.heartbeat_timeout_s`` (a trainer on another node died) or the file names
  another run (a new run took over the directory); a local worker also gets ``PR_SET_PDEATHSIG`` (SIGKILL the moment
  its parent dies; Linux).

Staleness is measured on the reader's own clock, from the moment it last saw the content change, so clock skew
between nodes and filesystem timestamps play no part.

Re-dispatch (``assign/s{step}.w{w}.n{n}.json``): the fleet names trajectory ids of a step, the policy version they
must be sampled from and the reason; the file is signed with the run's key (HMAC-SHA256 of the body), so another run
or a stray writer cannot assign work. A live worker rolls them out after its own share of the step (and while it
waits for the next weights), with the step's prompts, a seed of its own for that attempt, and sends them as ordinary
trajectory events of the same policy version.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import signal
import sys
import threading
import time

from megatron_tsync.transport.ids import group_id, parse_traj_id, traj_id

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
ASSIGN_FORMAT = "tsync-assignment-v1"


def beat_interval(timeout_s: float) -> float:
    """How often a heartbeat is rewritten: often enough that ``timeout_s`` means several missed beats."""
    return max(0.05, min(1.0, timeout_s / 5))


def set_parent_death_signal(expected_parent: int | None) -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``: this process is killed when its parent dies. Returns False where prctl
    is not available (not Linux). If the parent is already gone (it died before the call), exits at once."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(75)  # the parent died between fork and prctl: nobody will ever kill us
    return True


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class BeatWriter:
    """A daemon thread rewriting ``path`` with ``{"run_id", "pid", "beat": n, **payload()}`` every ``interval_s``."""

    def __init__(self, path: str, run_id: str, interval_s: float, payload=lambda: {}):
        self.path, self.run_id, self.interval_s, self.payload = path, run_id, interval_s, payload
        self.beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat:{os.path.basename(path)}", daemon=True)

    def start(self) -> "BeatWriter":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.write()
        self._thread.start()
        return self

    def write(self, **extra) -> None:
        self.beat += 1
        try:
            write_json_atomic(self.path, {"run_id": self.run_id, "pid": os.getpid(), "beat": self.beat,
                                          "time": time.time(), **self.payload(), **extra})
        except OSError as e:  # a full or flaky filesystem: the next beat retries; the reader's deadline decides
            log.warning("heartbeat %s: %s", self.path, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def stop(self, **final) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if final:
            self.write(**final)


class BeatReader:
    """Reads a heartbeat file; ``age()`` is the seconds since its content last changed, on this process's clock."""

    def __init__(self, path: str):
        self.path = path
        self.last: dict | None = None
        self.changed_at: float | None = None

    def read(self) -> dict | None:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):  # absent, or caught between writes on a filesystem without atomic rename
            return self.last
        if not isinstance(data, dict):
            return self.last
        if data != self.last:
            self.last, self.changed_at = data, time.monotonic()
        return data

    def age(self) -> float | None:
        self.read()
        return None if self.changed_at is None else time.monotonic() - self.changed_at


class TrainerWatch:
    """Worker side: a daemon thread that ends this process (``os._exit``) when the trainer's heartbeat is stale for
    ``timeout_s`` or names another run (exit 75), or says the trainer closed (exit 0: a closed trainer reads no more
    events, so whatever the worker is doing — idling after the last step, or mid-way through a step the trainer
    aborted on a signal — is of no use; sandboxed tool calls die with it, ``PR_SET_PDEATHSIG``). It reads the
    heartbeat every ``beat_interval(timeout_s)`` (≤ 1 s), well within the trainer's grace before its SIGKILL.
    ``first_wait_s``: how long the file may be absent at start."""

    def __init__(self, path: str, run_id: str, timeout_s: float, *, first_wait_s: float = 600.0):
        self.reader, self.run_id, self.timeout_s = BeatReader(path), run_id, timeout_s
        self.first_wait_s, self.t0 = first_wait_s, time.monotonic()
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="trainer-watch", daemon=True)

    def start(self) -> "TrainerWatch":
        self._thread.start()
        return self

    def verdict(self) -> str | None:
        """Why this worker must go now, or None."""
        data, age = self.reader.read(), self.reader.age()
        if data is None:
            return (f"no trainer heartbeat at {self.reader.path} after {self.first_wait_s:.0f}s"
                    if time.monotonic() - self.t0 > self.first_wait_s else None)
        if data.get("run_id") != self.run_id:
            return f"the run directory now belongs to run {data.get('run_id')} (this worker is of run {self.run_id})"
        self.closed = bool(data.get("closed"))
        if age is not None and age > self.timeout_s and not self.closed:
            return f"no trainer heartbeat for {age:.1f}s (> {self.timeout_s:g}s): the trainer is gone"
        return None

    def closed_now(self) -> bool:
        """Whether the trainer closed, read from its heartbeat now rather than at this thread's next beat (the
        trainer gives its workers a few seconds to leave before it kills them)."""
        if not self.closed:
            data = self.reader.read()
            self.closed = bool(data and data.get("run_id") == self.run_id and data.get("closed"))
        return self.closed

    def _run(self) -> None:
        while True:
            why = self.verdict()
            if why is not None:
                print(f"[worker] exiting: {why}", file=sys.stderr, flush=True)
                os._exit(75)
            if self.closed:
                print("[worker] the trainer closed: leaving", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(0)
            time.sleep(beat_interval(self.timeout_s))


# ------------------------------------------------------------------------------------------------ assignments
def _tag(key: bytes, body: dict) -> str:
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def assignment_path(run_dir: str, step: int, worker: int, n: int) -> str:
    return os.path.join(run_dir, "assign", "s%07d.w%d.n%d.json" % (step, worker, n))


def write_assignment(run_dir: str, key: bytes, *, run_id: str, step: int, worker: int, n: int, version: int,
                     traj_ids: list[str], reason: str) -> str:
    """Signs and writes one re-dispatch: ``traj_ids`` of ``step`` for ``worker``, sampled from ``version``."""
    body = {"format": ASSIGN_FORMAT, "run_id": run_id, "step": step, "worker": worker, "n": n, "version": version,
            "traj_ids": list(traj_ids), "reason": reason}
    path = assignment_path(run_dir, step, worker, n)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, {**body, "tag": _tag(key, body)})
    return path


_ASSIGN_NAME = re.compile(r"s(\d{7})\.w(\d+)\.n(\d+)\.json")


def read_assignments(run_dir: str, key: bytes, *, run_id: str, worker: int, done: set[str],
                     max_step: int) -> list[dict]:
    """This worker's not-yet-done assignments of steps <= ``max_step``, oldest first (file names in ``done`` are
    skipped; the new ones are added). A file that does not verify under the run's key, or names another run, is
    ignored with a warning."""
    d = os.path.join(run_dir, "assign")
    try:
        found = [(m, n) for n in os.listdir(d) for m in [_ASSIGN_NAME.fullmatch(n)] if m]
    except FileNotFoundError:
        return []
    names = [n for m, n in sorted(found, key=lambda x: (int(x[0][1]), int(x[0][3])))
             if int(m[2]) == worker and int(m[1]) <= max_step]
    out = []
    for name in names:
        if name in done:
            continue
        try:
            with open(os.path.join(d, name)) as f:
                data = json.load(f)
            tag = data.pop("tag")
        except (OSError, ValueError, KeyError, AttributeError):
            continue  # being written (not yet renamed) cannot happen; garbage is not ours to read twice
        done.add(name)
        if not hmac.compare_digest(str(tag), _tag(key, data)) or data.get("run_id") != run_id:
            log.warning("ignoring assignment %s: not signed by this run (%s)", name, run_id)
            continue
        out.append(data)
    return out


# ------------------------------------------------------------------------------------------------ ledger
@dataclasses.dataclass
class StepLedger:
    """Every trajectory of one step: used (delivered to the learner), re-dispatched (from a dead worker to a live
    one: id → (from, to, reason)), dropped (id, reason: duplicates, another step's, ...); and the worker failures
    seen during the step with their detection and re-dispatch times."""

    step: int
    expected: list[str]
    used: list[str] = dataclasses.field(default_factory=list)
    redispatched: dict[str, tuple[int, int, str]] = dataclasses.field(default_factory=dict)
    dropped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    failures: list[dict] = dataclasses.field(default_factory=list)

    def missing(self) -> list[str]:
        got = set(self.used)
        return [t for t in self.expected if t not in got]

    def row(self) -> dict:
        rec = [f["redispatch_s"] for f in self.failures if f.get("redispatch_s") is not None]
        return {"ledger_used": len(self.used), "ledger_redispatched": len(self.redispatched),
                "ledger_dropped": len(self.dropped), "worker_failures": len(self.failures),
                "recovery_s": max(rec) if rec else None}

    def line(self) -> str:
        by: dict[tuple[int, int, str], list[str]] = {}
        for t, v in self.redispatched.items():
            by.setdefault(v, []).append(t)
        parts = [f"{len(self.used)}/{len(self.expected)} used"]
        parts += [f"{len(ts)} re-dispatched from worker {a} to worker {b} ({why}): {', '.join(sorted(ts))}"
                  for (a, b, why), ts in sorted(by.items())]
        if self.dropped:
            parts.append(f"{len(self.dropped)} dropped: " + ", ".join(f"{t} ({why})" for t, why in self.dropped))
        return f"[tsync] step {self.step} ledger: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------ the fleet's side
class WorkerFailure(RuntimeError):
    """A rollout worker failed and the run cannot go on without it (budget spent, no live worker left, or a weight
    sync that needs every worker). ``worker``, ``step`` and ``missing`` (the step's trajectory ids not received)."""

    def __init__(self, msg: str, *, worker: int | None = None, step: int | None = None, missing: list[str] = ()):
        super().__init__(msg)
        self.worker, self.step, self.missing = worker, step, list(missing)


class WorkerSupervisor:
    """The fleet's watch over its rollout workers during a step (``check`` after every poll of the step's source).

    A worker fails when its process (started by this fleet) exited, when its heartbeat is stale for ``timeout_s``
    (hung: a process this fleet started is then SIGKILLed, so it cannot come back and send later), or, for a worker
    this fleet started, when it never beat within ``start_grace_s``. Its trajectories of the step that have not
    arrived are re-dispatched to live workers (a group's together, round-robin over the live workers), under the
    policy version ``version_of(group_id)``; its share of every later step is re-dispatched when the step begins.
    Each failure uses one unit of ``retries``; past it, or with no live worker left, ``check`` raises
    :class:`WorkerFailure` naming the worker and the missing trajectories.

    Limits: a hung worker this fleet did not start (``--rollout-launch external``) cannot be killed from here; if it
    wakes up, what it sends duplicates re-dispatched trajectories (dropped and counted as such in the ledger) or has a
    policy version no longer accepted; it stays out of the dispatch. Async mode re-dispatches under the version of the
    group's received trajectories (the worker reloads it from the weight files while they are kept); not run in a
    fault test yet."""

    def __init__(self, *, num_workers: int, groups_per_step: int, group_size: int, run_dir: str, run_id: str,
                 key: bytes, timeout_s: float, retries: int, procs: list, log_tail, start_grace_s: float = 300.0):
        self.W, self.G, self.N = num_workers, groups_per_step, group_size
        self.run_dir, self.run_id, self.key = run_dir, run_id, key
        self.timeout_s, self.retries, self.procs, self.log_tail = timeout_s, retries, procs, log_tail
        self.start_grace_s = max(start_grace_s, timeout_s)
        self.readers = [BeatReader(os.path.join(run_dir, "hb", f"worker{w}.json")) for w in range(num_workers)]
        self.dead: dict[int, dict] = {}
        self.failures = 0
        self.n_assign = 0
        self.t_start = time.monotonic()
        self.step: int | None = None
        self.ledger: StepLedger | None = None
        self.owner: dict[str, int] = {}
        self.version_of = lambda gid: 0
        self._next_check = 0.0

    def begin(self, step: int, ledger: StepLedger, version_of) -> None:
        """A new step: who owns which trajectory; a dead worker's share goes to the live ones right away."""
        self.step, self.ledger, self.version_of = step, ledger, version_of
        self.owner = {traj_id(group_id(step, g), i): g % self.W for g in range(self.G) for i in range(self.N)}
        for w, d in sorted(self.dead.items()):
            lost = sorted(t for t, o in self.owner.items() if o == w)
            self._redispatch(lost, w, f"dead since step {d['step']}: {d['why']}", None)

    def check(self, seen: set[str], streamed: set[str] = frozenset()) -> None:
        """``seen``: the step's trajectories received; ``streamed``: those with turns already streamed (OPD
        stream-turn) but no final event — a re-dispatched sample of one would continue another sample's turns."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + min(0.25, self.timeout_s / 4)
        for w in range(self.W):
            if w not in self.dead:
                why = self._failure(w)
                if why is not None:
                    self._fail(w, why, seen, streamed)

    def _beat(self, w: int) -> tuple[dict | None, float | None]:
        data, age = self.readers[w].read(), self.readers[w].age()
        if data is None or data.get("run_id") != self.run_id:  # none yet, or a previous run's file
            return None, None
        return data, age

    def _failure(self, w: int) -> str | None:
        p = self.procs[w] if w < len(self.procs) else None
        if p is not None and p.poll() is not None:
            return f"exited with code {p.returncode}"
        data, age = self._beat(w)
        if data is None:
            if p is not None and time.monotonic() - self.t_start > self.start_grace_s:
                return f"never sent a heartbeat in {self.start_grace_s:.0f}s"
            return None  # an external worker that has not started yet: the stall timeout covers it
        if age is not None and age > self.timeout_s:
            return f"sent no heartbeat for {age:.1f}s (> --rollout-heartbeat-timeout {self.timeout_s:g}s): hung"
        return None

    def _fail(self, w: int, why: str, seen: set[str], streamed: set[str]) -> None:
        t_detect, age = time.time(), self.readers[w].age()
        p = self.procs[w] if w < len(self.procs) else None
        if p is not None and p.poll() is None:  # hung: make sure it cannot wake up and send later
            p.send_signal(signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a zombie we cannot reap changes nothing here
                pass
        self.dead[w] = {"why": why, "step": self.step}
        self.failures += 1
        lost = sorted(t for t, o in self.owner.items() if o == w and t not in seen)
        log.warning("rollout worker %d %s during step %s; %d trajectories not received: %s", w, why, self.step,
                    len(lost), lost)
        beat = self.readers[w].last if (self.readers[w].last or {}).get("run_id") == self.run_id else None
        failure = {"worker": w, "why": why, "t_detect": t_detect, "last_beat_age_s": age, "lost": lost,
                   "last_beat_time": beat.get("time") if beat else None}
        if self.ledger is not None:
            self.ledger.failures.append(failure)
        live = [v for v in range(self.W) if v not in self.dead]
        partial = sorted(t for t in lost if t in streamed)
        if self.failures > self.retries or not live or partial:
            cause = (f"--rollout-retries {self.retries} spent ({self.failures} worker failures)"
                     if self.failures > self.retries else "no live rollout worker left" if not live else
                     f"{partial} had turns streamed already, and a new sample cannot continue them")
            raise WorkerFailure(
                f"step {self.step}: rollout worker {w} {why}; {cause}. {len(lost)} trajectories of the step were not "
                f"received from it: {lost}. Last lines of its log:\n{self.log_tail(w)}",
                worker=w, step=self.step, missing=lost)
        self._redispatch(lost, w, why, failure)

    def _redispatch(self, lost: list[str], src: int, why: str, failure: dict | None) -> None:
        live = [v for v in range(self.W) if v not in self.dead]
        if not lost:
            return
        if not live:
            raise WorkerFailure(f"step {self.step}: no live rollout worker left for {lost} (worker {src} {why})",
                                worker=src, step=self.step, missing=lost)
        groups: dict[str, list[str]] = {}
        for t in lost:
            _, g, _ = parse_traj_id(t)
            groups.setdefault(group_id(self.step, g), []).append(t)
        for j, (gid, tids) in enumerate(sorted(groups.items())):
            target = live[(self.n_assign + j) % len(live)]
            write_assignment(self.run_dir, self.key, run_id=self.run_id, step=self.step, worker=target,
                             n=self.n_assign + j, version=self.version_of(gid), traj_ids=tids,
                             reason=f"worker {src} {why}")
            for t in tids:
                self.owner[t] = target
                if self.ledger is not None:
                    self.ledger.redispatched[t] = (src, target, why)
        self.n_assign += len(groups)
        if failure is not None:
            failure["t_redispatch"] = time.time()
            # from the worker's last sign of life: its last heartbeat (its wall clock), else this reader's view
            last = failure["last_beat_time"] or failure["t_detect"] - (failure["last_beat_age_s"] or 0)
            failure["redispatch_s"] = failure["t_redispatch"] - last
