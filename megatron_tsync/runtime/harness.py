"""Harness-driven rollouts: a rollout worker serves the OpenAI-compatible endpoint and runs the user's own agent.

With ``--harness-cmd CMD`` (a shell command, one process per episode) or ``--harness-fn MODULE:FN`` (an async
function, one coroutine per episode in the worker's event loop) the worker rolls out its share of each step by
running the harness once per trajectory against a :class:`~megatron_tsync.rollout.openai_server.ChatServer` on its
own engine, at the policy version of the step. The contract (docs/harness.md):

- inputs: ``OPENAI_BASE_URL`` (``http://127.0.0.1:PORT/v1``), ``OPENAI_API_KEY`` (any value is accepted),
  ``TSYNC_EPISODE_ID``, ``TSYNC_MODEL`` (the served model name) and ``TSYNC_TASK`` (JSON: ``prompt``, ``episode_id``,
  ``step``, ``group``, ``index``, ``max_turns``, ``max_new_tokens``, ``meta`` — the task instance's scalar metadata,
  never its answer) in the environment of the command; the same as keyword arguments ``base_url``, ``episode_id``,
  ``task`` (the dict), ``model`` of the function;
- every request names the episode (``X-Episode-Id`` header, or ``user``); the episode ends with
  ``POST {OPENAI_BASE_URL}/episodes/{TSYNC_EPISODE_ID}/finish``: with ``{"metadata": {"reward": R}}`` the harness's
  reward R is the trajectory's (checked against the run's reward spec: ``--reward-kind/--reward-range``, default
  the task's), without it the task's verifier scores the
  final transcript (the same verifier as the native agent loop);
- the harness gets ``--harness-timeout`` seconds per episode; then the command is killed (the coroutine
  cancelled). A command runs under ``harness_reaper.py`` (a subreaper in its own session): when its episode ends
  (clean exit, error or timeout) every process it started is killed and reaped, ``setsid`` / double-forked ones
  included; how many were left is counted in ``HarnessRunner.reaped``, logged per episode and in the step's line.

Each finished episode is sent to the learner at once as a signed ``TrajectoryEvent`` (exact sampled ids, loss mask,
engine log-probs, turn spans, policy version): streamed like a native trajectory. An episode that went wrong is sent
as a failed trajectory (status "error", the task's lowest reward, no gradient; its group stays whole) whose
``meta["harness_fail"]`` names the reason, counted per step in the log row and TensorBoard (:func:`harness_row`):

- ``harness_timeout``: still running at the timeout (killed);
- ``harness_bad_request``: ended (cleanly or not) without finish after the endpoint refused some of its requests
  (malformed JSON, a conversation that does not extend the episode, ...: an ``openai`` client raises on them);
- ``harness_crash``: the command exited non-zero (the function raised) without finishing, no request refused;
- ``harness_no_finish``: exited cleanly without finishing;
- ``harness_bad_reward``: finished with a reward that is not a finite number the run's reward spec admits.

A harness that finished its episode and then failed keeps its (whole) trajectory. Versions: the worker loads new
weights only between steps, after every episode of the step has ended, so no request is in flight at a weight
publish and no episode mixes versions (the endpoint would refuse such a request with 409 ``policy_version_changed``:
retryable by finishing the episode and starting a new one). Concurrency: all of a worker's episodes of a step run at
once; their concurrent requests are batched into one ``engine.generate`` call (``ChatServer``'s batcher).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import signal
import sys
import time

import numpy as np

from megatron_tsync.transport.ids import group_ids, traj_id

log = logging.getLogger("megatron_tsync.harness")

__all__ = ["HARNESS_REASONS", "HARNESS_TB_NAMES", "FAIL_KEY", "harness_row", "HarnessRunner"]

HARNESS_REASONS = ("harness_crash", "harness_timeout", "harness_bad_request", "harness_no_finish",
                   "harness_bad_reward")
FAIL_KEY = "harness_fail"
"""The event ``meta`` key naming a failed episode's reason."""
HARNESS_TB_NAMES = {r: f"rollout/{r}" for r in HARNESS_REASONS}
STDERR_TAIL = 600
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_reaper.py")
"""Runs each ``--harness-cmd`` episode (a subreaper: nothing the episode started outlives it)."""
REAPER_GRACE_S = 15.0
"""After SIGTERM at the timeout, how long the reaper has to kill the command's processes and report."""


