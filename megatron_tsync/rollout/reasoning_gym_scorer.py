"""reasoning-gym's ``score_answer`` behind the sandbox boundary: model text is data here, never code.

Several reasoning-gym datasets ``eval`` the answer or hand it to ``sympy.parse_expr`` (countdown, puzzle24,
spiral_matrix, string_insertion, binary_matrix, n_queens, the integration and polynomial datasets): in the rollout
worker's own process an ``<answer>`` of a few hundred characters ran code as the worker's user and could monkeypatch
the scorer so that every later wrong answer scored 1.0, and ``9**9**9**9`` hung it. Here::

    trusted process (worker / trainer rank 0)          sandbox call (fork server with reasoning_gym imported: warm)
    ReasoningGymScorer.score(name, config, answer, entry)
      -> queued; one call per batch ---- batch.pkl ---->  batch parent (trusted SCORER_SRC, never sees answer text as
         (answers that arrive while a                      code; PR_SET_DUMPABLE 0), per answer in turn:
         call is in flight share the next)                  fork -> child: own process group, stdio on /dev/null,
                                                                     RLIMIT_CPU answer_cpu_s, score_answer(answer,
                                                                     entry), its float (or the exception's name) on
                                                                     a pipe of its own, exit
                                                            parent: waits answer_wall_s at most (then SIGKILL), kills
                                                                    the child's group, checks that nothing of it is
                                                                    left (else stops: the rest are re-queued)
                                                            an INERT answer (<= 64 of "0-9+-., ", or None: no name,
                                                            call, power or subscript, so no code under any eval) is
                                                            scored by the parent itself under a CPU timer, no fork
      <- one JSON line on stdout: a verdict per answer --
      validates each: a finite float in [lo, hi], else ScorerFailed(reason)

Answers and entries go in as a pickle FILE written by the trusted side and read inside the sandbox (pickle flows one
way: trusted -> sandbox; it keeps the entries' tuples and numbers exactly as the dataset made them); nothing
untrusted is interpolated into source. What comes back is one line of JSON, at most ``max_output_bytes``, each value
re-checked here. A child cannot write that line (its stdout is /dev/null; the parent is not dumpable, so neither its
``/proc/PID/fd`` nor ptrace is open to it), cannot reach another answer (each runs in a fresh fork of the parent,
which never ran answer code) and nothing it patches outlives it.

What it CAN do: decide its own verdict (code that runs where ``score_answer`` runs can write its own pipe). That is
reasoning-gym's design (a dataset that ``eval``\\s the answer trusts it); the datasets that do are listed above and in
docs/threat_model.md.

Failures are counted, never silent: :class:`ScorerFailed` carries a reason code (``scorer_timeout``,
``scorer_cpu_limit``, ``scorer_memory_limit``, ``scorer_raised``, ``scorer_bad_score``, ``scorer_failed``); the worker
turns it into an "error" trajectory whose error text starts with that code (``runtime/worker.py: score_trajectory``).

Cost (measured, see docs/threat_model.md): one sandbox call per batch, plus one fork of the warm parent per answer
that is not inert (~6 ms of CPU: the parent holds reasoning-gym's ~120 MB).
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig

__all__ = ["ScorerFailed", "ScorerLimits", "ReasoningGymScorer", "SCORER_SRC", "REASONS"]

REASONS = ("scorer_timeout", "scorer_cpu_limit", "scorer_memory_limit", "scorer_raised", "scorer_bad_score",
           "scorer_failed")
_MARK = "@@tsync-rg-scores@@ "


class ScorerFailed(Exception):
    """The dataset's scorer gave no usable score for one answer; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ScorerLimits:
    """Limits of the sandboxed scorer (per answer, and per batch call)."""

    answer_cpu_s: int = 3
    """CPU seconds of one answer's scoring (RLIMIT_CPU of its child): ``9**9**9**9`` stops here."""
    answer_wall_s: float = 10.0
    """Wall seconds of one answer's scoring; its child is killed after it."""
    answer_memory_bytes: int = 2 << 30
    """Memory of the whole call (its cgroup; the children run one at a time), and RLIMIT_AS + 2 GiB per process
    (the warm parent's address space is ~0.3 GiB before any answer)."""
    batch_wall_s: float = 60.0
    """A batch call starts no answer after this many seconds; the rest are re-queued into a new call."""
    max_batch: int = 32
    """Answers per sandbox call."""
    max_inflight: int = 2
    """Sandbox calls in flight at once (answers that arrive meanwhile wait for the next call)."""


