"""Multi-turn agent rollouts: generate → tool call → ``<result>`` → generate …, many trajectories at once.

One trajectory::

    prompt ─► engine turn (until </tool>, EOS, </answer>, or a length cap)
                 └─ </tool>: parse + run the tool (sandbox), append <result>…</result> tokens (loss_mask 0; the
                    tool's output encoded as plain text: it never becomes a special token id)
                    ─► next engine turn on prompt + everything so far … until stop / limits

Concurrency: every trajectory is an ``asyncio`` task. Tasks that need tokens enqueue a request with the
:class:`_Batcher`, which hands all waiting requests to ONE ``engine.generate`` call (on a dedicated engine
thread, so the event loop keeps serving tool completions and callbacks while the engine runs). While some
trajectories wait for their tools, the others are batched together. The batcher waits up to
``batch_wait_s`` for stragglers unless every live trajectory is already waiting.

Invariants of a :class:`Trajectory` (checked by the tests):

- ``token_ids[:prompt_len]`` is the prompt; ``len(token_ids) <= max_total_tokens``;
- ``loss_mask[t] == 1`` exactly on tokens the policy generated (inside a ``turn_spans`` entry), 0 on the prompt and
  on tool results; ``logprobs[t]`` is the behaviour log-prob of ``token_ids[t]`` given ``token_ids[:t]`` (0 where
  the mask is 0): compare ``logprobs[1:]`` with ``token_logprobs(model, token_ids)``;
- ``turn_spans[k] = (start, end)``: the half-open token range of generated turn k;
- every turn is sampled by the engine weights recorded in ``turn_versions``; ``policy_version`` is the first one.

KV reuse across turns: an engine with ``supports_sessions`` (the embedded engine) gets one session handle per
trajectory with every request and keeps the trajectory's keys and values between its turns, so a turn prefills only
what was appended since the previous one (the tool result and the turn's prefix); the handle is released when the
trajectory ends. Other engines get the whole context each turn (vLLM caches prefixes itself). Either way a turn is
sampled from exactly the conditional the learner recomputes (tested: reuse on == off, float64).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import inspect
import itertools
import time
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from megatron_tsync.model.tokenizer import TextCodec, encode_parts
from megatron_tsync.rollout.engine import Completion, RolloutEngine, SamplingConfig, derive_seed

# ------------------------------------------------------------------------------------------------ records


@dataclasses.dataclass
class ToolStep:
    """The outcome of one tool call as the agent sees it."""

    result_text: str
    """Text appended to the context, normally ``<result>…</result>``: a
    :class:`~megatron_tsync.model.tokenizer.Rendered` (``tools.format_tool_result``, a tool format's ``render_result``)
    whose markup is encoded with special tokens and the rest as plain text; a plain ``str`` is all plain text, so
    nothing a tool prints becomes a special token id."""
    ok: bool
    name: str | None = None
    args: str | None = None
    error: str | None = None
    wall_s: float = 0.0


@dataclasses.dataclass
class ToolCallRecord:
    turn: int
    name: str | None
    args: str | None
    ok: bool
    error: str | None
    result_span: tuple[int, int]
    """Half-open range of the result tokens in ``token_ids`` (may be shorter than the text if truncated)."""
    wall_s: float


@dataclasses.dataclass
class Trajectory:
    """One multi-turn rollout, token-aligned for the learner (see the module docstring)."""

    index: int
    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    turn_versions: list[int] = dataclasses.field(default_factory=list)
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    """"stop" (EOS / </answer>), "length" (token limit), "max_turns", or "error" (engine failure, see ``error``)."""
    policy_version: int = -1
    error: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    routing: Any = None
    """MoE engines recording routing: (P, L, k) experts of positions 0..P-1, each from the engine call that first
    computed it (a turn's generated tokens at their decode step, a tool result at the next turn's prefill);
    positions ≥ P (the last token, a final tool result) no engine computed. None otherwise."""

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def mixed_versions(self) -> bool:
        return len(set(self.turn_versions)) > 1


# ------------------------------------------------------------------------------------------------ text + tools


ToolExecutor = Callable[[str], "ToolStep | Awaitable[ToolStep]"]
"""Turn text (ending in ``</tool>``) -> :class:`ToolStep`; sync callables run on a thread pool."""


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _format(result) -> str:
    from megatron_tsync.rollout.tools import format_tool_result

    return format_tool_result(result)


def _observation_ids(codec: TextCodec, text: str, cap: int) -> list[int]:
    """The tokens of an observation (``encode_observation``), at most ``cap``: when longer, the text before its
    closing markup (the trailing markup parts, e.g. ``</result>``) is cut so that the closing markup is kept."""
    parts = encode_parts(codec, text)
    ids = [i for p, _ in parts for i in p]
    if len(ids) <= cap:
        return ids
    k = len(parts)
    while k > 0 and parts[k - 1][1]:
        k -= 1
    tail = [i for p, _ in parts[k:] for i in p]
    return ids[: max(0, cap - len(tail))] + tail


#: (trajectory, turn index) of the tool call being executed; set by the agent loop in each trajectory's task so
#: executors can look up per-call context (e.g. the latency profile's delay for this group/trajectory/turn).
CURRENT_CALL: contextvars.ContextVar = contextvars.ContextVar("tsync_current_tool_call", default=None)


class RegistryTools:
    """The default executor: parse the last ``<tool>NAME: ARGS</tool>`` of the turn and run it through the tool
    registry in the sandbox (``tools.execute_tool_call_async``).

    ``delay_fn(trajectory, turn) -> seconds`` (optional) adds real latency inside the sandboxed child, e.g. from a
    latency profile; it overrides the constant ``delay_s``.
    """

    def __init__(self, sandbox=None, *, delay_s: float = 0.0, delay_fn=None):
        from megatron_tsync.rollout.sandbox import Sandbox

        self.sandbox = sandbox or Sandbox()
        self.delay_s = delay_s
        self.delay_fn = delay_fn

    async def __call__(self, turn_text: str) -> ToolStep:
        from megatron_tsync.rollout import tools

        call = tools.parse_tool_call(turn_text)
        if call is None:
            call = tools.ToolCallError("no complete <tool>NAME: ARGS</tool> call before </tool>", (0, 0))
        delay = self.delay_s
        ctx = CURRENT_CALL.get()
        if self.delay_fn is not None and ctx is not None:
            delay = float(self.delay_fn(*ctx))
        res = await tools.execute_tool_call_async(call, self.sandbox, delay)
        name = getattr(call, "name", None)
        args = getattr(call, "args", None)
        return ToolStep(_format(res), res.ok, name, args, res.error, res.wall_s)


class FunctionTools:
    """Plain Python callables as tools (tests, trusted in-process tools): ``{name: fn(args) -> str}``.

    A missing/malformed call, an unknown tool or an exception becomes an error result; the loop continues.
    """

    def __init__(self, fns: dict[str, Callable[[str], str]]):
        self.fns = dict(fns)

    def __call__(self, turn_text: str) -> ToolStep:
        from megatron_tsync.rollout import tools

        t0 = time.perf_counter()
        call = tools.parse_tool_call(turn_text)
        if call is None or isinstance(call, tools.ToolCallError):
            msg = call.message if call is not None else "no complete <tool>NAME: ARGS</tool> call before </tool>"
            return ToolStep(_format(f"error: {msg}"), False, error=msg, wall_s=time.perf_counter() - t0)
        fn = self.fns.get(call.name)
        if fn is None:
            msg = f"unknown tool {call.name!r}; available: {', '.join(sorted(self.fns))}"
            return ToolStep(_format(f"error: {msg}"), False, call.name, call.args, msg, time.perf_counter() - t0)
        try:
            out = str(fn(call.args))
        except Exception as e:  # the agent sees the error; the rollout goes on
            msg = f"{type(e).__name__}: {e}"
            return ToolStep(_format(f"error: {msg}"), False, call.name, call.args, msg, time.perf_counter() - t0)
        return ToolStep(_format(out), True, call.name, call.args, None, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Limits and sampling of one agent rollout."""

    sampling: SamplingConfig
    """Per-turn sampling. ``tool_token_ids`` must hold the id of ``</tool>``; ``stop_token_ids`` EOS and
    ``</answer>``; ``max_new_tokens`` caps one turn; ``seed`` (optional) makes every turn reproducible: turn t of a
    trajectory samples with ``derive_seed(seed, key, t)``, ``key`` its metadata's ``seed_index`` when given (the
    rollout worker sets the trajectory's global index, so results do not depend on which worker ran it), else its
    position in the prompt list."""
    max_turns: int = 4
    """Generated turns per trajectory; a tool call in the last allowed turn ends it with "max_turns"."""
    max_total_tokens: int = 1024
    """Cap on prompt + generated + tool-result tokens."""
    max_result_tokens: int = 256
    """Tool-result tokens kept per call (the rest is cut, keeping the closing tag)."""
    batch_wait_s: float = 0.005
    """How long the batcher waits for more requests while some trajectories are still in tools."""
    max_num_seqs: int = 0
    """Requests one engine call takes at most (vLLM's ``max_num_seqs`` for the embedded engine); 0: every waiting
    one. The others wait for the next call."""
    frontier_first: bool = False
    """Serve the oldest open groups first: when more requests wait than one call takes, the earlier trajectories
    (metadata ``priority``, else prompt index; a step's groups are contiguous, so earlier groups) go first, and an
    engine that schedules by priority itself (vLLM's ``priority`` policy) gets each request's priority."""

    def __post_init__(self):
        if not self.sampling.tool_token_ids:
            raise ValueError("AgentConfig.sampling.tool_token_ids must contain the id of </tool>")
        if self.max_turns < 1 or self.max_total_tokens < 2:
            raise ValueError("max_turns ≥ 1 and max_total_tokens ≥ 2 required")
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs must be ≥ 0 (0: no cap), got {self.max_num_seqs}")


# ------------------------------------------------------------------------------------------------ batching


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    max_new: int
    seed: int | None
    future: asyncio.Future
    priority: int = 0  # lower is served first under frontier_first
    session: Any = None  # the trajectory's KV-reuse handle (engines with ``supports_sessions``)


class _Batcher:
    """Collects generation requests from concurrent trajectories into batched ``engine.generate`` calls."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingConfig, wait_s: float, idle_work=None, *,
                 max_num_seqs: int = 0, frontier_first: bool = False):
        self.engine = engine
        self.idle_work = idle_work  # () -> job(interrupt) or None: engine work for when no trajectory needs it
        self.sampling = sampling
        self.wait_s = wait_s
        self.max_num_seqs, self.frontier_first = max_num_seqs, frontier_first
        self.engine_priority = frontier_first and getattr(engine, "schedules_by_priority", False)
        self.sessions = bool(getattr(engine, "supports_sessions", False))
        self.served: list[list[int]] = []  # per engine call, the requests' priorities in the order taken (tests)
        self.pending: list[_Request] = []
        self.live = 0  # trajectories not finished yet
        self.wake = asyncio.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.batches: list[int] = []  # batch sizes, for metrics/tests

    async def generate(self, prompt: list[int], max_new: int, seed: int | None, priority: int = 0,
                       session: Any = None) -> Completion:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(prompt, max_new, seed, fut, priority, session))
        self.wake.set()
        return await fut

    def finished_one(self, session: Any = None) -> None:
        self.live -= 1
        if self.sessions and session is not None:
            self.engine.release_session(session)  # type: ignore[attr-defined]
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.live > 0 or self.pending:
            if not self.pending:
                # idle: no request waits, after the first batch (at the start the trajectories are about to ask)
                job = self.idle_work() if self.idle_work is not None and self.batches else None
                if job is not None:  # e.g. speculative drafting; it yields the engine when a request comes
                    self.wake.clear()
                    await loop.run_in_executor(self.pool, job, lambda: bool(self.pending) or self.live <= 0)
                    continue
                self.wake.clear()
                await self.wake.wait()
                continue
            deadline = loop.time() + self.wait_s
            while len(self.pending) < self.live and loop.time() < deadline:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
            batch, self.pending = self._take(self.pending)
            self.batches.append(len(batch))
            self.served.append([r.priority for r in batch])
            try:
                outs = await loop.run_in_executor(self.pool, self._generate, batch)
            except Exception as e:  # fail the waiting trajectories, keep serving the others
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, comp in zip(batch, outs):
                if not r.future.done():
                    r.future.set_result(comp)

    def _take(self, pending: list[_Request]) -> tuple[list[_Request], list[_Request]]:
        """(this call's requests, those left waiting): at most ``max_num_seqs``, earliest priority first under
        ``frontier_first`` (stable: arrival order among equals), else in arrival order."""
        if self.frontier_first:
            pending = sorted(pending, key=lambda r: r.priority)
        cap = self.max_num_seqs or len(pending)
        return pending[:cap], pending[cap:]

    def _generate(self, batch: list[_Request]) -> list[Completion]:
        """One engine call for the whole batch (on the engine thread); each request gets its own cap."""
        cap = max(r.max_new for r in batch)
        cfg = dataclasses.replace(self.sampling, max_new_tokens=cap)
        seeds = None
        if all(r.seed is not None for r in batch):
            seeds = [r.seed for r in batch]
        else:
            cfg = dataclasses.replace(cfg, seed=None)
        extra: dict[str, Any] = {"priorities": [r.priority for r in batch]} if self.engine_priority else {}
        if self.sessions:
            extra["sessions"] = [r.session for r in batch]
        outs = self.engine.generate([r.prompt for r in batch], cfg, n=1, seeds=seeds, **extra)
        return [_truncate(o[0], r.max_new) for o, r in zip(outs, batch)]


def _truncate(c: Completion, max_new: int) -> Completion:
    """The first ``max_new`` tokens of a completion (a valid sample under the smaller cap)."""
    if len(c.token_ids) <= max_new:
        return c
    return dataclasses.replace(
        c,
        token_ids=c.token_ids[:max_new],
        logprobs=c.logprobs[:max_new],
        sampling_logprobs=None if c.sampling_logprobs is None else c.sampling_logprobs[:max_new],
        finish_reason="length",
        routing=None if c.routing is None else c.routing[: len(c.routing) - (len(c.token_ids) - max_new)],
    )


# ------------------------------------------------------------------------------------------------ the loop

_SESSION_IDS = itertools.count()  # KV-reuse handles: unique per trajectory in this process


class AgentLoop:
    """Runs multi-turn agent rollouts on a :class:`RolloutEngine`.

    Args:
        engine: any engine of the protocol (embedded, vLLM adapter, …).
        codec: text <-> ids of the policy's tokenizer (:class:`TokenizerCodec`).
        config: limits and sampling.
        tools: turn text -> :class:`ToolStep` (sync or async); default :class:`RegistryTools` (sandboxed registry).
        on_turn: ``on_turn(traj, turn_index)`` right after turn ``turn_index`` is complete (its tokens and, for a
            tool turn, its ``<result>`` tokens are in ``traj``). Runs on the event-loop thread before the trajectory
            changes again: read or copy ``traj`` inside the callback.
        on_finish: ``on_finish(traj)`` once the trajectory is final (after its last ``on_turn``).
        idle_work: ``idle_work()`` is asked whenever no trajectory waits for the engine (all are in tool calls or
            done); it returns None or a job ``job(interrupt)`` run on the engine thread, which must return soon after
            ``interrupt()`` becomes True (a trajectory needs the engine, or none is left). Speculative drafting uses it.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        codec: TextCodec,
        config: AgentConfig,
        *,
        tools: ToolExecutor | None = None,
        on_turn: Callable[[Trajectory, int], None] | None = None,
        on_finish: Callable[[Trajectory], None] | None = None,
        idle_work: Callable[[], Callable | None] | None = None,
    ):
        self.engine = engine
        self.idle_work = idle_work
        self.codec = codec
        self.config = config
        self.tools = tools if tools is not None else RegistryTools()
        self.on_turn = on_turn
        self.on_finish = on_finish
        self.last_batch_sizes: list[int] = []
        self.last_served: list[list[int]] = []  # per engine call of the last run, its requests' priorities

    def run(self, prompts: Sequence[Sequence[int]], *, metadata: Sequence[dict] | None = None) -> list[Trajectory]:
        """Roll out every prompt (blocking); trajectories in prompt order."""
        return asyncio.run(self.run_async(prompts, metadata=metadata))

    async def run_async(
        self, prompts: Sequence[Sequence[int]], *, metadata: Sequence[dict] | None = None
    ) -> list[Trajectory]:
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"{len(metadata)} metadata entries for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not 0 < len(p) < self.config.max_total_tokens:
                raise ValueError(f"prompt {i} has {len(p)} tokens; need 1 ≤ len < max_total_tokens")
        batcher = _Batcher(self.engine, self.config.sampling, self.config.batch_wait_s, self.idle_work,
                           max_num_seqs=self.config.max_num_seqs, frontier_first=self.config.frontier_first)
        self.last_served = batcher.served
        batcher.live = len(prompts)
        trajs = [
            Trajectory(
                index=i,
                token_ids=[int(t) for t in p],
                prompt_len=len(p),
                loss_mask=[0] * len(p),
                logprobs=[0.0] * len(p),
                metadata=dict(metadata[i]) if metadata is not None else {},
            )
            for i, p in enumerate(prompts)
        ]
        server = asyncio.create_task(batcher.run())
        try:
            await asyncio.gather(*(self._rollout(t, batcher) for t in trajs))
        finally:
            await server
            batcher.pool.shutdown(wait=True)
            self.last_batch_sizes = batcher.batches
        return trajs

    async def _rollout(self, traj: Trajectory, batcher: _Batcher) -> None:
        cfg = self.config
        session = ("traj", next(_SESSION_IDS))
        try:
            turn = 0
            while traj.finish_reason is None:
                room = cfg.max_total_tokens - len(traj.token_ids)
                if room <= 0:
                    traj.finish_reason = "length"
                    break
                max_new = min(cfg.sampling.max_new_tokens, room)
                seed = None if cfg.sampling.seed is None else derive_seed(
                    cfg.sampling.seed, traj.metadata.get("seed_index", traj.index), turn)
                try:
                    comp = await batcher.generate(list(traj.token_ids), max_new, seed,
                                                  int(traj.metadata.get("priority", traj.index)), session)
                except Exception as e:
                    traj.finish_reason, traj.error = "error", f"engine: {type(e).__name__}: {e}"
                    break
                self._append_turn(traj, comp)
                if comp.finish_reason == "tool":
                    if turn + 1 >= cfg.max_turns:
                        traj.finish_reason = "max_turns"
                    elif len(traj.token_ids) >= cfg.max_total_tokens:
                        traj.finish_reason = "length"  # no room for a result: the tool is not run
                    else:
                        await self._run_tool(traj, turn, comp)
                else:
                    traj.finish_reason = comp.finish_reason  # "stop" or "length"
                if self.on_turn is not None:
                    self.on_turn(traj, turn)
                turn += 1
        finally:
            if traj.finish_reason is None:
                traj.finish_reason = "error"
            batcher.finished_one(session)
        if self.on_finish is not None:
            self.on_finish(traj)

    @staticmethod
    def _append_turn(traj: Trajectory, comp: Completion) -> None:
        version = comp.policy_version
        start = len(traj.token_ids)
        traj.token_ids.extend(comp.token_ids)
        traj.loss_mask.extend([1] * len(comp.token_ids))
        traj.logprobs.extend(comp.logprobs)
        traj.turn_spans.append((start, len(traj.token_ids)))
        traj.turn_versions.append(version)
        if comp.routing is not None:  # keep each position's first computation; append the new ones
            known = 0 if traj.routing is None else len(traj.routing)
            traj.routing = comp.routing if known == 0 else np.concatenate([traj.routing, comp.routing[known:]])
        if traj.policy_version < 0:
            traj.policy_version = version

    async def _run_tool(self, traj: Trajectory, turn: int, comp: Completion) -> None:
        cfg = self.config
        text = self.codec.decode(comp.token_ids)
        t0 = time.perf_counter()
        CURRENT_CALL.set((traj, turn))
        try:
            if _is_async(self.tools):
                step = await self.tools(text)
            else:  # sync executors run on the default thread pool: the loop keeps batching meanwhile
                step = await asyncio.get_running_loop().run_in_executor(None, self.tools, text)
                if inspect.isawaitable(step):
                    step = await step
        except Exception as e:  # an executor bug must not kill the rollout: the agent sees an error result
            msg = f"tool executor failed: {type(e).__name__}: {e}"
            step = ToolStep(_format(f"error: {msg}"), False, error=msg, wall_s=time.perf_counter() - t0)
        ids = _observation_ids(self.codec, step.result_text, cfg.max_result_tokens)
        room = cfg.max_total_tokens - len(traj.token_ids)
        if len(ids) >= room:  # no room left for another turn after the result
            ids = ids[: max(room, 0)]
            traj.finish_reason = "length"
        start = len(traj.token_ids)
        traj.token_ids.extend(ids)
        traj.loss_mask.extend([0] * len(ids))
        traj.logprobs.extend([0.0] * len(ids))
        traj.tool_calls.append(
            ToolCallRecord(turn, step.name, step.args, step.ok, step.error, (start, len(traj.token_ids)), step.wall_s)
        )