def harness_row(samples, on: bool) -> dict:
    """The step's failed harness episodes per reason (all reasons, zeros included, when ``on``)."""
    if not on:
        return {}
    row = dict.fromkeys(HARNESS_REASONS, 0)
    for s in samples:
        r = s.meta.get(FAIL_KEY)
        if r in row:
            row[r] += 1
    return row


class _CountingEngine:
    """The worker's engine as the endpoint sees it, keeping the prompts per ``generate`` call (the batch sizes)."""

    def __init__(self, engine):
        self._engine = engine
        self.batches: list[int] = []

    def generate(self, prompts, *args, **kwargs):
        self.batches.append(len(prompts))
        return self._engine.generate(prompts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _server_class():
    from megatron_tsync.rollout.openai_server import ChatServer

    class HarnessServer(ChatServer):
        """The endpoint, keeping each trajectory the harness finished and the requests it refused, per episode."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)  # the HTTP transport's backlog (4096) takes a step's episodes at once
            self.finished: dict = {}
            self.refused: dict[str, list] = {}  # episode id -> [count, last message]

        def finish(self, episode_id, *args, **kwargs):
            traj = super().finish(episode_id, *args, **kwargs)
            self.finished[episode_id] = traj
            return traj

        def take(self, episode_id: str):
            """The trajectory so far of an episode nobody finished (None if it has none); the episode is gone."""
            try:
                return ChatServer.finish(self, episode_id)
            except Exception:  # never completed, or a request still in flight (then abandoned)
                try:
                    self.abort(episode_id)
                except Exception:
                    pass
                return None

        def respond(self, method, path, headers, body, *, trusted=False):
            status, out, extra = super().respond(method, path, headers, body, trusted=trusted)
            if 400 <= status < 500:
                eid = {k.lower(): v for k, v in headers.items()}.get("x-episode-id")
                if eid is None:
                    try:
                        eid = json.loads(body).get("user")
                    except Exception:
                        eid = None
                rec = self.refused.setdefault(str(eid), [0, ""])
                rec[0] += 1
                rec[1] = f"{status} {out.get('error', {}).get('message', '')}"[:300]
            return status, out, extra

    return HarnessServer


class HarnessRunner:
    """The harness side of one :class:`~megatron_tsync.runtime.worker.RolloutWorker` (see the module docstring)."""

    def __init__(self, worker, score_trajectory):
        import dataclasses

        from megatron_tsync.rollout.engine import SamplingConfig

        self.w, self.score_trajectory = worker, score_trajectory  # runtime.worker's (no import cycle)
        spec = worker.spec
        ro, rl = spec.rollout, spec.rl
        tok = worker.codec.tokenizer
        if ro.harness_chat_format == "tag":
            from megatron_tsync.rollout.tag_chat import parse_tag_tool_calls, tag_chat_template

            template, parser, sampling = tag_chat_template(tok), parse_tag_tool_calls, worker.config.sampling
        else:
            from megatron_tsync.rollout.openai_chat import ChatTemplate

            template, parser = ChatTemplate.from_hf_dir(spec.model_dir), None
            eos = () if tok.eos_token_id is None else (tok.eos_token_id,)
            sampling = SamplingConfig.from_config(ro, rl, stop_token_ids=eos)
        sampling = dataclasses.replace(sampling, seed=rl.seed)  # + crc32(episode id) and turn, per completion
        self.bos = tok.bos_token if isinstance(getattr(tok, "bos_token", None), str) else ""
        self.engine = _CountingEngine(worker.engine)
        from megatron_tsync.rollout.openai_server import HttpLimits, chat_limits

        # the endpoint is the worker's own, on loopback, for its one harness: no per-address share, and the runner
        # owns episode lifetimes (every episode is finished or taken at the end of its step), so no cap or expiry
        limits = chat_limits(rl.seq_length, max_connections_per_peer=HttpLimits.max_connections)
        self.server = _server_class()(self.engine, worker.codec, template, sampling=sampling,
                                      max_context_tokens=rl.seq_length, tool_parser=parser, limits=limits,
                                      max_episodes=None, episode_idle_s=None).start()
        self.fn = None
        if ro.harness_fn:
            module, _, name = ro.harness_fn.partition(":")
            self.fn = getattr(importlib.import_module(module), name)
            if not asyncio.iscoroutinefunction(self.fn):
                raise TypeError(f"--harness-fn {ro.harness_fn}: not an async function")
        self.timeout_s = float(ro.harness_timeout_s)
        self.failures: dict[str, int] = dict.fromkeys(HARNESS_REASONS, 0)
        # command episodes run, processes they left running when they ended, processes killed (cumulative)
        self.reaped = {"episodes": 0, "left": 0, "killed": 0}
        self._warned_subreaper = False

    def close(self) -> None:
        self.server.close()

    # ------------------------------------------------------------------------------------------------ a step
    async def rollout(self, step: int, items: list[tuple[int, int]], extra: dict) -> None:
        """Trajectory ``i`` of group ``g`` of ``step`` for each ``(g, i)`` of ``items``, all at once; each is sent
        the moment its episode ends."""
        spec = self.w.spec
        insts = self.w.task.sample_prompts(step, spec.rl.groups_per_step, spec.rl.seed)
        gids = group_ids(step, spec.rl.groups_per_step)
        t0 = time.perf_counter()
        calls0, failed0, left0 = len(self.engine.batches), dict(self.failures), self.reaped["left"]
        await asyncio.gather(*(self._episode(step, g, i, insts[g], gids[g], extra, t0) for g, i in items))
        for eid in list(self.server.episodes):  # episodes under ids the runner never gave out
            self.server.take(eid)
        self.server.refused.clear()
        batches = self.engine.batches[calls0:]
        failed = {k: v - failed0[k] for k, v in self.failures.items() if v > failed0[k]}
        left = self.reaped["left"] - left0
        if step == self.w.spec.start_step or failed or left:  # the first step, any step with failed episodes or leftovers
            print(f"[worker {self.w.spec.worker_id}] harness step {step}: {len(items)} episodes, {sum(batches)} "
                  f"completions in {len(batches)} engine calls (mean batch {sum(batches) / max(len(batches), 1):.1f}), "
                  f"{time.perf_counter() - t0:.1f}s; failed: {failed or 'none'}; processes left running at the end "
                  f"of an episode (killed): {left}", flush=True)

    def task_json(self, inst, eid: str, step: int, g: int, i: int) -> dict:
        rl = self.w.spec.rl
        prompt = inst.prompt_text
        if self.bos and prompt.startswith(self.bos):  # the chat template adds the tokenizer's BOS
            prompt = prompt[len(self.bos):]
        meta = {k: v for k, v in inst.meta.items() if isinstance(v, (str, int, float)) and k != "answer"}
        return {"episode_id": eid, "prompt": prompt, "step": step, "group": g, "index": i,
                "max_turns": rl.max_turns, "max_new_tokens": rl.max_new_tokens, "meta": meta}

    async def _episode(self, step: int, g: int, i: int, inst, gid: str, extra: dict, t0: float) -> None:
        tid = traj_id(gid, i)
        eid = tid if "redo" not in extra else f"{tid}r{extra['redo']}"
        task = self.task_json(inst, eid, step, g, i)
        reason, detail = await (self._run_fn(eid, task) if self.fn is not None else self._run_cmd(eid, task))
        traj = self.server.finished.pop(eid, None)
        refused = self.server.refused.pop(eid, None)
        if traj is not None:
            if reason is not None:
                log.warning("harness episode %s finished, then %s (%s): the trajectory is kept", eid, reason, detail)
            reason = None
        else:
            traj = self.server.take(eid)
            if refused and reason != "harness_timeout":  # the refusals first: an openai client raises on a 4xx
                then = f"; then {reason}: {detail}" if reason else ""
                reason, detail = "harness_bad_request", f"{refused[0]} refused request(s), the last: {refused[1]}{then}"
            elif reason is None:
                reason, detail = "harness_no_finish", f"the harness ended without POST /v1/episodes/{eid}/finish"
        env_ep = await self.w.env.start(inst.meta.get("env_task", inst)) if self.w.env is not None else None
        reward, status, err = await self._score(traj, inst, env_ep, reason, detail)
        if status == "error" and reason is None:
            reason = "harness_bad_reward" if err.startswith("harness_bad_reward") else None
        if reason is not None:
            self.failures[reason] += 1
        self._send(traj, tid, gid, step, reward, status, err, reason, extra, t0)

    async def _score(self, traj, inst, env_ep, reason, detail) -> tuple[float, str, str]:
        score_trajectory = self.score_trajectory
        spec = self.w.task.reward_spec
        floor = float(spec.lo)  # a failed episode counts with the task's lowest reward (the fleet's rule)
        if reason is not None or traj is None:
            if env_ep is not None:
                env_ep.close()
            return floor, "error", f"{reason}: {detail}"[:1000]
        if "reward" in traj.metadata:  # the harness's own reward
            if env_ep is not None:
                env_ep.close()
            r = traj.metadata["reward"]
            try:
                if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                    raise ValueError(f"{r!r} is not a finite number")
                self.w.spec.run_reward_spec().check(float(r))  # the run's --reward-kind/--reward-range
            except ValueError as e:
                return floor, "error", f"harness_bad_reward: {e}"[:1000]
            return float(r), "ok", ""
        return await score_trajectory(traj, self.w.codec, inst, env_ep, self.w.verifier, floor, spec)

    def _send(self, traj, tid, gid, step, reward, status, err, reason, extra, t0) -> None:
        from megatron_tsync.transport import TrajectoryEvent

        w = self.w
        if traj is None:
            ids, prompt_len, mask, lp, spans, version, finish, turns = [], 0, [], [], [], -1, "", 0
        else:
            ids, prompt_len, mask, lp = traj.token_ids, traj.prompt_len, traj.loss_mask, traj.logprobs
            spans, version, finish, turns = traj.turn_spans, traj.policy_version, traj.finish_reason, traj.num_turns
        mask = np.asarray(mask, dtype=np.uint8)
        meta = {"worker": w.spec.worker_id, "finish": finish or "", "latency_s": time.perf_counter() - t0,
                "turns": turns, **({"redo": extra["redo"]} if "redo" in extra else {}),
                **({FAIL_KEY: reason} if reason else {})}
        if version < 0:  # no completion at all: the version the worker serves
            version = w.engine.policy_version if w.engine.policy_version >= 0 else step
        ev = TrajectoryEvent(
            traj_id=tid, group_id=gid, group_size=w.spec.rl.group_size, policy_version=version,
            token_ids=np.asarray(ids, dtype=np.int32), prompt_len=prompt_len, loss_mask=mask,
            logprobs=np.asarray(lp, dtype=np.float32) * mask, reward=reward,
            turn_spans=[tuple(s) for s in spans], status=status, error=err, meta=meta)
        w.sender.send(ev, timeout_s=600)
        w.sent += 1
        w.status.update(sent=w.sent, step_sent=w.status.get("step_sent", 0) + 1)

    # ------------------------------------------------------------------------------------------------ harnesses
    def _inputs(self, eid: str, task: dict) -> dict:
        return {"base_url": self.server.url, "episode_id": eid, "task": task, "model": self.server.model_name}

    async def _run_cmd(self, eid: str, task: dict) -> tuple[str | None, str]:
        """Runs the command under ``harness_reaper.py`` (its own session, a subreaper that kills and reaps every
        process the episode left when it ends: exit, error or timeout) and counts what was left."""
        a = self._inputs(eid, task)
        env = dict(os.environ, OPENAI_BASE_URL=a["base_url"], OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "tsync"),
                   TSYNC_EPISODE_ID=eid, TSYNC_MODEL=a["model"], TSYNC_TASK=json.dumps(task))
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", REAPER, self.w.spec.rollout.harness_cmd, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)
        except OSError as e:
            return "harness_crash", f"cannot start the harness command: {e}"
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out, err, out = True, b"", await self._stop_reaper(eid, proc)
        report = self._reaped(eid, out)
        if timed_out:
            return "harness_timeout", f"still running after {self.timeout_s:g}s (--harness-timeout): killed"
        rc = report.get("rc", proc.returncode)
        if rc != 0:
            tail = err.decode(errors="replace").strip()
            last = tail.splitlines()[-1] if tail else "(no stderr)"  # the exception, first: logs cut messages short
            return "harness_crash", f"exit {rc}: {last[:200]} | stderr tail: {tail[-STDERR_TAIL:]}"
        return None, ""

    @staticmethod
    async def _stop_reaper(eid: str, proc) -> bytes:
        """SIGTERM to the reaper at the timeout: it kills the command and everything it started, and reports."""
        out = b""
        try:
            proc.send_signal(signal.SIGTERM)
            out = await asyncio.wait_for(proc.stdout.read(), REAPER_GRACE_S)
            await asyncio.wait_for(proc.wait(), REAPER_GRACE_S)
        except ProcessLookupError:
            pass
        except asyncio.TimeoutError:  # the reaper is gone or stuck; a process still holds its stderr
            log.error("harness episode %s: the process reaper did not end %gs after SIGTERM: killed; processes the "
                      "harness started may be left running", eid, REAPER_GRACE_S)
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        return out

    def _reaped(self, eid: str, out: bytes) -> dict:
        """The reaper's report (its last stdout line), counted in ``self.reaped``; {} (logged) without one."""
        try:
            report = json.loads(out.decode().strip().splitlines()[-1])
            left, killed = int(report["left"]), int(report["killed"])
        except (ValueError, IndexError, KeyError, TypeError):
            log.warning("harness episode %s: no report from the process reaper (killed?): processes the harness "
                        "started may be left running", eid)
            return {}
        if not report.get("subreaper") and not self._warned_subreaper:
            self._warned_subreaper = True
            log.warning("harness: prctl(PR_SET_CHILD_SUBREAPER) unavailable: only processes still linked to the "
                        "harness command are killed at the end of an episode (a double-forked one escapes)")
        self.reaped["episodes"] += 1
        self.reaped["left"] += left
        self.reaped["killed"] += killed
        if left:
            log.warning("harness episode %s left %d process(es) running; %d killed", eid, left, killed)
        return report

    async def _run_fn(self, eid: str, task: dict) -> tuple[str | None, str]:
        t = time.monotonic()
        try:
            await asyncio.wait_for(self.fn(**self._inputs(eid, task)), self.timeout_s)
        except asyncio.TimeoutError as e:
            if time.monotonic() - t >= self.timeout_s:
                return "harness_timeout", f"still running after {self.timeout_s:g}s (--harness-timeout): cancelled"
            return "harness_crash", f"{type(e).__name__}: {e}"[:STDERR_TAIL]
        except Exception as e:
            return "harness_crash", f"{type(e).__name__}: {e}"[:STDERR_TAIL]
        return None, ""