# Trusted source run by the call's target (Sandbox.run_source) in the fork server's warm interpreter; its only input is
# batch.pkl, written by the trusted side.
SCORER_SRC = r'''
import ctypes, json, os, pickle, re, resource, select, signal, sys, time
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no child may open /proc/<us>/fd or /proc/<us>/mem
t_start = time.monotonic()
with open("batch.pkl", "rb") as f:
    job = pickle.load(f)
os.unlink("batch.pkl")
import reasoning_gym
datasets, out = {}, []
def dataset(name, config):
    key = (name, repr(sorted(config.items())))
    if key not in datasets:
        datasets[key] = reasoning_gym.create_dataset(name, seed=0, size=1, **config)
    return datasets[key]
def child(ds, answer, entry, wr):
    try:
        os.setpgid(0, 0)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.dup2(wr, 3)
        os.closerange(4, 1 << 16)
        resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))
        try:
            msg = "ok %r" % (float(ds.score_answer(answer, entry)),)
        except MemoryError:
            msg = "memory"
        except BaseException as e:
            msg = "raised %s: %s" % (type(e).__name__, str(e)[:200])
        os.write(3, msg.replace("\n", " ").encode("utf-8", "replace")[:1023] + b"\n")
    finally:
        os._exit(0)
def strays():
    if not job["pidns"]:
        return False
    me = os.getpid()
    return any(p.isdigit() and int(p) not in (1, me) for p in os.listdir("/proc"))
def one(ds, answer, entry):
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        child(ds, answer, entry, wr)
    os.close(wr)
    try:
        os.setpgid(pid, pid)  # also here: no window where killpg below misses it
    except OSError:
        pass
    buf, deadline, timed_out = b"", time.monotonic() + job["wall_s"], False
    while len(buf) < 1024 and b"\n" not in buf:  # one line; not EOF (a process it left may hold the pipe open)
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([rd], [], [], left)[0]:
            timed_out = True
            break
        data = os.read(rd, 1024)
        if not data:
            break
        buf += data
    os.close(rd)
    try:  # before the wait: until it is reaped the child's pid (its group's id) cannot be reused
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    _, st = os.waitpid(pid, 0)
    if timed_out:
        return ["scorer_timeout", "no score after %gs" % job["wall_s"]]
    if os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGXCPU and not buf:
        return ["scorer_cpu_limit", "killed at %ds of CPU" % job["cpu_s"]]
    if os.WIFSIGNALED(st) and not buf:
        return ["scorer_failed", "killed by signal %d" % os.WTERMSIG(st)]
    text = buf.split(b"\n")[0].decode("utf-8", "replace")
    if text == "memory":
        return ["scorer_memory_limit", "MemoryError"]
    if text.startswith("raised "):
        return ["scorer_raised", text[7:]]
    if text.startswith("ok "):
        return ["ok", text[3:40]]
    return ["scorer_bad_score", "unreadable report %r" % text[:60]]
INERT = re.compile(r"[0-9+\-., ]{0,64}\Z")  # no name, call, power or subscript: no code, whatever evals it
class Budget(BaseException):  # not an Exception: a dataset's "except Exception" must not swallow it
    pass
def over_budget(signum, frame):
    raise Budget()
signal.signal(signal.SIGPROF, over_budget)
def inline(ds, answer, entry):  # an inert answer, scored here (no fork) under a CPU timer
    signal.setitimer(signal.ITIMER_PROF, job["cpu_s"])
    try:
        return ["ok", repr(float(ds.score_answer(answer, entry)))[:40]]
    except Budget:
        return ["scorer_cpu_limit", "stopped at %ds of CPU" % job["cpu_s"]]
    except MemoryError:
        return ["scorer_memory_limit", "MemoryError"]
    except Exception as e:
        return ["scorer_raised", "%s: %s" % (type(e).__name__, str(e)[:200])]
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
for i, req in enumerate(job["requests"]):
    if time.monotonic() - t_start > job["batch_s"]:
        break
    try:
        ds = dataset(req["dataset"], req["config"])
    except BaseException as e:
        out.append(["scorer_raised", "create_dataset: %s: %s" % (type(e).__name__, str(e)[:200])])
        continue
    answer = req["answer"]
    if answer is None or (type(answer) is str and INERT.match(answer)):
        out.append(inline(ds, answer, req["entry"]))
        if out[-1][0] == "scorer_cpu_limit":  # interrupted mid-way: the dataset's state is not trusted further
            break
        continue
    out.append(one(ds, answer, req["entry"]))
    if strays():  # something of that answer outlived its group: the rest go to a fresh call
        break
sys.stdout.write("\n%s%s\n" % (MARK, json.dumps(out)))
'''.replace("MARK", repr(_MARK))


def _sandbox_config(limits: ScorerLimits) -> SandboxConfig:
    return SandboxConfig(wall_timeout_s=limits.batch_wall_s + limits.answer_wall_s + 30.0,
                         cpu_seconds=int(limits.batch_wall_s) + 30, memory_bytes=limits.answer_memory_bytes + (2 << 30),
                         total_memory_bytes=limits.answer_memory_bytes, max_output_bytes=1 << 18, max_processes=64,
                         preload=("reasoning_gym",))


class ReasoningGymScorer:
    """Scores answers with reasoning-gym's ``score_answer`` in the sandbox (see the module docstring). Thread-safe;
    ``await score(...)`` from any event loop. ``close()`` stops its sandbox's fork server."""

    def __init__(self, limits: ScorerLimits | None = None, sandbox: Sandbox | None = None,
                 reward_range: tuple[float, float] = (0.0, 1.0)):
        self.limits = limits or ScorerLimits()
        self._sandbox = sandbox
        self.reward_range = reward_range
        self._lock = threading.Lock()
        self._queue: list[tuple[dict, Any, asyncio.AbstractEventLoop]] = []
        self._inflight = 0  # drain threads alive
        self._starting = 0  # of which not yet taken their first batch
        self.calls = 0
        """Sandbox calls made so far (for the overhead figures)."""

    @property
    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(_sandbox_config(self.limits))
            return self._sandbox

    async def score(self, dataset: str, config: dict, answer: str | None, entry: dict) -> float:
        """The dataset's score of `answer` for `entry` (a float in ``reward_range``); raises :class:`ScorerFailed`."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = {"dataset": dataset, "config": dict(config), "answer": answer, "entry": dict(entry)}
        with self._lock:
            self._queue.append((req, fut, loop))
        loop.call_soon(self._kick)  # after the other answers ready in this turn of the loop have queued too
        verdict, value = await fut
        return self._check(verdict, value, dataset)

    def _check(self, verdict: str, value: str, dataset: str) -> float:
        if verdict != "ok":
            raise ScorerFailed(verdict if verdict in REASONS else "scorer_failed", f"{dataset}.score_answer: {value}")
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise ScorerFailed("scorer_bad_score", f"{dataset}.score_answer gave {str(value)[:40]!r}") from None
        lo, hi = self.reward_range
        if not math.isfinite(reward) or not lo <= reward <= hi:
            raise ScorerFailed("scorer_bad_score", f"{dataset}.score_answer gave {reward!r}, outside [{lo}, {hi}]")
        return reward

    def _kick(self) -> None:
        """Start a drain thread unless one is about to take the queue or ``max_inflight`` calls are running."""
        with self._lock:
            if not self._queue or self._starting or self._inflight >= self.limits.max_inflight:
                return
            self._inflight += 1
            self._starting += 1
        threading.Thread(target=self._drain, daemon=True, name="rg-scorer").start()

    def _drain(self) -> None:
        """One worker thread: runs batches while answers are queued, then retires."""
        first = True
        while True:
            with self._lock:
                if first:
                    self._starting, first = self._starting - 1, False
                batch, self._queue = self._queue[:self.limits.max_batch], self._queue[self.limits.max_batch:]
                if not batch:
                    self._inflight -= 1
                    return
            try:
                verdicts = self._run(batch)
            except Exception as e:  # never strand an awaiting trajectory
                verdicts = [["scorer_failed", f"{type(e).__name__}: {e}"]] * len(batch)
            for (_, fut, loop), v in zip(batch, verdicts):
                try:
                    loop.call_soon_threadsafe(_resolve, fut, (v[0], v[1]))
                except RuntimeError:  # that event loop is closed: nobody awaits this answer any more
                    pass

    def _run(self, batch: list) -> list[list[str]]:
        """Verdicts for `batch`: one call; answers it did not reach (a stray process, the batch's time) go to further
        calls; a batch of one whose call gave no report is that answer's ``scorer_failed``."""
        verdicts: list[list[str]] = []
        pending = [req for req, _, _ in batch]
        while pending:
            got, why = self._call(pending)
            if not got:
                if len(pending) == 1:
                    return verdicts + [["scorer_failed", why]]
                for req in pending:  # one answer broke the call: each alone, so only it fails
                    more, why = self._call([req])
                    verdicts.append(more[0] if more else ["scorer_failed", why])
                return verdicts
            verdicts += got
            pending = pending[len(got):]
        return verdicts

    def _call(self, requests: list[dict]) -> tuple[list[list[str]], str]:
        lim, sb = self.limits, self.sandbox
        job = {"requests": requests, "cpu_s": int(lim.answer_cpu_s), "wall_s": float(lim.answer_wall_s),
               "batch_s": float(lim.batch_wall_s), "pidns": bool(sb._caps["ns"].get("pid"))}
        self.calls += 1
        res = sb.run_source(SCORER_SRC, files={"batch.pkl": pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)})
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARK)]
        if not lines:
            detail = res.error or f"exit {res.exit_code}"
            tail = res.stderr.strip().splitlines()[-1:] if res.stderr.strip() else []
            return [], f"no report from the scorer call ({detail}{': ' + tail[0][:200] if tail else ''})"
        try:
            got = json.loads(lines[-1][len(_MARK):])
        except ValueError as e:
            return [], f"unreadable scorer report: {e}"
        ok = (isinstance(got, list) and len(got) <= len(requests)
              and all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in got))
        return (got, "") if ok else ([], "malformed scorer report")

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


def _resolve(fut: asyncio.Future, value: tuple[str, str]) -> None:
    if not fut.done():
        fut.set_result(value)
